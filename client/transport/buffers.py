"""Receive buffers for the socket data plane, reused batch after batch, and a batch's tensors as
views of one (client/transport/dataplane.py receives into them; docs/design/network-path.md).

A fresh buffer costs a page fault per 4 KiB on its first write (about 2,400 for a 64 x 224 x 224
x 3 uint8 batch: measured, receiving into fresh buffers cost the trainer 0.4-0.5 s of CPU per GB
against 0.1-0.2 into reused ones); a reused one costs nothing. So ``BufferPool.take`` hands out a
free buffer big enough, allocating only when none is, and the pool keeps as many buffers as were
ever in use at once. A batch's fields are views of its buffer (``tensors``), which goes back to the
pool once the last of them is freed, exactly as a shared-memory lease goes back (client/transport/shm.py).

Where the loader copies batches to a CUDA device the pool's buffers are pinned (page-locked:
``allocate=pinned``), so the copy reads them directly, asynchronously, with no staging copy
(client/device/transfer.py, ``registered=True``).
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Callable

import numpy as np
import torch

from batchd import wire
from batchd.client.transport import fields

log = logging.getLogger("batchd.client.loader")
GRAIN = 1 << 16  # capacities are multiples of 64 KiB, with an eighth to spare: a slightly larger batch still fits


def pageable(nbytes: int) -> torch.Tensor:
    """A uint8 [nbytes] CPU tensor in ordinary memory."""
    return torch.empty(nbytes, dtype=torch.uint8)


class PinnedPool:
    """``allocate`` for a ``BufferPool`` feeding CUDA copies: pinned buffers up to ``max_bytes`` in
    all, ordinary ones beyond (a loader may hold dozens of received batches ahead, and page-locked
    memory is the host's to share between ranks), and ordinary ones once pinning failed (logged
    once). A copy from an ordinary buffer is synchronous, still correct."""

    def __init__(self, max_bytes: int = 512 << 20) -> None:
        self.max_bytes = max_bytes
        self.bytes = 0  # pinned so far (buffers are kept by their pool, so this only grows)
        self.pinned = True  # pinning works here (it did not fail): buffers are pinned within ``max_bytes``

    def __call__(self, nbytes: int) -> torch.Tensor:
        """A uint8 [nbytes] CPU tensor, page-locked while pinning works and ``max_bytes`` allows."""
        if self.pinned and self.bytes + nbytes <= self.max_bytes:
            try:
                buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as e:
                self.pinned = False
                log.warning("cannot pin %d bytes for received batches (%s); they go to ordinary memory", nbytes, e)
            else:
                self.bytes += nbytes
                return buf
        return pageable(nbytes)


def capacity_for(nbytes: int) -> int:
    """The capacity a new buffer for ``nbytes`` gets: an eighth more, in whole 64 KiB."""
    want = nbytes + nbytes // 8
    return max(GRAIN, (want + GRAIN - 1) // GRAIN * GRAIN)


class BufferPool:
    """Reusable uint8 buffers. Thread-safe (the receiver takes; finalizers give back, from any thread).

    allocate(nbytes) -> a contiguous uint8 CPU tensor of nbytes (``pageable``, ``PinnedPool``...).
    keep: buffers the pool holds at least (free and handed out); it holds as many as were ever
    out at once (``peak``: the loader's lookahead of received batches, which may be dozens), so a
    steady stream allocates nothing: a buffer given back beyond that is dropped, the smallest
    first. Counters: ``allocated`` (buffers made), ``reused`` (takes served from the free list),
    ``outstanding`` (handed out, not back), ``peak``, ``bytes_free`` (bytes of the free list).
    """

    def __init__(self, allocate: Callable[[int], torch.Tensor] = pageable, *, keep: int = 8):
        self.allocate = allocate
        self.keep = keep
        self._lock = threading.Lock()
        self._free: list[torch.Tensor] = []
        self.allocated = 0
        self.reused = 0
        self.outstanding = 0  # buffers handed out and not back yet
        self.peak = 0  # the most ever out at once

    @property
    def pinned(self) -> bool:
        """Whether buffers are page-locked (a ``PinnedPool`` that could pin)."""
        return bool(getattr(self.allocate, "pinned", False))

    @property
    def bytes_free(self) -> int:
        with self._lock:
            return sum(b.numel() for b in self._free)

    def take(self, nbytes: int) -> torch.Tensor:
        """A buffer of at least ``nbytes`` bytes (its contents are whatever it last held)."""
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:  # (by position: list.remove would compare tensors with ==, element by element)
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self.reused += 1
                self.outstanding += 1
                self.peak = max(self.peak, self.outstanding)
                return buf
        buf = self.allocate(capacity_for(nbytes))
        with self._lock:
            self.allocated += 1
            self.outstanding += 1
            self.peak = max(self.peak, self.outstanding)
        return buf

    def give_back(self, buf: torch.Tensor) -> None:
        """``buf`` is no longer used (no view of it lives): keep it for reuse, or drop it."""
        with self._lock:
            self.outstanding -= 1
            self._free.append(buf)
            if len(self._free) + self.outstanding > max(self.keep, self.peak):
                self._free.sort(key=lambda b: b.numel())
                del self._free[0]

    def discard(self, buf: torch.Tensor) -> None:
        """``buf`` is out of use but must never be reused (something may still write it): forget it."""
        with self._lock:
            self.outstanding -= 1

    def clear(self) -> None:
        """Drop every free buffer (those handed out still come back, and are kept up to ``keep``)."""
        with self._lock:
            self._free.clear()


def payload_length(batch: wire.WireBatch) -> int:
    """Bytes of payload a batch's tensors span: the end of the last (0 for none). Raises
    ValueError for a malformed tensor (``fields.nbytes``)."""
    return max((t.offset + fields.nbytes(t) for t in batch.tensors), default=0)


def tensors(batch: wire.WireBatch, buf: torch.Tensor, length: int, give_back: Callable[[torch.Tensor], None]
            ) -> dict[str, fields.Field]:
    """The batch's fields as views of the first ``length`` bytes of ``buf`` (no copy; ragged fields
    one flat tensor each, str / bytes lists are copies), writable, as DataLoader batches are.
    ``give_back(buf)`` runs once every one of them is freed (also if this raises). Raises
    ValueError naming a field the server sent malformed or outside the payload."""
    # every tensor below is a view of this array, and numpy points their base at it (it does not
    # own its memory, and its own base is a memoryview, where numpy stops collapsing a chain of
    # views; a slice of ``buf.numpy()`` would be skipped, its finalizer run while views live)
    base = np.frombuffer(memoryview(buf.numpy()), dtype=np.uint8, count=length)
    weakref.finalize(base, give_back, buf)
    return fields.views(batch, base)
