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
from typing import Any, Callable

import grpc
import lz4.frame as lz4_frame
import torch

from batchd import wire
from batchd.client.channel import translate
from batchd.v1 import loader_pb2 as pb

_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class _End:
    pass


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the server sent a tensor of dtype {name!r}, which torch does not have")
    return dtype


def to_tensors(batch: wire.WireBatch) -> dict[str, torch.Tensor]:
    """CPU tensors sharing memory with the received message (no copy).

    The message bytes belong to this batch alone, so the tensors are handed out writable, as
    DataLoader batches are (torch.frombuffer warns about read-only buffers; we silence that).
    """
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for t in batch.tensors:
            dtype = _torch_dtype(t.dtype)
            data = lz4_frame.decompress(t.data) if t.compression == pb.COMPRESSION_LZ4 else t.data
            if len(data):
                out[t.name] = torch.frombuffer(data, dtype=dtype).view(t.shape)
            else:
                out[t.name] = torch.empty(t.shape, dtype=dtype)
    return out


class Receiver(threading.Thread):
    """Consumes ``call`` (a StreamBatches response iterator) into ``self.queue``.

    convert: WireBatch -> the item to queue (tensors, maybe on a device). max_ready: batches
    unpacked ahead of the caller (1 = double buffering).
    """

    def __init__(self, call: grpc.Call, address: str, convert: Callable[[wire.WireBatch], Any], max_ready: int = 1):
        super().__init__(name="batchd-receiver", daemon=True)
        self.call = call
        self.address = address
        self.convert = convert
        self.queue: queue.Queue = queue.Queue(maxsize=max_ready)
        self.stopping = threading.Event()
        self.last_batch_at = time.monotonic()

    def run(self) -> None:
        try:
            for raw in self.call:
                item = self.convert(wire.decode_batch(raw))
                if not self._put(item):
                    return
            self._put(_End())
        except grpc.RpcError as e:
            if not self.stopping.is_set():
                self._put(_Failed(translate(e, self.address)))
        except BaseException as e:  # never raise in the thread: hand it to the consumer
            self._put(_Failed(e))

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
        """Cancel the call and join the thread (at most a second or so)."""
        self.stopping.set()
        self.call.cancel()
        self.join(2.0)
        while True:  # drop batches received ahead, so their memory (or leased slots) go back now
            try:
                self.queue.get_nowait()
            except queue.Empty:
                break
