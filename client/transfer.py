"""Host-to-device copies that overlap compute: a side CUDA stream, reused pinned buffers, and
shared-memory slots copied from directly.

Pattern from ffcv's ``loader/epoch_iterator.py`` and spdl's ``io/_transfer.py``:

* the copy to the device is issued on a side stream (``non_blocking=True``), in a receiver
  thread, while the training step runs on the default stream;
* inline batches go through ``slots`` pinned host buffers per tensor name, allocated once (grown
  if a batch is larger) and reused round robin; before slot k is overwritten we wait on the
  (blocking, so the thread sleeps rather than spins) event recorded after the last copy out of
  it, so a copy in flight is never corrupted;
* same-host batches are copied straight from the server's shared-memory slot: each segment is
  mapped read-only once and registered with CUDA once (``cudaHostRegister``), and the batch (its
  lease) is kept until its copy's event has completed;
* ``hand_over`` makes the consumer's current stream wait for that copy's event and marks the
  device tensors as used on it (``record_stream``), so the caching allocator never recycles
  them early.

``to_device`` may be called from several receiver threads (several servers, or a receiver that
outlives ``stop()``): it holds a lock, and refuses (``TransferStopped``) a call whose receiver
is stopping, so a stale thread never fills a slot the live one uses.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Callable

import torch

from batchd.client import fields

log = logging.getLogger(__name__)

_HOST_REGISTER_PORTABLE, _HOST_REGISTER_READ_ONLY = 0x01, 0x08  # cudaHostRegister flags


class TransferStopped(RuntimeError):
    """The receiver thread that asked for a copy was stopped: its batch is dropped."""


def check_finishable(batch: dict[str, fields.Field]) -> None:
    """Raise ValueError unless ``gpu_transform`` can run on ``batch``: it needs "position" and stacked
    images (called before a batch is copied to a device, so a copy is never left in flight)."""
    if "position" not in batch:
        raise ValueError("gpu_transform needs batch['position'] (each sample's place in the epoch's order), "
                         "which this server does not send; upgrade the server or drop gpu_transform")
    if not isinstance(batch.get("image"), torch.Tensor):
        what = "images of different sizes" if isinstance(batch.get("image"), fields.Ragged) else "no 'image' field"
        raise ValueError(f"gpu_transform works on a batch's stacked images uint8 [B, H, W, C], but this batch has "
                         f"{what}; resize the images to one size on the server (transform) or drop gpu_transform")


def finish(batch: dict[str, fields.Field], gpu_transform: Callable[..., torch.Tensor], seed: int, epoch: int) -> None:
    """Replace ``batch["image"]`` by ``gpu_transform(image, position, seed=seed, epoch=epoch)``.

    image: the batch's uint8 [B, H, W, C] tensor (on the device after the copy, or on CPU);
    position: int64 [B], each sample's position in the epoch's global order. Raises ValueError if
    the batch has no "position" tensor (the server does not send it) or no stacked "image" (its
    images have different sizes: a ragged field), TypeError if the result is not a tensor.
    """
    check_finishable(batch)
    out = gpu_transform(batch["image"], batch["position"], seed=seed, epoch=epoch)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"gpu_transform must return a tensor, got {type(out).__name__}")
    batch["image"] = out


class CudaTransfer:
    """Copies CPU batches (dict of tensors) to ``device`` on a side stream. Thread-safe.

    device: a CUDA device with its index (``batchd.client.options.resolve_device``). slots: pinned
    buffers per tensor name for batches that are not in registered memory. register_host_memory:
    copy shared-memory batches straight from their (registered) slots.
    Raises RuntimeError if CUDA is not available, ValueError if ``device`` is not ``cuda:N``.
    """

    def __init__(self, device: torch.device, slots: int = 2, register_host_memory: bool = True):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device} requested but CUDA is not available")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"CudaTransfer needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self.maps_host_memory = register_host_memory
        self._lock = threading.Lock()
        self._pinned: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self._registered: set[int] = set()  # host addresses registered with CUDA
        self._holding: collections.deque = collections.deque()  # (event, source batch) until copied

    def register(self, address: int, size: int) -> bool:
        """Register ``size`` bytes of host memory at ``address`` (a read-only shared-memory mapping)
        with CUDA, once. False if CUDA refuses (its batches then go through pinned buffers)."""
        with self._lock:
            if address in self._registered:
                return True
            with torch.cuda.device(self.device):
                flags = _HOST_REGISTER_PORTABLE | _HOST_REGISTER_READ_ONLY
                err = torch.cuda.cudart().cudaHostRegister(address, size, flags)
            if int(err) != 0:
                log.warning("cudaHostRegister of a shared-memory segment failed (%s); copying through pinned buffers",
                            err)
                self.maps_host_memory = False
                return False
            self._registered.add(address)
            return True

    def unregister(self, address: int) -> None:
        """Undo ``register`` (the caller guarantees no copy from it is in flight)."""
        with self._lock:
            if address in self._registered:
                self._registered.discard(address)
                with torch.cuda.device(self.device):
                    torch.cuda.cudart().cudaHostUnregister(address)

    def _pinned_view(self, k: int, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._pinned[k].get(name)
        if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
            buf = self._pinned[k][name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        return buf[: t.numel()].view(t.shape)

    def _collect(self) -> None:
        """Let go of source batches whose copies have completed (their leases go back)."""
        while self._holding and self._holding[0][0].query():
            self._holding.popleft()

    def to_device(self, batch: dict[str, fields.Field], stopping: threading.Event | None = None, *,
                  registered: bool = False, finish: Callable[..., torch.Tensor] | None = None, seed: int = 0,
                  epoch: int = 0) -> tuple[dict[str, fields.Field], torch.cuda.Event]:
        """Start copying ``batch`` to the device; returns the device fields and the copy's event.

        Each stacked tensor, and each ragged field's flat values, is copied as one tensor (a
        ragged field is split into per-sample views on the device afterwards, ``fields.unpack``);
        lists of str / bytes stay on the CPU.

        registered: the tensors lie in registered host memory (``register``): copied directly and
        ``batch`` is kept until the copy completes. finish: a ``gpu_transform`` run on the side
        stream after the copy (see ``finish``). Raises TransferStopped if ``stopping`` is set.
        """
        # receiver threads start on device 0: switch first, or CUDA makes a context there (DDP ranks)
        with self._lock, torch.cuda.device(self.device):
            if stopping is not None and stopping.is_set():
                raise TransferStopped("the receiver was stopped")
            self._collect()
            out = {}
            if registered:
                with torch.cuda.stream(self.stream):
                    for name, t in batch.items():  # a ragged field's flat values in one copy; str stays
                        out[name] = fields.map_values(t, lambda v: v.to(self.device, non_blocking=True))
                    event = self._finish_and_record(out, finish, seed, epoch)
                self._holding.append((event, batch))
                return out, event
            k = self._next
            self._next = (k + 1) % len(self._events)
            if self._events[k] is not None:
                self._events[k].synchronize()  # the copy out of this pinned slot has finished
            with torch.cuda.stream(self.stream):
                for name, t in batch.items():
                    out[name] = fields.map_values(t, lambda v, name=name: self._pinned_copy(k, name, v))
                event = self._events[k] = self._finish_and_record(out, finish, seed, epoch)
            return out, event

    def _pinned_copy(self, k: int, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, through pinned slot k's buffer for ``name`` (on the current stream)."""
        pinned = self._pinned_view(k, name, t)
        pinned.copy_(t)
        return pinned.to(self.device, non_blocking=True)

    def _finish_and_record(self, out: dict[str, torch.Tensor], gpu_transform, seed: int,
                           epoch: int) -> torch.cuda.Event:
        if gpu_transform is not None:
            finish(out, gpu_transform, seed, epoch)
        event = torch.cuda.Event(blocking=True)
        event.record(self.stream)
        return event

    def hand_over(self, batch: dict[str, torch.Tensor], event: torch.cuda.Event) -> dict[str, torch.Tensor]:
        """Call in the consumer's thread: its current stream waits for the copy, then uses the tensors."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in batch.values():
            t.record_stream(current)
        with self._lock:
            self._collect()  # sources copied by now go back (their leases) without waiting for the next copy
        return batch

    def close(self) -> None:
        """Wait for copies in flight and let go of their sources. Idempotent."""
        with self._lock:
            self.stream.synchronize()
            self._holding.clear()
