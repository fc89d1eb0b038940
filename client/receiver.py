"""The background thread of one epoch: receive, unpack and (optionally) copy batch k+1 to the
device while the caller trains on batch k.

The thread never raises: it puts batches, then exactly one ``_End`` or ``_Failed`` into a
bounded queue. The consumer polls that queue with a timeout, so it notices a dead stream or a
silent server instead of hanging (``timeout`` seconds without a batch raise TimeoutError).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import grpc
import lz4.frame as lz4_frame
import torch

from batchd import wire
from batchd.client import fields, forks
from batchd.client.channel import translate
from batchd.v1 import loader_pb2 as pb

_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class _End:
    pass


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


class Received(NamedTuple):
    """One batch as the receiver thread queues it: ``batch`` is what the loader hands out (a dict of
    stacked tensors and lists, ``batchd.client.fields.unpack``; or what ``collate_fn`` returned);
    ``samples`` its size. On a CUDA device, ``event`` is the CUDA event its copy records and
    ``copies`` the device tensors the copy made (the consumer's stream waits for the event and
    records its use of them, ``CudaTransfer.hand_over``); else both are None. ``collate`` is a
    ``collate_fn`` still to run in the consumer's thread (on a CUDA device), or None. ``times`` its
    ``batchd.client.timings.BatchTimes`` (server and client stages)."""

    batch_index: int
    batch: Any
    event: Any
    samples: int
    copies: dict[str, torch.Tensor] | None = None
    collate: Callable[[list], Any] | None = None
    times: Any = None


def to_tensors(batch: wire.WireBatch) -> dict[str, fields.Field]:
    """The batch's fields on the received message (no copy; LZ4 data once decompressed): stacked
    tensors, ``Ragged`` fields (one flat tensor each), lists of str / bytes (``batchd.client.fields``).

    The message bytes belong to this batch alone, so the tensors are handed out writable, as
    DataLoader batches are (torch.frombuffer warns about read-only buffers; we silence that).
    Raises ValueError naming a field the server sent malformed.
    """
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for t in batch.tensors:
            data = lz4_frame.decompress(t.data) if t.compression == pb.COMPRESSION_LZ4 else t.data
            out[t.name] = fields.field(t, fields.from_bytes(t, data))
    return out


class Receiver(threading.Thread):
    """Consumes ``call`` (a StreamBatches response iterator) into ``self.queue``.

    convert(raw, receiver): WireBatch -> a ``Received`` (tensors, maybe on a device); it runs in
    this thread and may look at ``receiver.stopping``. record: the call's ``CallRecord`` (stream
    tag, leases received, progress). on_end(receiver): called once by ``stop``, after the call is
    cancelled and the thread joined (reports the end, abandoned or not). release(lease): gives
    back the lease of a batch received but never converted. max_ready: batches unpacked ahead
    of the caller (1 = double buffering).
    """

    def __init__(self, call: grpc.Call, address: str, convert: Callable[[wire.WireBatch, "Receiver"], Received],
                 record: Any = None, on_end: Callable[["Receiver"], None] | None = None,
                 release: Callable[[int], None] | None = None, max_ready: int = 1):
        super().__init__(name="batchd-receiver", daemon=True)
        self.call = call
        self.address = address
        self.convert = convert
        self.record = record
        self.queue: queue.Queue = queue.Queue(maxsize=max_ready)
        self.stopping = threading.Event()
        self.finished = False  # the call ended after its last batch
        self.last_batch_at = time.monotonic()
        self._on_end = on_end
        self._release = release
        self._stopped = False
        self._owner = forks.owner()  # a forked child neither cancels the call nor waits for this thread
        forks.keep(self)

    def run(self) -> None:
        try:
            messages = iter(self.call)
            while True:
                t0 = time.perf_counter()
                message = next(messages, None)
                if message is None:
                    break
                if not self._handle(message, time.perf_counter() - t0):
                    return
                # (no batch stays a local of this frame: a failed call's traceback keeps the frame)
                message = None  # noqa: F841
            self.finished = True
            self._put(_End())
        except grpc.RpcError as e:
            if not self.stopping.is_set():
                self._put(_Failed(translate(e, self.address)))
        except BaseException as e:  # never raise in the thread: hand it to the consumer
            self._put(_Failed(e))

    def _handle(self, message: bytes, received: float = 0.0) -> bool:
        """Convert and queue one batch (``received``: seconds its message took to come); False once
        the receiver is stopping."""
        t0 = time.perf_counter()
        raw = wire.decode_batch(message)
        parsed = time.perf_counter() - t0
        if raw.segment and self.record is not None and not self.record.add(raw.lease):
            return False  # stopped and reported: the server releases this lease, never touch it
        try:
            item = self.convert(raw, self)
        except BaseException:
            if raw.segment and self._release is not None:
                self._release(raw.lease)
            raise
        if item.times is not None:
            item.times.receive = received
            item.times.unpack += parsed
        return self._put(item)

    def _put(self, item: Any) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def get(self, timeout: float, what: str) -> Any:
        """The next item; raises TimeoutError after ``timeout`` seconds without one."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                item = self.queue.get(timeout=_POLL_S)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no batch from {self.address} for {timeout:g} s ({what})") from None
                if not self.is_alive() and self.queue.empty():
                    raise RuntimeError(f"the receiver thread for {self.address} ended without a result ({what})")
                continue
            if isinstance(item, _Failed):
                raise item.error
            return item

    def stop(self) -> None:
        """Cancel the call, join the thread (at most a second or so), drop what it received
        ahead, and report the end (``on_end``). Idempotent. Nothing in a forked child but noting it
        stopped: the call is the parent's, and the thread and the locks it held are not there."""
        if self._stopped:
            return
        self._stopped = True
        if forks.forked(self._owner):
            return
        self.stopping.set()
        self.call.cancel()
        if self is not threading.current_thread():
            self.join(2.0)
        while True:  # drop batches received ahead, so their memory (or leased slots) go back now
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
        if self._on_end is not None:
            self._on_end(self)
