"""How a batch reaches its client: its slot lent in place (same host), its bytes copied inline, or
its bytes sent on the call's data connection (the socket data plane).

``Transport.encode`` makes the decision for each batch of a stream, beside the slots and leases it
depends on (the gRPC servicer only yields what it returns):

* shared memory (the stream asked for it and named an open session): the batch's own slot is lent
  under a lease, whoever else holds it (the computation's reorder buffer and history, other
  clients' leases: ``SlotPool`` counts references). Nothing is copied; the message carries the
  slot's name and the tensors' offsets. Clients map slots copy-on-write (``MAP_PRIVATE``), so a
  client writing into its tensors never reaches the slot or another reader.
* inline (asked for, or the session holds ``max_leases_per_session`` already and does not give
  one back within ``LEASE_WAIT_S``): the tensors are copied out of the slot into the message
  (``batchd.wire.encode_batch``; LZ4-compressed if asked).
* socket (a Batches call on a server with a data plane: ``Stream.request.transport`` "socket"):
  the message carries the tensors' offsets into the payload (``socket_payload``) and no data;
  the servicer then writes the payload from the slot on the call's data connection
  (server/serve/dataplane.py), the kernel copying it out of the slot.

Any way, a ragged field (``TensorLayout.sample_shapes``: the samples' values back to back) goes
with its per-sample shapes and element offsets (``ragged_fields``; ``Tensor`` in loader.proto); on
the shared-memory path its values stay in the slot like any other field's.

Waiting at the lease cap. gRPC buffers small shared-memory messages far ahead of the client, so a
server faster than its client's training loop reaches the session's lease cap in a few batches;
copying every later batch inline (most of an epoch, measured) is what zero-copy must avoid. So at
the cap ``encode(patient=True)`` waits for a lease to come back (the client still has every lent
batch to consume meanwhile); the caller gives up after ``LEASE_WAIT_S``, the session is marked
hoarding (``LeaseTable.hoarding``) and goes inline without waiting until it releases one.

``bytes_copied`` counts the batch bytes copied out of slots, per stream transport ("shm" counts
the batches of shared-memory streams that fell back to inline; "socket" the payloads, padding
included, of data-plane batches), since the server started;
``Stream.bytes_copied`` the same per stream. LZ4 counts the uncompressed bytes it read.

``Transport.release`` applies a ReleaseLeases request: leases the client freed, a call it
abandoned (see ``LeaseTable.abandon``), and the progress it reports per call, which become the
stream's ``batches_taken`` / ``samples_taken`` (``Stream.took``). A Batches call carries the same
on the call itself (``release_leases``, ``progress``), without a unary call per batch.
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any, Callable

import lz4.frame as lz4_frame

from batchd import datawire, wire
from batchd.server.compute.protocol import TensorLayout
from batchd.server.compute.samples import DECODE_KINDS
from batchd.server.serve.leases import LeaseTable
from batchd.server.shm import SlotPool
from batchd.server.serve.stream import ReadyBatch, Stream
from batchd.v1 import loader_pb2 as pb

STAGE_FIELDS = {name[: -len("_seconds")]: name for name in wire.WireTimings.__slots__ if name.endswith("_seconds")}
LEASE_WAIT_S = 2.0  # how long a stream at its session's lease cap waits for one to come back
WAIT_SLICE_S = 0.25  # ... in slices, so that the caller sees a cancelled call


class Transport:
    """Lend or copy, and account for it. Thread-safe (RPC threads call every method)."""

    def __init__(self, slots: SlotPool, leases: LeaseTable, busy_ratio: Callable[[Stream], float] = lambda s: 0.0,
                 workers: Callable[[], int] = lambda: 0):
        """busy_ratio(stream): the workers' busy ratio since ``stream``'s first batch (0..1, ``Loader``),
        written into each of its batches' timings."""
        self.slots, self.leases = slots, leases
        self.busy_ratio = busy_ratio
        self.workers = workers  # the pool's worker processes now (BatchTimings.workers)
        self._lock = threading.Lock()
        self._open: dict[int, Stream] = {}  # stream id -> open stream
        self._tags: dict[tuple[str, str], Stream] = {}  # (session, stream_tag) -> open stream
        self.bytes_copied = {"shm": 0, "inline": 0, "socket": 0}
        # seconds per BatchTimings stage, summed over every batch sent (batchd_batch_stage_seconds_total)
        self.stage_seconds = dict.fromkeys(STAGE_FIELDS, 0.0)
        # images decoded by kind and pixels decoded, over every batch sent (batchd_decodes_total,
        # batchd_decoded_pixels_total; the workers count them, server/compute/samples.py)
        self.decodes = dict.fromkeys(DECODE_KINDS, 0)
        self.decoded_pixels = 0
        # slices of WAIT_SLICE_S a stream at its session's lease cap waited out with no lease back
        self.lease_waits_run_out = 0

    def open(self, stream: Stream) -> None:
        """Start accounting for ``stream`` (its progress reports and released leases count as taken)."""
        r = stream.request
        with self._lock:
            self._open[stream.id] = stream
            if r.stream_tag:
                self._tags[(r.session, r.stream_tag)] = stream

    def close(self, stream: Stream) -> None:
        """``stream``'s call ended on the server: its leases still out stay (until released or abandoned)."""
        r = stream.request
        with self._lock:
            self._open.pop(stream.id, None)
            if r.stream_tag and self._tags.get((r.session, r.stream_tag)) is stream:
                del self._tags[(r.session, r.stream_tag)]
        if r.stream_tag and r.transport == "shm":
            self.leases.call_ended(r.session, r.stream_tag)

    def abandoned(self, stream: Stream) -> bool:
        """The client said it stopped reading this call (ReleaseLeases.abandoned_stream)."""
        r = stream.request
        return bool(r.stream_tag) and r.transport == "shm" and self.leases.is_abandoned(r.session, r.stream_tag)

    def encode(self, stream: Stream, batch: ReadyBatch, *, patient: bool = False) -> bytes | None:
        """The serialized ``Batch`` for ``stream``'s client: lent if it can be, else inline.

        patient: at the session's lease cap, wait up to ``WAIT_SLICE_S`` for a lease to come back and
        return None (call again, patient until ``LEASE_WAIT_S`` has passed); not patient at the cap:
        the session is marked hoarding and the batch goes inline.
        The caller still holds ``batch`` (and releases it afterwards with ``stream.release``); a
        lease takes a reference of its own on the slot.
        """
        r = stream.request
        t0 = time.perf_counter()
        lease = None
        if r.transport == "shm":
            samples = batch.tensors[0].samples if batch.tensors else 0
            lease = self.leases.lend(r.session, batch.slot, tag=r.stream_tag, samples=samples, stream=stream.id)
            if lease is None and self.leases.full(r.session):
                if patient:
                    if not self.leases.wait_for_room(r.session, WAIT_SLICE_S):
                        with self._lock:
                            self.lease_waits_run_out += 1
                    return None
                self.leases.hoarding(r.session)
        if lease is not None:
            tensors = [wire.WireTensor(t.name, t.dtype, t.shape, offset=t.offset, **ragged_fields(t))
                       for t in batch.tensors]
            return wire.encode_batch(batch.batch_index, r.epoch, stream.num_batches, tensors, segment=batch.slot.name,
                                     lease=lease, skipped=batch.skipped, timings=self._timings(stream, batch, t0),
                                     open_seq=stream.open_seq)
        if r.transport == "socket":  # the bytes follow on the data connection (server/serve/dataplane.py)
            pieces, length = socket_payload(batch)
            tensors = [wire.WireTensor(t.name, t.dtype, t.shape, offset=piece.offset, **ragged_fields(t))
                       for t, piece in zip(batch.tensors, pieces)]
            with self._lock:
                self.bytes_copied["socket"] += length
                stream.bytes_copied += length
            return wire.encode_batch(batch.batch_index, r.epoch, stream.num_batches, tensors, skipped=batch.skipped,
                                     timings=self._timings(stream, batch, t0), open_seq=stream.open_seq)
        buf = batch.slot.buf
        tensors, copied = [], 0
        for t in batch.tensors:
            data = buf[t.offset : t.offset + t.nbytes]
            copied += t.nbytes
            if r.compression == "lz4":
                tensors.append(wire.WireTensor(t.name, t.dtype, t.shape, lz4_frame.compress(data),
                                               compression=pb.COMPRESSION_LZ4, **ragged_fields(t)))
            else:
                tensors.append(wire.WireTensor(t.name, t.dtype, t.shape, data, **ragged_fields(t)))
        data = wire.encode_batch(batch.batch_index, r.epoch, stream.num_batches, tensors, skipped=batch.skipped,
                                 timings=self._timings(stream, batch, t0), open_seq=stream.open_seq)
        with self._lock:
            self.bytes_copied[r.transport] += copied
            stream.bytes_copied += copied
        return data

    def _timings(self, stream: Stream, batch: ReadyBatch, t0: float) -> wire.WireTimings:
        """The batch's ``BatchTimings``: its worker's stages, its waits, and ``send`` from
        ``stream.send_started`` (the first ``encode`` of this batch, as the servicer sets it; else
        ``t0``, this one) until now. The one copy of an inline batch's bytes into the message comes
        after (``encode_batch`` joins them), so it is not in ``send`` (about 0.1 ms per MB)."""
        t = batch.timings
        start = t0 if stream.send_started is None else stream.send_started
        timings = wire.WireTimings(
            queued_seconds=t.get("queued", 0.0), read_seconds=t.get("read", 0.0), decode_seconds=t.get("decode", 0.0),
            pipeline_seconds=t.get("pipeline", 0.0), cache_seconds=t.get("cache", 0.0),
            write_seconds=t.get("write", 0.0), reorder_seconds=stream.reorder_seconds,
            send_seconds=time.perf_counter() - start, read_io_seconds=t.get("read_io", 0.0),
            cache_hits=int(t.get("cache_hits", 0)), worker=int(t.get("worker", 0)),
            workers_busy_ratio=min(1.0, max(0.0, self.busy_ratio(stream))), workers=self.workers())
        with self._lock:
            for stage, name in STAGE_FIELDS.items():
                self.stage_seconds[stage] += getattr(timings, name)
            for kind in DECODE_KINDS:
                self.decodes[kind] += int(t.get(f"decode_{kind}", 0))
            self.decoded_pixels += int(t.get("decoded_pixels", 0))
        return timings

    def release(self, request: pb.ReleaseLeasesRequest) -> int:
        """Apply a ReleaseLeases request (leases freed, a call abandoned, progress per call).
        Returns how many leases it released (the abandoned ones not counted)."""
        session = request.session
        released = self.release_leases(session, request.leases) if request.leases else 0
        if request.abandoned_stream:
            self.leases.abandon(session, request.abandoned_stream, request.received_leases)
        with self._lock:
            reported = [(self._tags.get((session, p.stream_tag)), p) for p in request.progress if p.stream_tag]
        for stream, p in reported:
            if stream is not None:
                progress(stream, p)
        return released

    def release_leases(self, session: str, leases) -> int:
        """The client freed ``leases`` of ``session`` (ReleaseLeasesRequest.leases, or a Batches call's
        BatchesControl.release): their slots go back, and each counts as taken on the stream it was
        sent on (until that stream's client reports progress). Unknown ids are ignored. Returns how
        many were released."""
        released = self.leases.release(session, leases)
        with self._lock:
            credited = [(self._open.get(lease.stream), lease.samples) for lease in released]
        for stream, samples in credited:
            if stream is not None:
                stream.took(1, samples, reported=False)
        return len(released)


def progress(stream: Stream, p: pb.StreamProgress) -> None:
    """What ``stream``'s client reports it took (StreamProgress; its stream_tag is not read)."""
    stream.took(p.batches_taken, p.samples_taken, reported=True)
    if p.verdict:  # a client that profiles its loop (batchd.client.loader.timings)
        stream.client_waits(p.wait_ratio, p.verdict)


def socket_payload(batch: ReadyBatch) -> tuple[list[datawire.Piece], int]:
    """Where ``batch``'s tensors go in its data-plane payload (``batchd.datawire.payload_layout``:
    64-byte aligned, zeros between), and the payload's length in bytes."""
    return datawire.payload_layout((t.offset, t.nbytes) for t in batch.tensors)


def ragged_fields(t: TensorLayout) -> dict[str, Any]:
    """``Tensor``'s sample_ndim, sample_shapes, sample_offsets for a ragged field (see loader.proto);
    none for a stacked one. Raises ValueError if the layout's sample shapes do not fit its values
    (a bug in the worker that laid it out: never send a layout a client would misread)."""
    if t.sample_shapes is None:
        return {}
    ndim = len(t.sample_shapes[0]) if t.sample_shapes else 1  # B = 0: no shapes, still ragged
    if t.dtype in ("str", "bytes") and ndim != 1:
        raise ValueError(f"field {t.name!r}: {t.dtype} samples must have one dimension, not {ndim}")
    offsets = [0]
    for shape in t.sample_shapes:
        if len(shape) != ndim or any(d < 0 for d in shape):
            raise ValueError(f"field {t.name!r}: sample shape {list(shape)} among shapes of {ndim} dimensions")
        offsets.append(offsets[-1] + math.prod(shape))
    if len(t.shape) != 1 or offsets[-1] != t.shape[0]:
        raise ValueError(f"field {t.name!r}: sample shapes of {offsets[-1]} elements for values of shape "
                         f"{list(t.shape)}")
    return {"sample_ndim": ndim, "sample_shapes": tuple(d for shape in t.sample_shapes for d in shape),
            "sample_offsets": tuple(offsets)}
