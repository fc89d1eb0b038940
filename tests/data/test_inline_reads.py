"""A worker reads a sample on its own thread when reads are fast beside its work, and on its I/O
threads when they are not, switching either way as the storage's latency changes
(``server/data/reader.py``). A fake clock sets read latency and work per sample; each read records
the thread that made it."""

from __future__ import annotations

import contextlib
import threading

import pytest

from batchd.server.data.reader import SampleReader

pytestmark = pytest.mark.timeout(60)


class Storage:
    """``read(i) -> bytes([i % 256])``, each read moving the fake clock by ``latency`` seconds and
    recording whether it ran on the thread that created the storage (the worker's)."""

    def __init__(self, latency: float):
        self.now = 0.0
        self.latency = latency
        self.worker = threading.get_ident()
        self.on_worker: dict[int, bool] = {}
        self.lock = threading.Lock()

    def clock(self) -> float:
        return self.now

    def read(self, i: int) -> bytes:
        with self.lock:
            self.now += self.latency
            self.on_worker[i] = threading.get_ident() == self.worker
        return bytes([i % 256])


@contextlib.contextmanager
def reading(latency: float, samples: int):
    """(storage, reader): a reader of 8 I/O threads with one task of ``samples`` samples queued."""
    storage = Storage(latency)
    reader = SampleReader(reads_in_flight=8, clock=storage.clock)
    try:
        reader.add(1, storage.read, list(range(samples)))
        yield storage, reader
    finally:
        reader.close()


def run(reader: SampleReader, storage: Storage, samples: range, work: float) -> None:
    """The worker's loop: take each sample (its bytes must be right), then work ``work`` seconds."""
    for i in samples:
        assert reader.take(1, i, lambda: None) == bytes([i % 256])
        storage.now += work


def test_fast_reads_are_made_by_the_worker_and_none_ahead():
    """25 us reads against 1 ms of work per sample: after the first timed reads the reader reads
    inline, starts no read on a thread, and every sample's bytes are still the right ones."""
    with reading(25e-6, 400) as (storage, reader):
        run(reader, storage, range(200), 1e-3)
        assert reader.inline
        first_inline = min(i for i in range(200) if storage.on_worker.get(i))
        run(reader, storage, range(200, 400), 1e-3)
        late = [i for i in range(first_inline + 64, 400) if not storage.on_worker[i]]
        assert not late, f"samples read on an I/O thread while reads were fast: {late[:10]}"
        assert max(storage.on_worker) == 399, "a read ran ahead of the samples taken"


def test_slow_reads_stay_on_the_threads_ahead_of_the_worker():
    """10 ms reads against 1 ms of work: the reader never reads inline, and reads run ahead."""
    with reading(10e-3, 300) as (storage, reader):
        run(reader, storage, range(200), 1e-3)
        assert not reader.inline
        assert not any(storage.on_worker.values()), "a 10 ms read was made by the worker's thread"


def test_cheap_work_still_reads_inline_under_the_floor():
    """20 us reads against 60 us of work (a third of it): under the 50 us floor, inline."""
    with reading(20e-6, 300) as (storage, reader):
        run(reader, storage, range(300), 60e-6)
        assert reader.inline


def test_a_storage_that_slows_down_moves_reads_back_to_the_threads_and_back_again():
    """Inline at 25 us; the storage then takes 5 ms per read: within 10 samples the reader is
    back on its threads (reads run ahead again); fast again, it is inline again."""
    with reading(25e-6, 1000) as (storage, reader):
        run(reader, storage, range(200), 1e-3)
        assert reader.inline
        storage.latency = 5e-3
        for i in range(200, 210):
            run(reader, storage, range(i, i + 1), 1e-3)
            if not reader.inline:
                break
        assert not reader.inline, "5 ms reads against 1 ms of work were still made inline after 10 samples"
        run(reader, storage, range(i + 1, 400), 1e-3)
        assert not all(storage.on_worker[j] for j in range(i + 1, 400)), "no read ran on a thread again"
        assert max(storage.on_worker) > 399, "no read ran ahead of the worker again"
        storage.latency = 25e-6
        run(reader, storage, range(400, 1000), 1e-3)
        assert reader.inline, "reads fast again, but still on the threads"
