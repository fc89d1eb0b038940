"""The cache's accounting and bounds under concurrent worker processes (server/data/cache/shared.py).

Real processes (forkserver, as the server's workers) attached to one cache: several missing the
same key at once store it once and count it once; filling past capacity from several processes,
the shared-memory segment is exactly ``memory_bytes`` and the entry files never exceed
``disk_bytes``, measured on the file system while they write.
"""

from __future__ import annotations

import multiprocessing
import os
import pathlib
import secrets
import threading

import numpy as np
import pytest

from batchd.server.data.cache import SharedCache, sample_key
from batchd.server.shm import SHM_DIR

pytestmark = pytest.mark.timeout(120)

PROCESSES = 4


def _image(i: int, side: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, (side, side, 3), np.uint8)


def _key(i: int) -> bytes:
    return sample_key("f" * 32, i, '{"transforms":[]}', "b1")


def _directory_bytes(root: pathlib.Path) -> int:
    """Bytes of every file under root/entries (entries and files being written)."""
    total = 0
    for folder, _, files in os.walk(root / "entries"):
        for name in files:
            try:
                total += os.stat(os.path.join(folder, name)).st_size
            except FileNotFoundError:  # renamed or removed meanwhile
                pass
    return total


@pytest.fixture
def make_cache():
    made = []

    def make(**kw):
        c = SharedCache.create(f"batchd-test-{secrets.token_hex(4)}-cache", datasets=["photos"], workers=PROCESSES,
                               build="b1", **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()


_barrier = None  # in each pool process


def _set_barrier(barrier) -> None:
    global _barrier
    _barrier = barrier


@pytest.fixture(scope="module")
def pool():
    """PROCESSES forkserver processes (as the server starts its workers), sharing one barrier."""
    ctx = multiprocessing.get_context("forkserver")
    with ctx.Pool(PROCESSES, initializer=_set_barrier, initargs=(ctx.Barrier(PROCESSES, timeout=60),)) as p:
        yield p


def _miss_together(name: str, worker_id: int, keys: int, side: int) -> None:
    """Miss each key at the same moment as the other processes (compute waits at the barrier;
    so each of the pool's processes runs one of these)."""
    cache = SharedCache.attach(name, worker_id)

    def compute(i):
        _barrier.wait()
        return _image(i, side)

    for i in range(keys):
        cache.get_or_compute("photos", _key(i), lambda i=i: compute(i))
    cache.close()


def test_processes_missing_the_same_key_store_and_count_it_once(make_cache, tmp_path, pool):
    """4 processes miss 6 keys together; entries (48 KiB) are larger than the RAM arena, so all go
    to disk. Each is written once and counted once (before: reserved 4 times, 4x disk_used)."""
    cache = make_cache(memory_bytes=64 * 1024, disk_dir=tmp_path, disk_bytes=1 << 20)
    keys, side = 6, 128
    pool.starmap(_miss_together, [(cache._seg.name, w, keys, side) for w in range(PROCESSES)], chunksize=1)
    files = sorted(tmp_path.glob("entries/*/*/*"))
    assert len(files) == keys and not [f for f in files if ".tmp-" in f.name]
    on_disk = sum(f.stat().st_size for f in files)
    s = cache.stats()["photos"]
    assert cache.bytes_used()[1] == on_disk == s["bytes_disk"], (cache.bytes_used(), on_disk, s)
    assert s["misses"] == PROCESSES * keys and s["not_admitted"] == 0
    for i in range(keys):
        assert np.array_equal(cache.get_or_compute("photos", _key(i), pytest.fail), _image(i, side))


def _fill(name: str, worker_id: int, first: int, count: int, side: int) -> None:
    cache = SharedCache.attach(name, worker_id)
    for i in range(first, first + count):
        cache.get_or_compute("photos", _key(i), lambda i=i: _image(i, side))
    cache.close()


def test_the_cache_never_exceeds_memory_bytes_or_disk_bytes(make_cache, tmp_path, pool):
    """4 processes fill 70 keys (12 KiB entries, overlapping ranges) into 160 KiB of RAM and 256 KiB
    of disk, 3.5x their capacity. While they write, a thread measures the entry files; after, the
    segment. Both stay within their bounds, and both are full (an entry short at most)."""
    memory, disk_bytes, side = 160 * 1024, 256 * 1024, 64
    cache = make_cache(memory_bytes=memory, disk_dir=tmp_path, disk_bytes=disk_bytes)
    entry = 48 + side * side * 3
    peak, done = [0], threading.Event()

    def watch():
        while not done.is_set():
            peak[0] = max(peak[0], _directory_bytes(tmp_path))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        pool.starmap(_fill, [(cache._seg.name, w, 10 * w, 40, side) for w in range(PROCESSES)], chunksize=1)
    finally:
        done.set()
        watcher.join()
    ram, on_disk = cache.bytes_used()
    arena = len(cache._arena)
    assert os.path.getsize(SHM_DIR / cache._seg.name) == memory  # the segment: exactly memory_bytes
    assert arena - entry < ram <= arena < memory
    assert max(peak[0], _directory_bytes(tmp_path)) <= disk_bytes, peak
    assert disk_bytes - entry < on_disk == _directory_bytes(tmp_path) <= disk_bytes
    s = cache.stats()["photos"]
    assert (s["bytes_ram"], s["bytes_disk"]) == (ram, on_disk)
    stored = (ram // entry) + (on_disk // entry)
    assert s["not_admitted"] >= 70 - stored  # the rest was computed, not stored
    for i in range(70):  # what is stored is right
        assert np.array_equal(cache.get_or_compute("photos", _key(i), lambda i=i: _image(i, side)), _image(i, side))
