"""The server-wide cache of prefix outputs: a shared-memory RAM tier spilling to a disk tier.

The server creates one shared-memory segment of exactly ``cache.memory_bytes`` (``create``)
before it starts its workers; each worker process attaches to it by name (``attach``). The
segment holds a header (settings as JSON, the arena's fill mark, the disk bytes in use), per
worker and dataset counters (each process writes only its own row: no lost updates), an
open-addressing table (16-byte key -> arena offset) and the arena of entries (``entry.py``).

Policy: a fixed subset. An entry is admitted while there is room (RAM first, then disk) and is
never evicted to make room for another: under repeated epochs over a dataset larger than the
cache, LRU evicts every entry just before it is used again (hit rate 0), while keeping the first
entries that fit hits ``capacity / dataset`` of the samples every epoch (tests/data/test_cache.py
``test_fixed_subset_beats_lru_on_cyclic_scans``). Entries leave only when found corrupt, or
when the server restarts (RAM), the build changes (disk), or, at a start, a disk entry has not
been used for ``disk_max_idle_s``. The cost: entries of a pipeline prefix no longer used keep
their room until then.

Concurrency: writers (RAM insert, disk reservation) hold an ``flock`` on the segment's file and
check and act under it: a key found in the table, on disk, or being written by another worker
(``disk.claim``) is not stored again, so bytes are reserved once per entry and ``disk_used`` is
the size of the entry files (tests/data/test_cache_bounds.py). Readers take no lock: an arena
entry is written before its table slot is published and never moved or overwritten, and every
read checks the entry's key and checksum. Any cache failure
(full, I/O error, corrupt entry) falls back to computing: ``get_or_compute`` raises only
what ``compute`` raises.
"""

from __future__ import annotations

import enum
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import struct
from collections.abc import Callable, Sequence

import numpy as np

from batchd.server.shm import SHM_DIR, Segment

from . import disk, entry

log = logging.getLogger(__name__)

_MAGIC = b"BDCACHE1"
_HEADER = 4096
_FILL = struct.Struct("<QQ")  # arena bytes used, disk bytes used; at offset 16
_MAX_LOAD = 0.7  # table slots in use at most; then new entries go to disk


class Field(enum.IntEnum):
    """Per-dataset counters (summed over processes by ``SharedCache.stats``)."""

    HITS_RAM = 0
    HITS_DISK = 1
    MISSES = 2
    BYTES_RAM = 3
    BYTES_DISK = 4
    EVICTIONS = 5      # entries dropped: found corrupt (or over disk_bytes at start)
    NOT_ADMITTED = 6   # computed samples the full cache did not take
    ERRORS = 7         # cache failures that fell back to computing (I/O errors...)


def sample_key(dataset_fingerprint: str, index: int, prefix: str, build_fingerprint: str) -> bytes:
    """The 16-byte cache key of one sample's prefix output: a hash of (dataset fingerprint,
    sample index, canonical prefix text, build fingerprint). Raises ValueError without a
    dataset fingerprint (the samples' identity would be unknown)."""
    if not dataset_fingerprint:
        raise ValueError("a dataset without a fingerprint cannot be cached")
    h = hashlib.sha256(f"batchd-cache/1\0{dataset_fingerprint}\0{index}\0{prefix}\0{build_fingerprint}".encode())
    key = bytearray(h.digest()[:16])
    key[0] |= 1  # never all zero: a zero first word marks a free table slot
    return bytes(key)


class SharedCache:
    """One process's handle on the shared cache (see module docstring).

    ``create`` (server) and ``attach`` (worker) return one; ``close`` unmaps (and, for the
    creator, removes the segment and releases the disk directory).
    """

    def __init__(self, seg: Segment, row: int, owner: bool, disk_lock: int | None = None):
        self._seg, self._owner, self._disk_lock = seg, owner, disk_lock
        buf = seg.buf
        if bytes(buf[:8]) != _MAGIC:
            raise ValueError(f"shared memory {seg.name!r} is not a batchd cache")
        (meta_len,) = struct.unpack_from("<I", buf, 8)
        meta = json.loads(bytes(buf[64:64 + meta_len]))
        self.datasets: list[str] = meta["datasets"]
        self.rows: int = meta["rows"]
        self.compress: bool = meta["compress"]
        self.disk_root = pathlib.Path(meta["disk_dir"]) if meta["disk_dir"] else None
        self.disk_bytes: int = meta["disk_bytes"]
        self.memory_bytes = seg.capacity
        nd, nf, slots = len(self.datasets), len(Field), meta["slots"]
        self._ds = {name: i for i, name in enumerate(self.datasets)}
        self.counters = np.ndarray((self.rows, max(nd, 1), nf), np.int64, buf, meta["counters_offset"])
        self._row = self.counters[min(row, self.rows - 1)]
        self._keys = np.ndarray((slots, 2), np.uint64, buf, meta["table_offset"])
        self._locs = np.ndarray((slots,), np.uint64, buf, meta["table_offset"] + slots * 16)
        self._arena_offset = meta["arena_offset"]
        self._arena = buf[self._arena_offset:]
        self._lock_fd = os.open(SHM_DIR / seg.name, os.O_RDWR)

    # -- creation -------------------------------------------------------------------------------------------

    @classmethod
    def create(cls, name: str, *, memory_bytes: int, datasets: Sequence[str], workers: int, build: str,
               disk_dir: os.PathLike[str] | str | None = None, disk_bytes: int = 0,
               compress: bool = False, disk_max_idle_s: float = float("inf")) -> "SharedCache":
        """Create the segment ``name`` (exactly ``memory_bytes``) for ``workers`` processes
        (worker ids 0..workers-1; the creator uses one more row) and prepare ``disk_dir``
        (``disk.prepare``: wiped if ``build`` differs; entries unused for ``disk_max_idle_s``
        seconds removed). Raises ValueError if memory_bytes is too
        small for header, counters and table (under 64 KiB); OSError from shared memory or disk.
        """
        rows = workers + 1
        nd = max(len(datasets), 1)
        counters_offset = _HEADER
        counters_bytes = rows * nd * len(Field) * 8
        slots = max(1024, memory_bytes // 2048)  # 1.2% of the memory; 0.7 full: an entry per 2.9 KiB
        table_offset = -(-(counters_offset + counters_bytes) // 64) * 64
        arena_offset = -(-(table_offset + slots * 24) // 4096) * 4096
        if memory_bytes < max(arena_offset + 4096, 1 << 16):
            raise ValueError(f"cache.memory_bytes ({memory_bytes}) is too small: at least "
                             f"{max(arena_offset + 4096, 1 << 16)} bytes for {len(datasets)} datasets")
        lock_fd, per_dataset = None, {}
        if disk_dir and disk_bytes > 0:
            prepared = disk.prepare(pathlib.Path(disk_dir), build, disk_bytes, disk_max_idle_s)
            if prepared is not None:
                lock_fd, per_dataset = prepared
        meta = {"datasets": list(datasets), "rows": rows, "compress": bool(compress), "slots": slots,
                "disk_dir": os.fspath(disk_dir) if lock_fd is not None else None, "disk_bytes": int(disk_bytes),
                "counters_offset": counters_offset, "table_offset": table_offset, "arena_offset": arena_offset}
        text = json.dumps(meta).encode()
        if 64 + len(text) > _HEADER:
            raise ValueError("too many or too long dataset names for the cache header")
        seg = Segment.create(name, memory_bytes)
        seg.buf[8:12] = struct.pack("<I", len(text))
        seg.buf[64:64 + len(text)] = text
        seg.buf[:8] = _MAGIC
        self = cls(seg, workers, owner=True, disk_lock=lock_fd)
        for i, ds in enumerate(self.datasets):
            self._row[i, Field.BYTES_DISK] = per_dataset.get(disk.dataset_dir(ds), 0)
        _FILL.pack_into(seg.buf, 16, 0, sum(per_dataset.values()))
        return self

    @classmethod
    def attach(cls, name: str, worker_id: int) -> "SharedCache | None":
        """The cache ``name`` as seen from worker ``worker_id``; None if there is none (or it
        cannot be opened: the worker then computes every sample)."""
        try:
            return cls(Segment.attach(name), worker_id, owner=False)
        except FileNotFoundError:
            return None
        except Exception as e:  # never let a broken cache stop a worker
            log.warning("cache %r cannot be attached: %s: %s", name, type(e).__name__, e)
            return None

    def close(self) -> None:
        """Unmap; the creator also removes the segment and releases the disk directory. Idempotent."""
        if self._lock_fd < 0:
            return
        self.counters = self._row = self._keys = self._locs = None
        self._arena.release()
        try:
            self._seg.close()
        except BufferError:
            pass
        os.close(self._lock_fd)
        self._lock_fd = -1
        if self._owner:
            self._seg.unlink()
            if self._disk_lock is not None:
                os.close(self._disk_lock)

    # -- use ------------------------------------------------------------------------------------------------

    def get_or_compute(self, dataset: str, key: bytes | None, compute: Callable[[], np.ndarray]) -> np.ndarray:
        """The cached image under ``key``, else ``compute()`` (then stored if there is room).

        key None (e.g. a dataset without fingerprint) or a dataset unknown to the cache: just
        compute. Returns a new writable array either way. Raises only what ``compute`` raises.
        """
        d = self._ds.get(dataset)
        if key is None or d is None:
            return compute()
        row = self._row[d]
        try:
            image = self._get(dataset, key, row)
        except Exception as e:
            row[Field.ERRORS] += 1
            log.debug("cache read failed: %s: %s", type(e).__name__, e)
            image = None
        if image is not None:
            return image
        row[Field.MISSES] += 1
        image = compute()
        try:
            self._put(dataset, key, image, row)
        except Exception as e:
            row[Field.ERRORS] += 1
            log.debug("cache write failed: %s: %s", type(e).__name__, e)
        return image

    def contains(self, dataset: str, key: bytes) -> bool:
        """Whether an entry for ``key`` is stored (in RAM, or a file on disk), without reading or
        checking it. Thread-safe (it only reads); never raises (False on any error)."""
        try:
            i, found = self._slot(key)
            if found and self._locs[i]:
                return True
            return self.disk_root is not None and disk.entry_path(self.disk_root, dataset, key).exists()
        except Exception:
            return False

    def room(self, nbytes: int) -> bool:
        """Whether an entry of about ``nbytes`` would be stored now (RAM or disk): a hint read
        without the lock, for work done only to be stored (``_put`` decides). Never raises."""
        try:
            used, disk_used = _FILL.unpack_from(self._seg.buf, 16)
            if (-(-used // 8) * 8 + nbytes + 4096 <= len(self._arena)
                    and self._slots_used() < _MAX_LOAD * len(self._locs)):
                return True
            return self.disk_root is not None and disk_used + nbytes <= self.disk_bytes
        except Exception:
            return False

    def _slot(self, key: bytes) -> tuple[int, bool]:
        """(table slot, found): the key's slot, or the free slot where it would go (-1 if full)."""
        k0, k1 = np.frombuffer(key, np.uint64)
        n = len(self._locs)
        i = int(k0 % n)
        for _ in range(n):
            s0 = self._keys[i, 0]
            if s0 == 0:
                return i, False
            if s0 == k0 and self._keys[i, 1] == k1:
                return i, True
            i = i + 1 if i + 1 < n else 0
        return -1, False

    def _get(self, dataset: str, key: bytes, row: np.ndarray) -> np.ndarray | None:
        i, found = self._slot(key)
        if found:
            loc = int(self._locs[i])
            if loc:
                try:
                    image = entry.decode(self._arena[loc - 1:], key)
                    row[Field.HITS_RAM] += 1
                    return image
                except entry.CorruptEntry:
                    row[Field.EVICTIONS] += 1  # RAM entries cannot be freed: the slot stays, recomputed each time
        if self.disk_root is None:
            return None
        path = disk.entry_path(self.disk_root, dataset, key)
        try:
            image = disk.read(path, key)
        except entry.CorruptEntry:
            self._drop_file(path, row)
            return None
        if image is not None:
            row[Field.HITS_DISK] += 1
        return image

    def _drop_file(self, path: pathlib.Path, row: np.ndarray) -> None:
        with self._locked():
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:
                return
            used, disk_used = _FILL.unpack_from(self._seg.buf, 16)
            _FILL.pack_into(self._seg.buf, 16, used, max(0, disk_used - size))
        row[Field.BYTES_DISK] -= size
        row[Field.EVICTIONS] += 1

    def _put(self, dataset: str, key: bytes, image: np.ndarray, row: np.ndarray) -> None:
        arrays = [image] if isinstance(image, np.ndarray) else [v for v in image.values() if isinstance(v, np.ndarray)]
        # full: not even encoded (a 4.5 MB decode: about 2 ms); lz4 might make it fit: tried
        if not self.compress and not self.room(sum(a.nbytes for a in arrays)):
            row[Field.NOT_ADMITTED] += 1
            return
        head, payload = entry.encode(key, image, self.compress)
        size = len(head) + len(payload)
        with self._locked():
            used, disk_used = _FILL.unpack_from(self._seg.buf, 16)
            i, found = self._slot(key)
            if found:
                return  # another worker stored it meanwhile (or a corrupt RAM entry holds the slot)
            table_ok = i >= 0 and self._slots_used() < _MAX_LOAD * len(self._locs)
            start = -(-used // 8) * 8
            if table_ok and start + size <= len(self._arena):
                self._arena[start:start + len(head)] = head
                self._arena[start + len(head):start + size] = payload
                _FILL.pack_into(self._seg.buf, 16, start + size, disk_used)
                k0, k1 = np.frombuffer(key, np.uint64)
                self._locs[i] = start + 1  # published before the key: a reader that sees the key sees it
                self._keys[i, 1] = k1
                self._keys[i, 0] = k0
                self._used_slots(+1)
                row[Field.BYTES_RAM] += size
                return
            if self.disk_root is None or disk_used + size > self.disk_bytes:
                row[Field.NOT_ADMITTED] += 1
                return
            path = disk.entry_path(self.disk_root, dataset, key)
            fd = disk.claim(path)
            if fd is None:
                return  # on disk already, or another worker is writing it (and reserved its bytes)
            _FILL.pack_into(self._seg.buf, 16, used, disk_used + size)  # reserved
        try:
            disk.write(fd, path, head, payload)
        except BaseException:
            with self._locked():
                used, disk_used = _FILL.unpack_from(self._seg.buf, 16)
                _FILL.pack_into(self._seg.buf, 16, used, max(0, disk_used - size))
            raise
        row[Field.BYTES_DISK] += size

    def _slots_used(self) -> int:
        return struct.unpack_from("<Q", self._seg.buf, 32)[0]

    def _used_slots(self, delta: int) -> None:
        struct.pack_into("<Q", self._seg.buf, 32, self._slots_used() + delta)

    def _locked(self):
        return _Flock(self._lock_fd)

    # -- figures --------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, dict[str, int]]:
        """Per dataset: hits (RAM + disk), hits_ram, hits_disk, misses, bytes_ram, bytes_disk,
        evictions, not_admitted, errors (counts, bytes), summed over all processes."""
        total = self.counters.sum(axis=0)
        out = {}
        for i, ds in enumerate(self.datasets):
            c = {f.name.lower(): int(total[i, f]) for f in Field}
            c["hits"] = c["hits_ram"] + c["hits_disk"]
            out[ds] = c
        return out

    def bytes_used(self) -> tuple[int, int]:
        """(arena bytes used in RAM, bytes of entry files on disk)."""
        return _FILL.unpack_from(self._seg.buf, 16)


class _Flock:
    __slots__ = ("fd",)

    def __init__(self, fd: int):
        self.fd = fd

    def __enter__(self):
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.fd, fcntl.LOCK_UN)
