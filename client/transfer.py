"""Host-to-device copies that overlap compute: reused pinned buffers and a side CUDA stream.

Pattern from ffcv's ``loader/epoch_iterator.py`` and spdl's ``io/_transfer.py``:

* ``slots`` pinned host buffers per tensor name, allocated once (grown if a batch is larger) and
  reused round robin; before slot k is overwritten we wait on the event recorded after the last
  copy out of it, so a copy in flight is never corrupted;
* the copy to the device is issued on a side stream (``non_blocking=True``), in the loader's
  background thread, while the training step runs on the default stream;
* ``hand_over`` makes the consumer's current stream wait for that copy's event and marks the
  device tensors as used on it (``record_stream``), so the caching allocator never recycles
  them early.
"""

from __future__ import annotations

import torch


class CudaTransfer:
    """Copies CPU batches (dict of tensors) to ``device`` on a side stream.

    Raises RuntimeError if CUDA is not available.
    """

    def __init__(self, device: torch.device, slots: int = 2):
        if not torch.cuda.is_available():
            raise RuntimeError(f"device={device} requested but CUDA is not available")
        self.device = device
        self.stream = torch.cuda.Stream(device)
        self._pinned: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def _pinned_view(self, k: int, name: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._pinned[k].get(name)
        if buf is None or buf.dtype != t.dtype or buf.numel() < t.numel():
            buf = self._pinned[k][name] = torch.empty(t.numel(), dtype=t.dtype, pin_memory=True)
        return buf[: t.numel()].view(t.shape)

    def to_device(self, batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.cuda.Event]:
        """Start copying ``batch`` to the device; returns the device tensors and the copy's event."""
        k = self._next
        self._next = (k + 1) % len(self._events)
        if self._events[k] is not None:
            self._events[k].synchronize()  # the copy out of this pinned slot has finished
        out = {}
        with torch.cuda.stream(self.stream):
            for name, t in batch.items():
                pinned = self._pinned_view(k, name, t)
                pinned.copy_(t)
                out[name] = pinned.to(self.device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        self._events[k] = event
        return out, event

    def hand_over(self, batch: dict[str, torch.Tensor], event: torch.cuda.Event) -> dict[str, torch.Tensor]:
        """Call in the consumer's thread: its current stream waits for the copy, then uses the tensors."""
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in batch.values():
            t.record_stream(current)
        return batch
