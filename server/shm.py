"""Named shared-memory segments and the pool of batch slots built from them.

A segment is a file in ``/dev/shm`` (POSIX shared memory on Linux) mapped with ``mmap``; we
manage the files ourselves rather than through ``multiprocessing.shared_memory`` so that no
resource tracker unlinks a slot behind the server's back when a worker exits. Every name starts
with ``batchd-<server pid>-`` so segments left by a server that was SIGKILLed are found and
removed by the next server on the host (``remove_stale``).

Slots are reused across batches and streams: a fresh segment costs a page fault per 4 KiB on
first write; a reused one costs nothing. Their number bounds the memory the server holds.
"""

from __future__ import annotations

import itertools
import logging
import mmap
import os
import pathlib
import re
import tempfile
import threading

log = logging.getLogger(__name__)

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
_NAME = re.compile(r"^batchd-(\d+)-")


class Segment:
    """A named, mapped shared-memory file of ``capacity`` bytes. ``buf`` is a writable memoryview."""

    __slots__ = ("name", "capacity", "_mmap", "buf")

    def __init__(self, name: str, capacity: int, *, create: bool):
        path = SHM_DIR / name
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, capacity)
            else:
                capacity = os.fstat(fd).st_size
            self._mmap = mmap.mmap(fd, capacity)
        finally:
            os.close(fd)
        self.name, self.capacity = name, capacity
        self.buf = memoryview(self._mmap)

    @classmethod
    def create(cls, name: str, capacity: int) -> "Segment":
        return cls(name, max(capacity, mmap.PAGESIZE), create=True)

    @classmethod
    def attach(cls, name: str) -> "Segment":
        return cls(name, 0, create=False)

    def close(self) -> None:
        """Unmap. Raises BufferError if numpy arrays or memoryviews on ``buf`` are still alive."""
        self.buf.release()
        self._mmap.close()

    def unlink(self) -> None:
        try:
            os.unlink(SHM_DIR / self.name)
        except FileNotFoundError:
            pass


def remove_stale() -> int:
    """Unlink segments of batchd servers that no longer run; returns how many."""
    removed = 0
    for path in SHM_DIR.glob("batchd-*"):
        m = _NAME.match(path.name)
        if not m:
            continue
        pid = int(m.group(1))
        try:
            os.kill(pid, 0)
            continue
        except ProcessLookupError:
            pass
        except PermissionError:
            continue
        try:
            path.unlink()
            removed += 1
        except OSError:
            pass
    if removed:
        log.info("removed %d shared-memory segments left by servers that are gone", removed)
    return removed


class SlotPool:
    """At most ``max_slots`` reusable segments, handed out to one batch at a time.

    ``acquire`` returns a free slot of at least ``min_capacity`` bytes (or the largest free one,
    which the worker may outgrow), creating one while under the cap; None when all are taken.
    Thread-safe.
    """

    def __init__(self, *, max_slots: int, default_capacity: int = 1 << 20, prefix: str | None = None):
        self.prefix = prefix or f"batchd-{os.getpid()}-"
        self.max_slots = max_slots
        self.default_capacity = default_capacity
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._all: dict[str, Segment] = {}

    def new_name(self) -> str:
        return f"{self.prefix}{next(self._counter)}"

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._all) - len(self._free)

    @property
    def bytes_mapped(self) -> int:
        with self._lock:
            return sum(s.capacity for s in self._all.values())

    def acquire(self, min_capacity: int = 0) -> Segment | None:
        with self._lock:
            if self._free:
                fits = [s for s in self._free if s.capacity >= min_capacity]
                if fits:
                    slot = min(fits, key=lambda s: s.capacity)
                    self._free.remove(slot)
                    return slot
                if len(self._all) >= self.max_slots:  # replace the smallest free slot by a bigger one
                    small = min(self._free, key=lambda s: s.capacity)
                    self._free.remove(small)
                    self._drop(small)
            if len(self._all) >= self.max_slots:
                return None
            slot = Segment.create(self.new_name(), max(min_capacity, self.default_capacity))
            self._all[slot.name] = slot
            return slot

    def adopt(self, old: Segment, name: str) -> Segment:
        """A worker outgrew ``old`` and wrote into a new segment ``name``: it replaces ``old``."""
        new = Segment.attach(name)
        with self._lock:
            self._all.pop(old.name, None)
            self._drop(old)
            self._all[new.name] = new
        return new

    def release(self, slot: Segment) -> None:
        with self._lock:
            if slot.name in self._all:
                self._free.append(slot)

    def _drop(self, slot: Segment) -> None:
        slot.unlink()
        try:
            slot.close()
        except BufferError:  # a view still points into it; the mapping goes when that view does
            pass

    def close(self) -> None:
        """Unlink every slot. Views handed out must not be used afterwards."""
        with self._lock:
            for slot in self._all.values():
                self._drop(slot)
            self._all.clear()
            self._free.clear()
