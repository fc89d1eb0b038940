"""Named shared-memory segments and the pool of batch slots built from them.

A segment is a file in ``/dev/shm`` (POSIX shared memory on Linux) mapped with ``mmap``; we
manage the files ourselves rather than through ``multiprocessing.shared_memory`` so that no
resource tracker unlinks a slot behind the server's back when a worker exits. Every name starts
with the owning server's prefix ``batchd-<pid>-<random>-``; the server holds an exclusive
``flock`` on ``<prefix>lock`` while it lives, so segments left by a server that was SIGKILLed
are found and removed by the next server sharing the directory (``remove_stale``), even across
PID namespaces (containers sharing an IPC namespace).

Slots are reused across batches and streams: a fresh segment costs a page fault per 4 KiB on
first write; a reused one costs nothing. Their number bounds the memory the server holds.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import pathlib
import re
import secrets
import tempfile
import threading

log = logging.getLogger(__name__)

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
_PREFIX = re.compile(r"^(batchd-\d+-[0-9a-f]+-)")


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
    """Unlink the segments of batchd servers that no longer run; returns how many."""
    by_prefix: dict[str, list[pathlib.Path]] = {}
    for path in SHM_DIR.glob("batchd-*"):
        m = _PREFIX.match(path.name)
        if m:
            by_prefix.setdefault(m.group(1), []).append(path)
    removed = 0
    for prefix, paths in by_prefix.items():
        try:
            fd = os.open(SHM_DIR / f"{prefix}lock", os.O_RDWR)
        except FileNotFoundError:
            fd = None  # no lock file: its server is gone (or never finished starting)
        except OSError:
            continue
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # alive
            for path in paths:
                try:
                    path.unlink()
                    removed += 1
                except OSError:
                    pass
        finally:
            if fd is not None:
                os.close(fd)
    if removed:
        log.info("removed %d shared-memory segments left by batchd servers that are gone", removed)
    return removed


class Owner:
    """This server's claim on a segment-name prefix: an flock held until ``close``.

    Also writes the probe segment that clients read to find out whether they share this
    server's shared memory (``probe_name``, holding ``probe_token``).
    """

    def __init__(self) -> None:
        self.prefix = f"batchd-{os.getpid()}-{secrets.token_hex(4)}-"
        self._lock_fd = os.open(SHM_DIR / f"{self.prefix}lock", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self.probe_token = secrets.token_bytes(16)
        self.probe_name = f"{self.prefix}probe"
        probe = Segment.create(self.probe_name, len(self.probe_token))
        probe.buf[: len(self.probe_token)] = self.probe_token
        probe.close()

    def close(self) -> None:
        """Unlink every segment under this prefix (slots, the probe, segments a worker grew and
        died before reporting), the lock file last."""
        for path in SHM_DIR.glob(f"{self.prefix}*"):
            if path.name != f"{self.prefix}lock":
                try:
                    path.unlink()
                except FileNotFoundError:
                    pass
        try:
            os.unlink(SHM_DIR / f"{self.prefix}lock")
        except FileNotFoundError:
            pass
        os.close(self._lock_fd)


class SlotPool:
    """At most ``max_slots`` reusable segments, handed out to one batch at a time.

    ``acquire`` returns a free slot of at least ``min_capacity`` bytes (or the largest free one,
    which the worker may outgrow), creating one while under the cap; None when all are taken.
    Thread-safe.
    """

    def __init__(self, *, max_slots: int, prefix: str, default_capacity: int = 1 << 20):
        self.prefix = prefix
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

    def detach(self, slot: Segment) -> None:
        """Lend ``slot`` out (to a client): it no longer counts against ``max_slots`` until ``give_back``."""
        with self._lock:
            self._all.pop(slot.name, None)

    def give_back(self, slot: Segment) -> None:
        """A lent slot returns: reused if there is room, else unlinked."""
        with self._lock:
            if len(self._all) < self.max_slots:
                self._all[slot.name] = slot
                self._free.append(slot)
                return
        self._drop(slot)

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
