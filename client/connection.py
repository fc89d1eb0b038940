"""One batchd server as a loader sees it: ``ServerConnection``.

Its channel, the dataset's ``DatasetInfo``, its shared-memory session (opened on first use), the
thread that reports released leases and progress (``batchd.client.leases.Reporter``), and the
StreamBatches calls it opens, each tagged and watched by a ``Receiver`` thread. A single-server
loader has one; a several-servers loader one per server, all sharing the loader's options and
its ``CudaTransfer``.
"""

from __future__ import annotations

import itertools
import logging
import time
import weakref
from typing import Any

import grpc
import torch

from batchd import wire
from batchd.client import decode, fields, forks
from batchd.client.channel import open_channel, translate, wait_for_server
from batchd.client.collate import collate
from batchd.client.datasets import DatasetInfo, Difference, describe, difference
from batchd.client.leases import CallRecord, Reporter, new_tag_prefix
from batchd.client.options import LoaderOptions
from batchd.client.receiver import Received, Receiver, to_tensors
from batchd.client.shm import SharedMemorySession, SharedMemoryUnavailable
from batchd.client.timings import BatchTimes, delivered
from batchd.client.transfer import check_finishable, finish
from batchd.errors import DatasetChangedError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader")  # users (and tests) watch this logger
_warned_no_shm: set[str] = set()


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
        # StreamBatches is parsed by batchd.wire (tensors as views of the message, no copies)
        self._stream_batches = self._channel.unary_stream(
            "/batchd.v1.BatchLoader/StreamBatches",
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
            response_deserializer=None,
        )
        self._shm: SharedMemorySession | None = None
        self._shm_tried = False
        self._tag_prefix = new_tag_prefix()
        self._tags = itertools.count()
        self.receiver: Receiver | None = None  # the latest stream opened
        # a stream was opened since the dataset was last described: the server may have restarted since
        # (gRPC reconnects a channel silently between calls), so the next epoch checks first
        self.streamed = False
        try:
            self.info: DatasetInfo = describe(self._channel, address, options.dataset, timeout=options.connect_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def shared_memory(self) -> SharedMemorySession | None:
        """The shared-memory session, opened on first use; None when the transport is inline.

        Raises RuntimeError if ``transport="shm"`` and the server's shared memory is not readable here.
        """
        if self.options.transport == "inline" or self._shm_tried:
            return self._shm
        self._shm_tried = True
        try:
            self._shm = SharedMemorySession.open(self._channel, self.address, self.options.connect_timeout,
                                                 self.reporter)
        except SharedMemoryUnavailable as e:
            if self.options.transport == "shm":
                raise RuntimeError(f"transport='shm' but shared memory with {self.address} is unavailable: {e}") from None
            if self.address not in _warned_no_shm:
                _warned_no_shm.add(self.address)
                log.warning("shared memory with %s is unavailable (%s); batches travel in gRPC messages", self.address, e)
        return self._shm

    def new_session(self) -> None:
        """After a reconnect (a restarted server has new shared memory): close the old session
        (it ends once the batches still held on it are freed) and open a new one on next use."""
        if self._shm is not None:
            self._shm.close()
        self._shm, self._shm_tried = None, False

    def request(self, epoch: int, start_batch: int, stride: int = 1, offset: int = 0, tag: str = "", *,
                start_position: int = 0, end_batch: int = 0, hedge: bool = False) -> pb.StreamBatchesRequest:
        """The StreamBatches request for these batches (``stream_tag`` = ``tag``; the other fields
        as in loader.proto); opens the shared-memory session on first use (see ``shared_memory``)."""
        o, shm = self.options, self.shared_memory()
        return pb.StreamBatchesRequest(
            dataset=o.dataset, pipeline=o.pipeline, batch_size=o.batch_size, shuffle=o.shuffle,
            seed=o.seed, epoch=epoch, drop_last=o.drop_last, rank=o.rank, world_size=o.world_size,
            start_batch=start_batch, prefetch=o.prefetch,
            transport=pb.TRANSPORT_SHARED_MEMORY if shm is not None else pb.TRANSPORT_INLINE,
            session=shm.session if shm is not None else "", compression=o.compression,
            batch_stride=stride if stride > 1 else 0, batch_offset=offset, stream_tag=tag,
            image_encoding=pb.IMAGE_ENCODING_JPEG if o.decode_on_client else pb.IMAGE_ENCODING_DECODED,
            start_position=start_position, end_batch=end_batch, hedge=hedge,
        )

    def _convert(self, raw: wire.WireBatch, receiver: Receiver) -> Received:
        """Receiver thread: the batch of ``raw`` as the loader hands it out (on the device, finished
        by ``gpu_transform``, ragged fields split into views, collated by ``collate_fn``), and its
        ``BatchTimes`` (unpack here; receive is the receiver's; copy and gpu_transform: CUDA events,
        or the CPU time of gpu_transform)."""
        times, t0 = BatchTimes(raw.timings), time.perf_counter()
        shm = self._shm if raw.segment else None
        if raw.segment and shm is None:
            raise RuntimeError(f"{self.address} sent a shared-memory batch on a call without a session")
        transfer, registered, encoded = self.transfer, False, decode.is_encoded(raw)
        try:
            if transfer is not None and shm is not None and transfer.maps_host_memory and not encoded:
                batch, registered = shm.host_tensors(raw, transfer.register, transfer.unregister)  # copied from the slot
            else:
                batch = shm.tensors(raw) if shm is not None else to_tensors(raw)
        except FileNotFoundError:
            # the server unlinked the slot: it ended the session (shutting down) after gRPC had
            # buffered this message. A broken stream, resumed like one (reconnect_timeout)
            raise ConnectionError(f"batchd server at {self.address} ended the shared-memory session of batch "
                                  f"{raw.batch_index} (epoch {raw.epoch}) before it was read: the server is "
                                  f"shutting down or restarting") from None
        if raw.skipped:
            batch["skipped"] = torch.tensor(raw.skipped, dtype=torch.int64)
        o, event = self.options, None
        if encoded:  # JPEG files: decoded here (client/decode.py), then as below; all of it is unpack
            batch, event = decode.decode_batch(batch, o, transfer, receiver.stopping, raw.epoch,
                                               self.info.on_error)
            times.unpack = time.perf_counter() - t0
        else:
            t1 = time.perf_counter()
            times.unpack = t1 - t0
            if transfer is not None:
                if o.gpu_transform is not None:
                    check_finishable(batch)  # before the copy: a failed finish must not leave one in flight
                marks: list = []
                batch, event = transfer.to_device(batch, receiver.stopping, registered=registered,
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
            return Received(raw.batch_index, batch, event, samples, copies, times=times)
        if event is not None:  # on the device: collated once the consumer's stream waits for the copy
            return Received(raw.batch_index, batch, event, samples, copies, o.collate_fn, times=times)
        return Received(raw.batch_index, collate(batch, o.collate_fn), None, samples, times=times)

    def open_stream(self, epoch: int, start_batch: int, stride: int = 1, offset: int = 0, *,
                    start_position: int = 0, end_batch: int = 0, hedge: bool = False) -> Receiver:
        """Stream batches start_batch + offset, + stride, ... (every batch with the defaults) of the
        epoch's remainder from global position ``start_position``, up to ``end_batch`` (0: the end).

        The call is tagged (``stream_tag``); stopping its receiver before the end reports it
        abandoned with the leases received on it. A ``hedge`` call (one late batch asked again)
        does not become ``self.receiver``. Raises ConnectionError and the errors of ``translate``.
        """
        tag = f"{self._tag_prefix}-{next(self._tags)}"
        self.streamed = True
        request = self.request(epoch, start_batch, stride, offset, tag, start_position=start_position,
                               end_batch=end_batch, hedge=hedge)
        record = CallRecord(tag, request.session)
        try:
            call = self._stream_batches(request)
        except grpc.RpcError as e:
            raise translate(e, self.address) from None
        self.reporter.open_call(record)
        shm = self._shm if request.session else None
        receiver = Receiver(
            call, self.address, self._convert, record,
            on_end=lambda r: self.reporter.end_call(r.record, abandoned=not r.finished),
            release=shm.release_unused if shm is not None else None)
        if not hedge:
            self.receiver = receiver
        receiver.start()
        return receiver

    def wait_ready(self, timeout: float) -> bool:
        """Whether the channel is (again) connected within ``timeout`` seconds."""
        return wait_for_server(self._channel, timeout)

    def check_unchanged(self, timeout: float) -> Difference:
        """After a reconnect, and before an epoch on a connection that streamed before: describe
        the dataset again and compare it with ``self.info`` (``batchd.client.datasets.difference``),
        since a restarted server may serve other files under the same name.

        Returns what differs (empty: nothing known). ``self.info`` becomes the new description;
        where fingerprints differ without ``options.strict``, a warning says so. Raises
        DatasetChangedError (a ValueError) naming the dataset, this address and what changed if
        the number of samples differs, or (strict) a dataset or build fingerprint; ConnectionError
        or TimeoutError if the server does not answer within ``timeout`` seconds;
        DatasetNotFoundError if it no longer serves the dataset.
        """
        now = describe(self._channel, self.address, self.options.dataset, timeout=timeout)
        self.streamed = False
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

    def stop_stream(self) -> None:
        if self.receiver is not None:
            self.receiver.stop()
            self.receiver = None

    def close(self, wait: float = 2.0) -> None:
        """Cancel the stream; the shared-memory session ends once no batch on it is held, then the
        channel closes (at once, waiting up to ``wait`` seconds, when none is). Idempotent. Nothing
        in a forked child: the channel is the parent's."""
        if forks.forked(self._owner):
            return
        self.stop_stream()
        if self._finalizer.alive:
            self._finalizer.detach()
            self.reporter.close(self._channel.close, wait=wait if not self.outstanding else 0.0)

    @property
    def outstanding(self) -> int:
        """Leases of this connection's current session still held by tensors."""
        return self._shm.outstanding if self._shm is not None else 0


def deliver(item: Received, receiver: Receiver, transfer: Any) -> Any:
    """Consumer's thread: the batch of ``item``, its copy waited for on the current CUDA stream
    (then collated, if ``collate_fn`` is still to run), counted as taken from ``receiver``'s call
    (progress)."""
    batch = item.batch
    if item.event is not None:
        transfer.hand_over(item.copies, item.event)
    if item.collate is not None:
        batch = collate(batch, item.collate)
    if receiver.record is not None:
        receiver.record.took(item.samples)
    delivered(item.times, receiver.record, item.samples)  # loader.stats() and profile() (batchd.client.timings)
    return batch
