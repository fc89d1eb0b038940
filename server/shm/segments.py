"""Named shared-memory segments: created, attached, and cleaned up after a server that died.

A segment is a file in ``/dev/shm`` (POSIX shared memory on Linux) mapped with ``mmap``; we
manage the files ourselves rather than through ``multiprocessing.shared_memory`` so that no
resource tracker unlinks a slot behind the server's back when a worker exits. Every name starts
with the owning server's prefix ``batchd-<pid>-<random>-``; the server holds an exclusive
``flock`` on ``<prefix>lock`` while it lives, so segments left by a server that was SIGKILLed
are found and removed by the next server sharing the directory (``remove_stale``), even across
PID namespaces (containers sharing an IPC namespace).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import pathlib
import re
import secrets
import tempfile

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
