"""A worker's concurrent fetcher: samples' bytes read on I/O threads ahead of decoding.

Storage latency (an NFS or FUSE ``open``, an object store's first byte) is waiting, not work, so
a worker overlaps it: ``SampleReader`` keeps up to ``reads_in_flight`` reads running on a pool of
I/O threads (``Dataset.read_bytes``, which must be thread-safe), for the samples of the task the
worker is running and of the tasks the scheduler queued next for it, while the worker's own
thread decodes and transforms one sample at a time (``Dataset.decode``; one decoder per core).

Reads start in the order the samples will be decoded (task by task, sample by sample), at most
``read_ahead`` samples beyond the next one to decode, so memory holds at most ``read_ahead``
encoded files per worker. Fewer when reads are fast: the reader keeps about
``4 * read latency / work per sample + 2`` reads outstanding (moving averages; all of
``read_ahead`` until a read has been timed), which hides the latency with room for its tail
(measured: 32 threads contending for the GIL cost about 60-150 us of CPU per file, against 25 us
for reading it).

No read runs ahead when reads cost almost nothing beside the work: while the read latency stays
under ``INLINE_BELOW`` (10 %) of the work per sample, or under ``INLINE_FLOOR_S`` (50 us) whatever
the work, the worker's own thread reads each sample as it takes it and no I/O thread runs; the
threads take over again once the latency passes ``THREADS_ABOVE`` (20 %) of the work and 100 us
(the reads the worker makes itself keep the latency measured, so a storage that slows down is
seen within a few samples). A page-cached local file takes about 25 us to read against about
0.9 ms of decode and L3 per photo, while handing each read to a thread and back cost the worker
0.05-0.1 ms of CPU per sample (futex wake-ups and the GIL): reading inline took a worker's CPU
per photo from 0.81 to 0.76 ms, and from 0.90 to 0.79 ms in a busier hour (photos, L3, 2
workers; ``python -m bench.probes.worker_cpu`` on the commit before this policy and on it).

Only the worker's thread calls a ``SampleReader``; the I/O threads only run ``read_bytes``. An
error reading a sample (``SampleError`` naming dataset, index and path) is raised by ``take`` for
that sample, where the worker handles it as it would a sequential read (``on_error``: skip or fail
the batch).
"""

from __future__ import annotations

import collections
import math
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

DEFAULT_READS_IN_FLIGHT = 32
_WAIT_S = 0.02  # while waiting for a read, call ``while_waiting`` this often (seconds)
_EWMA = 0.1  # weight of the newest observation in the moving averages
INLINE_BELOW = 0.1  # read on the worker's thread while read latency < this x work per sample
THREADS_ABOVE = 0.2  # ... and on the I/O threads again once it is > this x work per sample
INLINE_FLOOR_S = 50e-6  # or while it is under this (seconds), whatever the work: a thread costs more


class _Reads:
    """One task's samples: ``read(index) -> bytes`` for each of ``indices``; ``futures[k]`` is
    sample k's read once started, None before it starts and after it is taken."""

    __slots__ = ("read", "indices", "futures", "started", "unwanted", "io_seconds")

    def __init__(self, read: Callable[[int], bytes], indices: Sequence[int]):
        self.read = read
        self.indices = list(indices)
        self.futures: list[Future | None] = [None] * len(self.indices)
        self.started = 0  # samples [0, started) have had their read started (or were taken)
        self.unwanted: set[int] = set()  # samples not started whose bytes are not needed (forget)
        self.io_seconds = 0.0  # read time of its samples, summed over the threads that read them


class SampleReader:
    """Reads queued tasks' samples on ``reads_in_flight`` I/O threads, ahead of ``take``.

    reads_in_flight: I/O threads, hence reads at once (>= 1). read_ahead: samples read (running
    or done) but not yet taken, at most (default ``4 * reads_in_flight``; >= reads_in_flight).
    Threads start on first use, so a worker serving only in-memory datasets starts none.
    clock: seconds, monotonic (tests pass their own). Raises ValueError for a bad setting.
    """

    def __init__(self, reads_in_flight: int = DEFAULT_READS_IN_FLIGHT, read_ahead: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        if int(reads_in_flight) < 1:
            raise ValueError(f"reads_in_flight must be >= 1, got {reads_in_flight}")
        self.reads_in_flight = int(reads_in_flight)
        self.read_ahead = int(read_ahead) if read_ahead is not None else 4 * self.reads_in_flight
        if self.read_ahead < self.reads_in_flight:
            raise ValueError(f"read_ahead ({self.read_ahead}) must be >= reads_in_flight ({self.reads_in_flight})")
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: collections.OrderedDict[int, _Reads] = collections.OrderedDict()  # in decode order
        self._outstanding = 0  # reads started and not taken
        self._clock = clock
        self._latency_s: float | None = None  # moving average of one read's wall time (I/O threads write it)
        self._work_s: float | None = None  # moving average of the worker's time between two takes (not waiting)
        self._last_taken: float | None = None  # when the last take returned
        self._inline = False  # reads are made by the worker's thread in take (none started ahead)

    @property
    def inline(self) -> bool:
        """True while the worker's thread reads each sample itself as it takes it (reads are fast
        beside the work: see the module docstring); False while I/O threads read ahead."""
        return self._inline

    @property
    def target(self) -> int:
        """Reads to keep outstanding now: enough to hide the measured latency behind decoding,
        between 2 and ``read_ahead``. The work per sample is the worker's time from one take's
        return to the next take, so time spent waiting for a late read never counts as work
        (it would shrink the target just when reads fall behind)."""
        lat, work = self._latency_s, self._work_s
        if lat is None or work is None or work <= 0:
            return self.read_ahead
        return max(2, min(self.read_ahead, math.ceil(4 * lat / work) + 2))

    def _timed_read(self, reads: _Reads, index: int) -> bytes:
        t0 = self._clock()
        try:
            return reads.read(index)
        finally:
            dt = self._clock() - t0
            lat = self._latency_s  # a race between I/O threads only loses an observation
            self._latency_s = dt if lat is None else lat + _EWMA * (dt - lat)
            self._add_io(reads, dt)

    def _choose_inline(self) -> None:
        """Read inline or on the threads, from the moving averages (hysteresis between the two)."""
        lat, work = self._latency_s, self._work_s
        if lat is not None and work is not None:
            if self._inline:
                self._inline = lat <= max(THREADS_ABOVE * work, 2 * INLINE_FLOOR_S)
            else:
                self._inline = lat < max(INLINE_BELOW * work, INLINE_FLOOR_S)

    @staticmethod
    def _add_io(reads: _Reads, seconds: float) -> None:
        reads.io_seconds += seconds  # (a race between I/O threads only loses an observation, as above)

    def io_seconds(self, task_id: int) -> float:
        """Seconds the reads of a task's samples took, summed over the threads that ran them (they
        overlap each other and the decoding); 0 for a task not added or discarded."""
        reads = self._tasks.get(task_id)
        return 0.0 if reads is None else reads.io_seconds

    def add(self, task_id: int, read: Callable[[int], bytes], indices: Sequence[int]) -> None:
        """Queue the reads of a task's samples (``read(index)`` for each of ``indices``, in order),
        after those of the tasks added before it. Adding a task again does nothing."""
        if task_id not in self._tasks:
            self._tasks[task_id] = _Reads(read, indices)
            self._fill()

    def __contains__(self, task_id: int) -> bool:
        return task_id in self._tasks

    def take(self, task_id: int, k: int, while_waiting: Callable[[], None] | None = None) -> bytes:
        """Sample ``k`` of task ``task_id``: its bytes, waiting for its read if it is running
        (started now, on this thread, if it had not started). While it waits, ``while_waiting()``
        is called every 20 ms (the worker takes newly sent tasks, whose reads then start).
        Raises what the read raised (e.g. SampleError); KeyError for a task that was never added
        (or was discarded)."""
        reads = self._tasks[task_id]
        if self._last_taken is not None:
            work, last = self._clock() - self._last_taken, self._work_s
            self._work_s = work if last is None else last + _EWMA * (work - last)
            self._choose_inline()
        try:
            future, reads.futures[k] = reads.futures[k], None
            if future is None:
                reads.started = max(reads.started, k + 1)
                self._fill()
                return self._timed_read(reads, reads.indices[k])
            self._outstanding -= 1
            self._fill()  # keep the threads busy while this one waits or decodes
            if while_waiting is not None and not future.done():
                while not wait((future,), _WAIT_S).done:
                    while_waiting()
            return future.result()
        finally:
            self._last_taken = self._clock()

    def forget(self, task_id: int, k: int) -> None:
        """Sample ``k`` of the task will not be taken (e.g. a cache hit): drop its read (not
        started: it never starts). No-op for a sample already taken or a task not added."""
        reads = self._tasks.get(task_id)
        if reads is None:
            return
        future, reads.futures[k] = reads.futures[k], None
        if future is not None:
            future.cancel()
            self._outstanding -= 1
            self._fill()
        elif k >= reads.started:
            reads.unwanted.add(k)

    def discard(self, task_id: int) -> None:
        """Forget a task's reads (it finished or failed): reads not started never start, results
        not taken are dropped (a read already running finishes on its thread, unused)."""
        reads = self._tasks.pop(task_id, None)
        if reads is None:
            return
        for future in reads.futures:
            if future is not None:
                future.cancel()
                self._outstanding -= 1
        self._fill()

    def close(self) -> None:
        """Drop every queued read and stop the I/O threads (not waiting for running reads)."""
        for task_id in list(self._tasks):
            self.discard(task_id)
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None

    def _fill(self) -> None:
        """Start reads in decode order until ``target`` are outstanding."""
        if self._inline:
            return
        target = self.target
        if self._outstanding >= target:
            return
        for reads in self._tasks.values():
            while reads.started < len(reads.indices):
                if self._outstanding >= target:
                    return
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.reads_in_flight, thread_name_prefix="batchd-read")
                k = reads.started
                reads.started += 1
                if k in reads.unwanted:
                    continue
                reads.futures[k] = self._executor.submit(self._timed_read, reads, reads.indices[k])
                self._outstanding += 1
