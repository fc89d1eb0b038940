"""A worker's concurrent fetcher: samples' bytes read on I/O threads ahead of decoding.

Storage latency (an NFS or FUSE ``open``, an object store's first byte) is waiting, not work, so
a worker overlaps it: ``SampleReader`` keeps up to ``reads_in_flight`` reads running on a pool of
I/O threads (``Dataset.read_bytes``, which must be thread-safe), for the samples of the task the
worker is running and of the tasks the scheduler queued next for it, while the worker's own
thread decodes and transforms one sample at a time (``Dataset.decode``; one decoder per core).

Reads start in the order the samples will be decoded (task by task, sample by sample), at most
``read_ahead`` samples beyond the next one to decode, so memory holds at most ``read_ahead``
encoded files per worker. Only the worker's thread calls a ``SampleReader``; the I/O threads
only run ``read_bytes``. An error reading a sample (``SampleError`` naming dataset, index and
path) is raised by ``take`` for that sample, where the worker handles it as it would a
sequential read (``on_error``: skip or fail the batch).
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait

DEFAULT_READS_IN_FLIGHT = 32
_WAIT_S = 0.02  # while waiting for a read, call ``while_waiting`` this often (seconds)


class _Reads:
    """One task's samples: ``read(index) -> bytes`` for each of ``indices``; ``futures[k]`` is
    sample k's read once started, None before it starts and after it is taken."""

    __slots__ = ("read", "indices", "futures", "started")

    def __init__(self, read: Callable[[int], bytes], indices: Sequence[int]):
        self.read = read
        self.indices = list(indices)
        self.futures: list[Future | None] = [None] * len(self.indices)
        self.started = 0  # samples [0, started) have had their read started (or were taken)


class SampleReader:
    """Reads queued tasks' samples on ``reads_in_flight`` I/O threads, ahead of ``take``.

    reads_in_flight: I/O threads, hence reads at once (>= 1). read_ahead: samples read (running
    or done) but not yet taken, at most (default ``4 * reads_in_flight``; >= reads_in_flight).
    Threads start on first use, so a worker serving only in-memory datasets starts none.
    Raises ValueError for a bad setting.
    """

    def __init__(self, reads_in_flight: int = DEFAULT_READS_IN_FLIGHT, read_ahead: int | None = None):
        if int(reads_in_flight) < 1:
            raise ValueError(f"reads_in_flight must be >= 1, got {reads_in_flight}")
        self.reads_in_flight = int(reads_in_flight)
        self.read_ahead = int(read_ahead) if read_ahead is not None else 4 * self.reads_in_flight
        if self.read_ahead < self.reads_in_flight:
            raise ValueError(f"read_ahead ({self.read_ahead}) must be >= reads_in_flight ({self.reads_in_flight})")
        self._executor: ThreadPoolExecutor | None = None
        self._tasks: collections.OrderedDict[int, _Reads] = collections.OrderedDict()  # in decode order
        self._outstanding = 0  # reads started and not taken

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
        future, reads.futures[k] = reads.futures[k], None
        if future is None:
            reads.started = max(reads.started, k + 1)
            self._fill()
            return reads.read(reads.indices[k])
        self._outstanding -= 1
        self._fill()  # keep the threads busy while this one waits or decodes
        if while_waiting is not None:
            while not wait((future,), _WAIT_S).done:
                while_waiting()
        return future.result()

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
        """Start reads in decode order until ``read_ahead`` are outstanding."""
        if self._outstanding >= self.read_ahead:
            return
        for reads in self._tasks.values():
            while reads.started < len(reads.indices):
                if self._outstanding >= self.read_ahead:
                    return
                if self._executor is None:
                    self._executor = ThreadPoolExecutor(self.reads_in_flight, thread_name_prefix="batchd-read")
                k = reads.started
                reads.futures[k] = self._executor.submit(reads.read, reads.indices[k])
                reads.started += 1
                self._outstanding += 1
