"""One batchd server as a loader sees it: ``ServerConnection``.

Its channel, the dataset's ``DatasetInfo`` (described once per server process: again only when
the server's id changed, ``check_server``), its shared-memory session (opened on first use), its
``DataLink`` (the socket data plane: ``transport`` "auto" for a server whose shared memory is not
readable here, or "socket"; its calls ask for TRANSPORT_SOCKET and read each batch's bytes from a
data connection beside the call, ``batchd.client.transport.dataplane``), the
thread that reports what cannot ride on a call (``batchd.client.transport.leases.Reporter``: abandoned
calls, releases while no call is open), and the ``Batches`` calls it opens
(``open_batches``, ``batchd.client.transport.call``): one per iteration, whose request stream carries the
grants, revokes, lease releases and progress. ``convert`` turns a received batch into what the
loader hands out. A single-server loader has one connection; a several-servers loader one per
server, all sharing the loader's options and its ``CudaTransfer``.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Any

import grpc
import torch

from batchd import errors, wire
from batchd.client.transport import buffers
from batchd.client.device import decode
from batchd.client.transport import fields
from batchd.client import forks
from batchd.client.transport import orders
from batchd.client.transport import relay
from batchd.client.transport.call import BatchesCall
from batchd.client.transport.outbox import Outbox
from batchd.client.transport.channel import open_channel, wait_for_server
from batchd.client.device.collate import collate
from batchd.client.transport.dataplane import DataLink
from batchd.client.transport.datasets import DatasetInfo, Difference, difference
from batchd.client.transport.leases import CallRecord, Reporter, new_tag_prefix
from batchd.client.loader.options import LoaderOptions
from batchd.client.transport.receiver import Received, to_tensors
from batchd.client.transport.shm import SharedMemorySession, SharedMemoryUnavailable
from batchd.client.loader.timings import BatchTimes, delivered
from batchd.client.device.transfer import check_finishable, finish
from batchd.errors import DatasetChangedError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader.loader")  # users (and tests) watch this logger
_HALF_CLOSED_GRACE_S = 1.0  # close() waits this long, at most, for half-closed calls to end
_warned_no_shm: set[str] = set()

# The server's lease cap per shared-memory session (its config's max_leases_per_session, 8 by
# default; the server does not announce it), and the leases the loop and the converter may hold
# beyond the batches waiting in the reorder buffer: a lane keeps its grants plus the batches it
# sent that wait here within the difference (batchd.client.lane, Lane.room).
ASSUMED_MAX_LEASES = 8
LEASES_RESERVED = 3


class ServerConnection:
    """A channel to ``address`` and the dataset ``options.dataset`` there.

    transfer: the loader's ``CudaTransfer`` (None for CPU batches). Raises (at construction)
    ConnectionError if no server answers within ``options.connect_timeout`` seconds,
    DatasetNotFoundError, ValueError (TLS files), AuthenticationError/PermissionDeniedError.
    """

    def __init__(self, address: str, options: LoaderOptions, transfer: Any = None):
        self.address = address
        self.options = options
        self.transfer = transfer
        self._channel = open_channel(address, connect_timeout=options.connect_timeout,
                                     max_message_bytes=options.max_message_bytes, tls=options.tls, token=options.token)
        self.reporter = Reporter(self._channel, address)
        self._owner = forks.owner()  # a forked child neither uses nor closes this channel (batchd.client.forks)
        forks.keep(self)
        self._finalizer = weakref.finalize(self, forks.in_owner(self._owner, self.reporter.close), self._channel.close)
        self._shm: SharedMemorySession | None = None
        self._shm_tried = False
        # the socket data plane (TRANSPORT_SOCKET): its payloads go to the relay's buffers (client/transport/relay.py),
        # to pinned ones when copied to CUDA, else to ordinary ones
        if options.relay is True and not relay.AVAILABLE:
            raise ValueError("relay=True needs Linux (memfd_create); use relay='auto' or False")
        use_relay = options.relay is True or (options.relay == "auto" and transfer is None and relay.AVAILABLE)
        link_relay = relay.shared() if use_relay else None
        pool = buffers.BufferPool(link_relay.buffers if link_relay is not None else
                                  buffers.PinnedPool() if transfer is not None else buffers.pageable)
        self.data = DataLink(address, options.tls, pool, connect_timeout=options.connect_timeout,
                             timeout=options.timeout, optional=options.transport == "auto", relay=link_relay)
        self._tag_prefix = new_tag_prefix()
        self._tags = itertools.count()
        self.calls: weakref.WeakSet = weakref.WeakSet()  # Batches calls open (cancelled by close)
        self.describes = 0  # DescribeDataset calls made (one per server process, unless its data changed)
        self.weights_sent = False  # the sampler's weights are held there (sent once; again after a broken call)
        try:
            self.info: DatasetInfo = self._describe(options.connect_timeout)
        except BaseException:
            self.close()
            raise

    def _describe(self, timeout: float) -> DatasetInfo:
        self.describes += 1
        return orders.describe(self._channel, self.address, self.options, timeout)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def shared_memory(self) -> SharedMemorySession | None:
        """The shared-memory session, opened on first use; None when the transport is inline.

        Raises RuntimeError if ``transport="shm"`` and the server's shared memory is not readable
        here, ConnectionError if the server cannot be reached (then nothing is decided).
        """
        if self.options.transport in ("inline", "socket") or self._shm_tried:
            return self._shm
        try:
            self._shm = SharedMemorySession.open(self._channel, self.address, self.options.connect_timeout,
                                                 self.reporter)
            self._shm_tried = True
        except ConnectionError:
            raise  # (unreachable now: asked again on the next call)
        except SharedMemoryUnavailable as e:
            self._shm_tried = True
            if self.options.transport == "shm":
                raise RuntimeError(f"transport='shm' but shared memory with {self.address} is unavailable: {e}") from None
            if self.address not in _warned_no_shm:
                _warned_no_shm.add(self.address)
                log.warning("shared memory with %s is unavailable (%s); batches travel over the network: on the "
                            "server's data plane where it has one, else in gRPC messages", self.address, e)
        return self._shm

    def wants_socket(self) -> bool:
        """Whether calls ask for the socket data plane: ``transport="socket"``, or ``"auto"`` without
        shared memory, to a server with a host to dial (not ``unix:``) whose data port was not
        found unreachable (``DataLink.reachable``)."""
        t = self.options.transport
        if t == "socket":
            return self.data.possible
        return t == "auto" and self.data.possible and self.data.reachable and self.shared_memory() is None

    def lease_limit(self) -> int:
        """Grants plus batches waiting in the reorder buffer a shared-memory lane keeps below
        (``ASSUMED_MAX_LEASES`` - ``LEASES_RESERVED``)."""
        return max(1, ASSUMED_MAX_LEASES - LEASES_RESERVED)

    def new_session(self) -> None:
        """After a broken call (a restarted server has new shared memory): close the old session
        (it ends once the batches still held on it are freed) and open a new one on next use. The
        sampler's weights are sent again before the next call (the server may have restarted, or
        dropped them: ``WeightsNotHeld``)."""
        self.weights_sent = False
        if self._shm is not None:
            self._shm.close()
        self._shm, self._shm_tried = None, False

    def request(self, epoch: int, tag: str = "", *, start_position: int = 0) -> pb.StreamBatchesRequest:
        """The ``open`` of a Batches call for ``epoch`` (its remainder from ``start_position``),
        tagged ``tag``, with the dataset this loader expects there: its size always, its dataset
        and build fingerprints under ``strict`` (the server refuses the call otherwise). Opens the
        shared-memory session on first use (see ``shared_memory``)."""
        o, shm, info = self.options, self.shared_memory(), self.info
        if orders.needs_upload(o) and not self.weights_sent:  # once per server process, not per epoch
            orders.put_weights(self._channel, self.address, o.sampler, o.connect_timeout)
            self.weights_sent = True
        transport = (pb.TRANSPORT_SHARED_MEMORY if shm is not None else
                     pb.TRANSPORT_SOCKET if self.wants_socket() else pb.TRANSPORT_INLINE)
        return orders.apply(pb.StreamBatchesRequest(
            dataset=o.dataset, pipeline=o.pipeline, batch_size=o.batch_size, shuffle=o.shuffle,
            seed=o.seed, epoch=epoch, drop_last=o.drop_last, rank=o.rank, world_size=o.world_size,
            transport=transport,
            session=shm.session if shm is not None else "", compression=o.compression, stream_tag=tag,
            image_encoding=pb.IMAGE_ENCODING_JPEG if o.decode_on_client else pb.IMAGE_ENCODING_DECODED,
            start_position=start_position, expect_num_samples=info.num_samples,
            data_messages=transport == pb.TRANSPORT_SOCKET,
            expect_fingerprint=info.fingerprint if o.strict else "",
            expect_build_fingerprint=info.build_fingerprint if o.strict else "",
        ), o, info)

    def open_batches(self, epoch: int, start_position: int = 0) -> tuple[BatchesCall, CallRecord]:
        """A Batches call for ``epoch`` (nothing granted yet: ``call.outbox.grant``) and its
        ``CallRecord`` (tag, leases received, progress, the session). Freed leases of the session
        ride on the call while it is open. End it with ``end_call``. Raises ConnectionError,
        RuntimeError (``transport="shm"`` unavailable), and the errors of ``batches_error``."""
        tag = f"{self._tag_prefix}-{next(self._tags)}"
        request = self.request(epoch, tag, start_position=start_position)
        shm = self._shm if request.session else None
        record = CallRecord(tag, request.session, carried=True, shm=shm)
        outbox = Outbox(request, progress=record.progress,
                        sent=shm.forget if shm is not None else None,
                        unsent=(lambda leases: self.reporter.freed_all(shm.session, leases)) if shm is not None else None)
        call = BatchesCall(self._channel, self.address, outbox,
                           data=self.data if request.transport == pb.TRANSPORT_SOCKET else None)
        self.calls.add(call)
        if shm is not None:
            self.reporter.carry(shm.session, outbox)
        return call, record

    def end_call(self, call: BatchesCall, record: CallRecord, abandoned: bool) -> None:
        """The client stopped reading ``call`` (``abandoned``: before it ended OK): freed leases
        go by ReleaseLeases again, and an abandoned call is reported with the leases received on
        it (the server releases the others), its last releases sent again (a broken call may have
        lost them)."""
        shm = record.shm
        if shm is not None:
            self.reporter.uncarry(shm.session, call.outbox)
            if abandoned and call.outbox.recent_releases:
                self.reporter.freed_all(shm.session, list(call.outbox.recent_releases))
        self.calls.discard(call)
        self.reporter.end_call(record, abandoned=abandoned)

    def check_server(self, server_id: str, timeout: float) -> None:
        """A call began on server process ``server_id`` (``batchd-server-id``): describe the dataset
        again only when that differs from the process last described (``check_unchanged``, which
        raises if it changed beyond what the loader accepts)."""
        if server_id and server_id != self.info.server_id:
            if self.info.server_id:
                log.info("batchd server at %s restarted (server id %s, was %s); describing %r again", self.address,
                         server_id, self.info.server_id, self.options.dataset)
            self.check_unchanged(timeout)

    def converts_inline(self) -> bool:
        """Whether turning a received batch into the loader's is cheap enough for the training
        loop's own thread (``batchd.client.delivery``): CPU tensors over the bytes as they came (no
        device copy, ``gpu_transform``, ``decode_on_client`` or ``collate_fn``)."""
        o = self.options
        return self.transfer is None and o.gpu_transform is None and not o.decode_on_client and o.collate_fn is None

    def convert(self, raw: wire.WireBatch, stopping: Any, record: CallRecord) -> Received:
        """The converter (or the consumer, ``converts_inline``): the batch of ``raw`` (received on
        ``record``'s call) as the loader hands it out (on the device, finished by ``gpu_transform``,
        ragged fields split into views, collated by ``collate_fn``), and its ``BatchTimes`` (unpack
        here; copy and gpu_transform: CUDA events, or the CPU time of gpu_transform). ``stopping``:
        an Event set when the iteration ends (a device copy is then refused). Raises
        ConnectionError if its shared-memory slot is gone (the server ended the session)."""
        times, t0 = BatchTimes(raw.timings), time.perf_counter()
        shm = record.shm if raw.segment else None
        if raw.segment and shm is None:
            raise RuntimeError(f"{self.address} sent a shared-memory batch on a call without a session")
        transfer, registered, encoded = self.transfer, False, decode.is_encoded(raw)
        try:
            if raw.payload is not None:  # received on the data connection, into a pooled buffer
                batch = raw.payload
                # copied straight from it: asynchronously from a pinned buffer (``buffers.PinnedPool``), at
                # once from an ordinary one (past the pinned budget); held until the copy is done either way
                registered = transfer is not None
            elif transfer is not None and shm is not None and transfer.maps_host_memory and not encoded:
                batch, registered = shm.host_tensors(raw, transfer.register, transfer.unregister)  # copied from the slot
            else:
                batch = shm.tensors(raw) if shm is not None else to_tensors(raw)
        except FileNotFoundError:
            # the server unlinked the slot: it ended the session (shutting down) after gRPC had
            # buffered this message
            if shm is not None:
                shm.release_unused(raw.lease)
            raise errors.ConnectionError(f"batchd server at {self.address} ended the shared-memory session of batch "
                                         f"{raw.batch_index} (epoch {raw.epoch}) before it was read: the server is "
                                         f"shutting down or restarting") from None
        if raw.skipped:
            batch["skipped"] = torch.tensor(raw.skipped, dtype=torch.int64)
        o, event = self.options, None
        if encoded:  # JPEG files: decoded here (client/device/decode.py), then as below; all of it is unpack
            batch, event = decode.decode_batch(batch, o, transfer, stopping, raw.epoch, self.info.on_error)
            times.unpack = time.perf_counter() - t0
        else:
            t1 = time.perf_counter()
            times.unpack = t1 - t0
            if transfer is not None:
                if o.gpu_transform is not None:
                    check_finishable(batch)  # before the copy: a failed finish must not leave one in flight
                marks: list = []
                batch, event = transfer.to_device(batch, stopping, registered=registered,
                                                  finish=o.gpu_transform, seed=o.seed, epoch=raw.epoch, marks=marks)
                times.events = (*marks, event) if len(marks) == 2 else None  # (device times from CUDA events)
            elif o.gpu_transform is not None:
                finish(batch, o.gpu_transform, o.seed, raw.epoch)
                times.gpu_transform = time.perf_counter() - t1
        copies = fields.tensors(batch) if event is not None else None
        batch = fields.unpack(batch)  # ragged fields: B views of their one (device) buffer
        # (after decode_on_client, which may leave out files under on_error: skip)
        samples = int(batch["index"].shape[0]) if isinstance(batch.get("index"), torch.Tensor) else 0
        if o.collate_fn is None:
            return Received(raw.batch_index, batch, event, samples, copies, times=times, record=record)
        if event is not None:  # on the device: collated once the consumer's stream waits for the copy
            return Received(raw.batch_index, batch, event, samples, copies, o.collate_fn, times=times, record=record)
        return Received(raw.batch_index, collate(batch, o.collate_fn), None, samples, times=times, record=record)

    def wait_ready(self, timeout: float) -> bool:
        """Whether the channel is (again) connected within ``timeout`` seconds."""
        return wait_for_server(self._channel, timeout)

    def check_unchanged(self, timeout: float) -> Difference:
        """Describe the dataset again and compare it with ``self.info``
        (``batchd.client.transport.datasets.difference``): a restarted server may serve other files under
        the same name. Called when a call shows another server id, or the server refused a call's
        expected dataset.

        Returns what differs (empty: nothing known). ``self.info`` becomes the new description;
        where fingerprints differ without ``options.strict``, a warning says so. Raises
        DatasetChangedError (a ValueError) naming the dataset, this address and what changed if
        the number of samples differs, or (strict) a dataset or build fingerprint; ConnectionError
        or TimeoutError if the server does not answer within ``timeout`` seconds;
        DatasetNotFoundError if it no longer serves the dataset.
        """
        now = self._describe(timeout)
        self.weights_sent = self.weights_sent and now.server_id == self.info.server_id
        changed = difference(self.info, now)
        if changed.refused(self.options.strict):
            raise DatasetChangedError(self.options.dataset, self.address, changed.fingerprints, changed.num_samples)
        if changed:
            log.warning("dataset %r at %s changed since the loader last read it (a restart): %s (before vs now); going on "
                        "with the new data (strict=False)", self.options.dataset, self.address, changed)
        self.info = now
        return changed

    def serving(self, timeout: float) -> bool:
        """Whether the server's gRPC health service says SERVING (not draining) within ``timeout`` s."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self, wait: float = 2.0) -> None:
        """Cancel the calls still open; the shared-memory session ends once no batch on it is held,
        then the channel closes (at once, waiting up to ``wait`` seconds, when none is). Idempotent.
        Nothing in a forked child: the channel is the parent's."""
        if forks.forked(self._owner):
            return
        # a call half-closed at its iteration's end has every batch; the server ends it at once
        # (OK, counted finished): give it that moment instead of cancelling it under the server
        deadline = time.monotonic() + _HALF_CLOSED_GRACE_S
        while any(c.outbox.closed and not c.cancelled for c in list(self.calls)) and time.monotonic() < deadline:
            time.sleep(0.005)
        for call in list(self.calls):
            call.cancel()
        if self._finalizer.alive:
            self._finalizer.detach()
            self.reporter.close(self._channel.close, wait=wait if not self.outstanding else 0.0)

    @property
    def outstanding(self) -> int:
        """Leases of this connection's current session still held by tensors."""
        return self._shm.outstanding if self._shm is not None else 0


def deliver(item: Received, transfer: Any) -> Any:
    """Consumer's thread: the batch of ``item``, its copy waited for on the current CUDA stream
    (then collated, if ``collate_fn`` is still to run), counted as taken from its call (progress)."""
    batch = item.batch
    if item.event is not None:
        transfer.hand_over(item.copies, item.event)
    if item.collate is not None:
        batch = collate(batch, item.collate)
    if item.record is not None:
        item.record.took(item.samples)
    delivered(item.times, item.record, item.samples)  # loader.stats() and profile() (batchd.client.loader.timings)
    return batch
