"""A real gRPC batchd server whose batches are hand-built samples, sent through the real Transport.

``BatchServer(samples_of, num_samples)`` listens on 127.0.0.1:0 with batchd's own gRPC adapter
(``batchd.server.serve.service.add_to_server``) and answers DescribeDataset, OpenSession,
StreamBatches, Batches (each granted batch sent at once, revokes honoured, releases applied, the
open's expected size and ``fingerprint`` checked; ``batches_call=False`` leaves it
unimplemented, as an older server) and ReleaseLeases as batchd's server does. Its batches are not computed by workers:
batch b holds the samples ``samples_of(indices)`` returns (dicts of numpy arrays, ints, str, bytes)
for sample indices ``b * B .. (b + 1) * B - 1``, laid out by ``tests/batches.py`` (stacked where
the samples' shapes agree, else ragged) into a real shared-memory slot (64-byte aligned fields,
then ``index`` and ``position`` int64 [B], the sample indices, unless the samples have them) and
sent by the real ``Transport``: the slot lent under a lease over a shared-memory session, or
copied inline (LZ4 if asked). So the client is
tested against batchd's wire and transport code with any samples, before any dataset kind makes
them. ``skip`` leaves samples out as ``on_error: skip`` does; ``messages`` replaces the batches
by raw ``Batch`` bytes (malformed ones). ``layouts`` records each batch's ``TensorLayout``s.
"""

from __future__ import annotations

import itertools
import queue
import threading
import uuid
from concurrent import futures
from typing import Any, Callable, Iterable

import grpc
import numpy as np

import batches
from batchd import wire
from batchd.server.compute.layout import align
from batchd.server.compute.protocol import StreamRequest, TensorLayout
from batchd.server.serve.leases import LeaseTable
from batchd.server.serve.handlers import add_to_server
from batchd.server.shm import Owner, SlotPool
from batchd.server.serve.stream import ReadyBatch, Stream
from batchd.server.serve.transport import Transport
from batchd.v1 import loader_pb2 as pb


def ready_batch(slots: SlotPool, b: int, fields: list[batches.Field], skipped: tuple[int, ...] = ()) -> ReadyBatch:
    """Batch b as a worker leaves it: ``fields`` written into a slot of ``slots`` at 64-byte aligned
    offsets, their ``TensorLayout``s (ragged ones with their sample shapes)."""
    layouts, offset = [], 0
    for f in fields:
        layouts.append(TensorLayout(f.name, f.dtype, f.shape, offset, f.sample_shapes))
        offset = align(offset + len(f.values))
    slot = slots.acquire(offset)
    for f, t in zip(fields, layouts):
        slot.buf[t.offset:t.offset + len(f.values)] = f.values
    return ReadyBatch(b, slot, tuple(layouts), skipped=skipped)


class _Older:
    """``server``'s methods but Batches: what an older batchd server answers."""

    def __init__(self, server):
        self._server = server

    def __getattr__(self, name):
        if name == "Batches":
            raise AttributeError(name)
        return getattr(self._server, name)


class BatchServer:
    """See the module docstring. ``address``; ``close()`` (or a ``with`` block) stops it."""

    def __init__(self, samples_of: Callable[[list[int]], list[dict[str, Any]]], num_samples: int, *,
                 dataset: str = "handmade", skip: Iterable[int] = (), max_leases: int = 64,
                 messages: Callable[[StreamRequest], Iterable[bytes]] | None = None, batches_call: bool = True):
        self.samples_of, self.num_samples, self.dataset = samples_of, num_samples, dataset
        self.server_id = uuid.uuid4().hex
        self.fingerprint = "0" * 32  # described, and checked against a call's expect_fingerprint
        self.skip, self.messages = set(skip), messages
        self.owner = Owner()
        self.slots = SlotPool(max_slots=256, prefix=self.owner.prefix)
        self.leases = LeaseTable(self.slots, max_held=max_leases)
        self.transport = Transport(self.slots, self.leases)
        self.layouts: dict[int, tuple[TensorLayout, ...]] = {}  # batch index -> its fields in the slot
        self.lent = 0  # batches sent as a lease (not copied)
        self._ended: list[threading.Event] = []
        self._server = grpc.server(futures.ThreadPoolExecutor(16))
        add_to_server(self if batches_call else _Older(self), self._server)  # (it registers what exists)
        self.address = f"127.0.0.1:{self._server.add_insecure_port('127.0.0.1:0')}"
        self._server.start()

    def __enter__(self) -> "BatchServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for event in self._ended:
            event.set()
        self._server.stop(grace=None).wait()
        self.leases.close_all()
        self.slots.close()
        self.owner.close()

    # --- the batches -------------------------------------------------------------------------------

    def _ready_batch(self, b: int, batch_size: int) -> ReadyBatch:
        """Batch b in a slot: the fields of its samples, then index and position int64 [B]."""
        indices = list(range(b * batch_size, min((b + 1) * batch_size, self.num_samples)))
        kept = [i for i in indices if i not in self.skip]
        samples = self.samples_of(kept) if kept else []
        fields = batches.pack(samples) if samples else []
        fields += [batches.Field(name, "int64", (len(kept),), np.asarray(kept, np.int64).tobytes())
                   for name in ("index", "position") if name not in {f.name for f in fields}]
        batch = ready_batch(self.slots, b, fields, skipped=tuple(i for i in indices if i in self.skip))
        self.layouts[b] = batch.tensors
        return batch

    # --- the RPCs (as batchd.server.serve.service.BatchLoaderService) ----------------------------------

    def DescribeDataset(self, request, context):
        if request.name != self.dataset:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no dataset {request.name!r}")
        return pb.DatasetInfo(name=self.dataset, kind="handmade", num_samples=self.num_samples,
                              fingerprint=self.fingerprint, build_fingerprint="0" * 32, server_id=self.server_id)

    def ListDatasets(self, request, context):
        return pb.ListDatasetsResponse(datasets=[self.DescribeDataset(pb.DescribeDatasetRequest(name=self.dataset),
                                                                      context)])

    def Stats(self, request, context):
        return pb.StatsResponse()

    def OpenSession(self, request, context):
        ended = threading.Event()
        self._ended.append(ended)
        context.add_callback(ended.set)
        self.leases.open(request.session)
        try:
            yield pb.SessionEvent(probe_segment=self.owner.probe_name, probe_token=self.owner.probe_token)
            ended.wait()
        finally:
            self.leases.close(request.session)

    def ReleaseLeases(self, request, context):
        self.transport.release(request)
        return pb.ReleaseLeasesResponse()

    def StreamBatches(self, request, context):
        r = StreamRequest.from_proto(request, context.peer())
        if self.messages is not None:
            yield from self.messages(r)
            return
        num_batches = -(-self.num_samples // r.batch_size)
        stream = Stream(r, num_batches)
        self.transport.open(stream)
        try:
            for b in range(r.first_batch, num_batches, r.stride):
                batch = self._ready_batch(b, r.batch_size)
                try:
                    data = self.transport.encode(stream, batch)
                    self.lent += bool(wire.decode_batch(data).segment)
                finally:
                    self.slots.release(batch.slot)  # the server's reference; a lease holds its own
                yield data
        finally:
            self.transport.close(stream)

    def _check_expected(self, expected: pb.StreamBatchesRequest, context) -> None:
        """FAILED_PRECONDITION (DatasetChangedError) unless the request expects what is served."""
        if ((expected.expect_num_samples and expected.expect_num_samples != self.num_samples)
                or (expected.expect_fingerprint and expected.expect_fingerprint != self.fingerprint)):
            message = (f"dataset {self.dataset!r} is not the one the client expects: {expected.expect_num_samples} "
                       f"samples, fingerprint {expected.expect_fingerprint} vs {self.num_samples}, {self.fingerprint}")
            detail = pb.ErrorDetail(type="DatasetChangedError", message=message, dataset=self.dataset)
            context.set_trailing_metadata((("batchd-error-bin", detail.SerializeToString()),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)

    def Batches(self, requests, context):
        """The granted batches, each built and sent as its grant arrives (revoked ones skipped);
        releases and progress applied; a later ``open`` switches the call to that request (its
        batches carry ``open_seq`` one more); ends once the client half-closed and all were sent."""
        it = iter(requests)
        first = next(it)
        context.send_initial_metadata((("batchd-server-id", self.server_id), ("batchd-workers", "1")))
        self._check_expected(first.open, context)
        r = StreamRequest.from_proto(first.open, context.peer())
        if self.messages is not None:
            yield from self.messages(r)
            return
        num_batches = -(-self.num_samples // r.batch_size)
        stream = Stream(r, num_batches)
        self.transport.open(stream)
        grants: queue.SimpleQueue = queue.SimpleQueue()
        revoked: set[int] = set()

        def read() -> None:
            try:
                for k, message in enumerate(itertools.chain([first], it)):
                    if k and message.HasField("open"):
                        grants.put(message.open)  # (the sender switches, in order with the grants)
                    for b in message.grant:  # (a grant is idempotent: a revoked batch granted again is sent)
                        revoked.discard(b)
                        grants.put(b)
                    revoked.update(message.revoke)
                    if message.release:
                        self.transport.release_leases(r.session, list(message.release))
            except Exception:  # the call ended
                pass
            grants.put(None)

        threading.Thread(target=read, daemon=True).start()
        try:
            while context.is_active():
                try:
                    b = grants.get(timeout=0.25)
                except queue.Empty:
                    continue
                if b is None:
                    return
                if isinstance(b, pb.StreamBatchesRequest):  # a later open: the next pass
                    self._check_expected(b, context)
                    self.transport.close(stream)
                    r = StreamRequest.from_proto(b, context.peer())
                    stream = Stream(r, -(-self.num_samples // r.batch_size), stream.open_seq + 1)
                    self.transport.open(stream)
                    revoked.clear()
                    continue
                if b in revoked:
                    continue
                batch = self._ready_batch(b, r.batch_size)
                try:
                    data = self.transport.encode(stream, batch)
                    self.lent += bool(wire.decode_batch(data).segment)
                finally:
                    self.slots.release(batch.slot)
                yield data
        finally:
            self.transport.close(stream)
