"""Host-to-device copies that overlap compute: a side CUDA stream, reused pinned buffers, and
shared-memory slots copied from directly.

Pattern from ffcv's ``loader/epoch_iterator.py`` and spdl's ``io/_transfer.py``:

* the copy to the device is issued on a side stream (``non_blocking=True``), in the loader's
  converter thread (``batchd.client.device.convert``), while the training step runs on the
  default stream;
* inline batches go through ``slots`` pinned host buffers per tensor name, allocated once (grown
  if a batch is larger) and reused round robin; before slot k is overwritten we wait on the
  (blocking, so the thread sleeps rather than spins) event recorded after the last copy out of
  it, so a copy in flight is never corrupted;
* same-host batches are copied straight from the server's shared-memory slot, registered with
  CUDA once (client/device/host_register.py, client/transport/shm.py), the batch (its lease) kept
  until its copy's event has completed; if CUDA refuses, they go through the pinned buffers.

``to_device`` may be called from several converter threads (a new iteration's, and one of an
iteration that ended and outlives its ``close()``): it holds the copy lock, and refuses
(``TransferStopped``) a call whose iteration is stopping, so a stale thread never fills a slot the
live one uses. ``hand_over`` (the consumer's thread) never takes the copy lock.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import threading
from typing import Callable, Iterator

import torch

from batchd.client import forks
from batchd.client.device.host_register import HostRegistry
from batchd.client.transport import fields

log = logging.getLogger(__name__)


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
    position: int64 [B], each sample's position in the epoch's global order. Raises ValueError as
    ``check_finishable``, TypeError if the result is not a tensor.
    """
    check_finishable(batch)
    out = gpu_transform(batch["image"], batch["position"], seed=seed, epoch=epoch)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"gpu_transform must return a tensor, got {type(out).__name__}")
    batch["image"] = out


class CudaTransfer:
    """Copies CPU batches (dict of tensors) to ``device`` on a side stream. Thread-safe.

    device: a CUDA device with its index (``batchd.client.loader.options.resolve_device``). slots: pinned
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
        self._lock = threading.Lock()  # the copy lock: the side stream's work and the pinned buffers
        self._pinned: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0
        self.host = HostRegistry(torch.cuda.cudart(), bind=functools.partial(torch.cuda.set_device, device))
        forks.keep(self)  # a forked child never frees these CUDA objects (batchd.client.forks)
        self._holding_lock = threading.Lock()  # _holding alone (hand_over never waits for a copy)
        self._holding: collections.deque = collections.deque()  # (event, source batch) until copied

    def register(self, address: int, size: int) -> bool:
        """Register ``size`` bytes of host memory at ``address`` (a read-only shared-memory mapping)
        with CUDA, once (``HostRegistry.register``). False if CUDA refuses: from then on every
        batch goes through pinned buffers (``maps_host_memory`` turns False)."""
        if self.host.register(address, size):
            return True
        self.maps_host_memory = False
        return False

    def unregister(self, address: int) -> None:
        """Undo ``register`` (the caller guarantees no copy from it is in flight)."""
        self.host.unregister(address)

    def _collect(self) -> None:
        """Let go of source batches whose copies have completed (their leases go back)."""
        with self._holding_lock:
            while self._holding and self._holding[0][0].query():
                self._holding.popleft()

    @contextlib.contextmanager
    def _waits_on_error(self) -> Iterator[None]:
        """An error inside first waits for the side stream: a copy queued before it may still read
        its source (a leased slot, a pinned buffer), which is let go as the error propagates."""
        try:
            yield
        except BaseException:
            self.stream.synchronize()
            raise

    @contextlib.contextmanager
    def exclusive(self, stopping: threading.Event | None = None) -> Iterator[torch.cuda.Stream]:
        """The side stream, current, idle and to the caller alone: for work that allocates on it
        but writes from a stream of its own (torchvision's nvJPEG decode). Holds the copy lock (no
        other receiver queues work meanwhile) and first waits for the work queued before (a block
        another receiver freed on the stream may still be read there, and the caching allocator
        hands it out again at once). Errors inside wait as in ``to_device``. Raises
        TransferStopped if ``stopping`` is set."""
        with self._lock, torch.cuda.device(self.device):
            if stopping is not None and stopping.is_set():
                raise TransferStopped("the receiver was stopped")
            self.stream.synchronize()
            with self._waits_on_error(), torch.cuda.stream(self.stream):
                yield self.stream

    def to_device(self, batch: dict[str, fields.Field], stopping: threading.Event | None = None, *,
                  registered: bool = False, finish: Callable[..., torch.Tensor] | None = None, seed: int = 0,
                  epoch: int = 0, marks: list | None = None) -> tuple[dict[str, fields.Field], torch.cuda.Event]:
        """Start copying ``batch`` to the device; returns the device fields and the copy's event.

        Each stacked tensor, and each ragged field's flat values, is copied as one tensor (a
        ragged field is split into per-sample views on the device afterwards, ``fields.unpack``);
        lists of str / bytes stay on the CPU.

        registered: the tensors lie in registered host memory (``register``): copied directly and
        ``batch`` is kept until the copy completes. finish: a ``gpu_transform`` run on the side
        stream after the copy (see ``finish``). marks: a list to which the timing events recorded
        before and after the copy are appended (the returned event then records timing too), for
        ``batchd.client.loader.timings``. Raises TransferStopped if ``stopping`` is set; any error raised
        after a copy was queued is raised once the side stream is idle.
        """
        # receiver threads start on device 0: switch first, or CUDA makes a context there (DDP ranks)
        with self._lock, torch.cuda.device(self.device):
            if stopping is not None and stopping.is_set():
                raise TransferStopped("the receiver was stopped")
            self._collect()
            k = None  # registered: copied straight from it; else through pinned slot k
            if not registered:
                k, self._next = self._next, (self._next + 1) % len(self._events)
                if self._events[k] is not None:
                    self._events[k].synchronize()  # the copy out of this pinned slot has finished
            with self._waits_on_error(), torch.cuda.stream(self.stream):
                self._mark(marks)
                # a ragged field's flat values in one copy; str stays
                out = {name: fields.map_values(t, functools.partial(self._copy, k, name))
                       for name, t in batch.items()}
                self._mark(marks)
                event = self._finish_and_record(out, finish, seed, epoch, marks is not None)
            if k is not None:
                self._events[k] = event
            else:
                with self._holding_lock:
                    self._holding.append((event, batch))
            return out, event

    def _copy(self, k: int | None, name: str, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device, on the current stream: straight from it (``k`` None), or through
        pinned slot k's buffer for ``name`` (allocated once, grown if ``t`` is larger)."""
        if k is not None:
            buf = self._pinned[k].get(name)
            if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
                buf = self._pinned[k][name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
            t = buf[: t.numel()].view(t.shape).copy_(t)
        return t.to(self.device, non_blocking=True)

    def _mark(self, marks: list | None) -> None:
        if marks is not None:
            event = torch.cuda.Event(enable_timing=True)
            event.record(self.stream)
            marks.append(event)

    def _finish_and_record(self, out: dict[str, torch.Tensor], gpu_transform, seed: int,
                           epoch: int, timed: bool) -> torch.cuda.Event:
        if gpu_transform is not None:
            finish(out, gpu_transform, seed, epoch)
        event = torch.cuda.Event(blocking=True, enable_timing=timed)
        event.record(self.stream)
        return event

    def hand_over(self, batch: dict[str, torch.Tensor], event: torch.cuda.Event) -> dict[str, torch.Tensor]:
        """Call in the consumer's thread: its current stream waits for the copy, then uses the tensors
        (``record_stream``: the caching allocator never recycles them early). Never waits for the
        copy lock (a receiver may hold it through a whole batch's copy)."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in batch.values():
            t.record_stream(current)
        self._collect()  # sources copied by now go back (their leases) without waiting for the next copy
        return batch

    def close(self) -> None:
        """Wait for copies in flight, let go of their sources, unregister host memory. Idempotent."""
        with self._lock:
            self.stream.synchronize()
            with self._holding_lock:
                self._holding.clear()
        self.host.close()
