"""The persistent worker pool: ``num_workers`` worker processes building batches for any number
of computations, and the thread that schedules them.

``WorkerPool`` is put together from its parts, each a file: the scheduler's rounds
(``scheduler.py``: collect built batches, handle dead workers, expire tasks, dispatch), the worker
processes (``processes.py``: start, watch, await, replace), the pool's size and load
(``sizing.py``, with the policy of ``autoscale.py``), and what it knows of each worker and task
(``handles.py``). Here: its construction, what other threads call (``add_computation``,
``remove_computation``, ``wake``, ``stop_dispatch``, ``load``) and ``close``. The workers' stages
of the moment are on a ``StageBoard`` in shared memory (``stages.py``).

One round per event, not per call. Other threads wake the loop (``wake``) with a reason:
``WAKE_STREAM`` (a stream took a batch: its computation may want another), ``WAKE_SLOT`` (a slot
was freed), or ``WAKE_ANY``. Each dispatch ends on what it lacked: a worker that wants a task
(only a worker's message or death, which the loop sees on its own pipes, can change that), a
stream that wants work, or a free slot. Until the next round the loop is woken only by a reason
that can end that wait; the others are noted, not signalled, and a wake-up already pending absorbs
the next. A reason that came while the round ran and matches what it ended on runs another round
at once. A round that only received built batches, after a dispatch that ended on a stream or a
slot with no wake for it since, skips the dispatch (a built batch frees a worker, not that). So in
steady state a batch costs the round of its worker's answer and at most one more (its stream
taking it, or its slot coming back, when that was what the dispatch waited for): ``counts``
(``SchedulerCounts``: rounds, selector waits and timeouts, wake-ups written, dispatch passes,
tasks sent) shows it per batch, in Stats and on /metrics.

Worker liveness comes from the same sentinels: a death is handled in the round its sentinel fires,
before that round dispatches, so no process is polled per task. Task expiry is checked at most
every ``_EXPIRE_EVERY_S``, sizing only where a worker is retiring or stopped.

Workers are started from a ``forkserver`` context, created before any gRPC server exists, so no
process is ever forked from a process running gRPC threads (grpc doc/fork_support.md).
"""

from __future__ import annotations

import collections
import multiprocessing as mp
import os
import selectors
import threading
import time
import weakref
from typing import Callable

import numpy as np

from batchd.server.compute.autoscale import Autoscaler, Demand
from batchd.server.compute.handles import InFlight, WorkerHandle
from batchd.server.compute.processes import _JOIN_S, PoolProcesses
from batchd.server.compute.protocol import Shutdown
from batchd.server.compute.scheduler import _WAKE, WAKE_ANY, WAKE_SLOT, WAKE_STREAM, Scheduler, SchedulerCounts
from batchd.server.compute.sizing import PoolSizing
from batchd.server.compute.stages import StageBoard
from batchd.server.compute.work import Work
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT
from batchd.server.shm import SlotPool

__all__ = ["WAKE_ANY", "WAKE_SLOT", "WAKE_STREAM", "SchedulerCounts", "WorkerPool"]


class WorkerPool(PoolSizing, PoolProcesses, Scheduler):
    """``num_workers`` worker processes building batches for any number of streams.

    dataset_configs: name -> dataset config, opened by each worker. reads_in_flight: sample reads
    each worker keeps running on its I/O threads (``server/data/reader.py``); the scheduler keeps about
    ``4 * reads_in_flight`` samples queued behind each worker's running task. autoscaler: sizes
    the pool between ``autoscaler.min_workers`` (= ``num_workers``, started now) and
    ``autoscaler.limit``, by ``demand()`` (the clients' wait, ``Loader.demand``); None: a fixed
    pool. python_path, python_pipelines: the config's ``python_path`` and python presets, for
    every worker (``worker_main``). Raises RuntimeError if the workers do not all start within
    ``start_timeout`` seconds.
    """

    def __init__(
        self,
        num_workers: int,
        dataset_configs: dict,
        cache_dir,
        slots: SlotPool,
        *,
        worker_timeout_s: float = 300.0,
        max_task_retries: int = 3,
        start_timeout: float = 60.0,
        max_batch_bytes: int = 0,
        reads_in_flight: int = DEFAULT_READS_IN_FLIGHT,
        autoscaler: Autoscaler | None = None,
        demand: Callable[[], Demand] = Demand,
        python_path: tuple = (),
        python_pipelines: dict | None = None,
    ):
        self.max_batch_bytes = max_batch_bytes
        self._python = (tuple(str(p) for p in python_path), dict(python_pipelines or {}))  # for worker_main
        self.reads_in_flight = reads_in_flight
        self.read_ahead = 4 * reads_in_flight  # samples queued behind a worker's running task
        self.min_workers = num_workers
        self.autoscaler = autoscaler
        self.max_workers = max(num_workers, autoscaler.limit if autoscaler is not None else num_workers)
        self._demand = demand
        self.scaling: collections.Counter[tuple[str, str]] = collections.Counter()  # (direction, reason) -> times
        self._scaled_at = 0.0
        self._retired: list[WorkerHandle] = []  # told to stop (pool shrinking), not reaped yet
        self._gone = [0.0, 0.0]  # busy and alive seconds of workers no longer in _workers
        self.slots = slots
        self.worker_timeout_s = worker_timeout_s
        self.max_task_retries = max_task_retries
        self._dataset_configs = dataset_configs
        self._skip = {name: getattr(c, "on_error", "raise") == "skip" for name, c in dataset_configs.items()}
        self._max_skipped_fraction = {name: getattr(c, "max_skipped_fraction", 0.0) for name, c in dataset_configs.items()}
        self._cache_dir = cache_dir
        self._ctx = mp.get_context("forkserver")
        self._ctx.set_forkserver_preload(["numpy", "cv2", "batchd.server.compute.worker"])  # albumentations through batchd.server: no torch
        self._lock = threading.Lock()  # guards _streams
        self._streams: collections.deque[Work] = collections.deque()
        self._in_flight: dict[int, InFlight] = {}
        self._task_ids = iter(range(1, 1 << 62))
        self._random_keys: weakref.WeakKeyDictionary[Work, np.ndarray] = weakref.WeakKeyDictionary()
        # the wake-up pipe, and the selector the loop waits on (epoll on Linux): one for its lifetime
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._wake_r, selectors.EVENT_READ, (_WAKE, None))
        self._wake_lock = threading.Lock()  # guards the three below, and counts.wakeups
        self._waiting_for = WAKE_ANY  # the wake reasons that can end the loop's wait now
        self._changed = 0  # wake reasons seen since the current round began
        self._wake_pending = False  # a byte is in the wake pipe, not read yet
        self._blocked = WAKE_ANY  # what the last dispatch pass ended on (WAKE_ANY: none yet)
        self._plain = False  # this round's events so far cannot have let a task be sent (built batches only)
        self.counts = SchedulerCounts()
        self._next_expire = 0.0
        self._closing = False
        self._dispatch_lock = threading.Lock()  # held by the scheduler through each _dispatch
        self._dispatch_stopped = False  # stop_dispatch(): no task is sent any more
        self.restarts = 0
        self.batches_rebuilt = 0  # batches in flight on a worker that died, queued again for another
        self.batches_built = 0  # batches workers finished (a batch shared by several streams counts once)
        self.hedge_batches_built = 0  # ... of them for hedged requests (StreamBatchesRequest.hedge)
        self.work_seconds = 0.0  # seconds workers spent building batches (their own timings)
        self._workers: dict[int, WorkerHandle] = {}
        self._thread: threading.Thread | None = None  # started once every worker is ready
        self.board = StageBoard.create(slots.prefix, self.max_workers)  # each worker's stage now (batchd top)
        for worker_id in range(num_workers):
            self._workers[worker_id] = self._start_worker(worker_id)
        self._await_ready(start_timeout)
        self._thread = threading.Thread(target=self._loop, name="batchd-pool", daemon=True)
        self._thread.start()

    # --- public ------------------------------------------------------------------------------

    def add_computation(self, stream: Work) -> None:
        with self._lock:
            self._streams.append(stream)
        self.wake(WAKE_STREAM)

    def remove_computation(self, stream: Work) -> None:
        stream.close()
        with self._lock:
            try:
                self._streams.remove(stream)
            except ValueError:
                pass
        self.wake()

    def stop_dispatch(self) -> None:
        """Send no task from now on (shutting down). Returns once a dispatch under way has ended:
        afterwards no slot is handed to a worker, so a slot freed later is never written again.
        Tasks already sent run on (into slots that were free when they were sent). Idempotent."""
        with self._dispatch_lock:
            self._dispatch_stopped = True

    def wake(self, reason: int = WAKE_ANY) -> None:
        """Tell the scheduler something changed (from any thread): ``WAKE_STREAM``, ``WAKE_SLOT`` or
        ``WAKE_ANY`` (the default, for anything else). The loop is woken only if the reason can end
        what its last dispatch waited for and no wake-up is pending; otherwise the reason is noted
        for the round under way (which runs again at once if it matters) or dropped as irrelevant."""
        if self._closing:
            return
        with self._wake_lock:
            self._changed |= reason
            if self._wake_pending or not reason & self._waiting_for:
                return
            self._wake_pending = True
            self.counts.wakeups += 1
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):  # full: a wake-up is already pending; closed: shutting down
            pass

    @property
    def num_workers(self) -> int:
        """Worker processes running now (retiring ones included until they have stopped)."""
        return len(self._workers)

    def load(self) -> dict[str, int]:
        """For stats, from any thread: workers ready, workers with a batch assigned, batches out.

        Never polls the processes (``is_alive`` here would race the scheduler's own reaping).
        """
        workers = list(self._workers.values())
        return {
            "ready": sum(1 for w in workers if w.ready),
            "busy": sum(1 for w in workers if w.tasks),
            "tasks_in_flight": len(self._in_flight),
        }

    @property
    def worker_pids(self) -> list[int]:
        return [w.process.pid for w in self._workers.values()]

    def close(self, timeout: float = _JOIN_S) -> None:
        """Stop the scheduler, then Shutdown -> join -> terminate -> kill every worker."""
        if self._closing:
            return
        self._closing = True
        try:  # wake the loop now (wake() is a no-op once closing), or it notices only after _POLL_S
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass
        if self._thread is not None:
            self._thread.join(timeout)
        every = [*self._workers.values(), *self._retired]
        for w in every:
            try:
                w.conn.send(Shutdown())
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + timeout
        for w in every:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in every:
            if w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
            if w.process.is_alive():
                w.process.kill()
                w.process.join(1.0)
            w.conn.close()
        if self._thread is None or not self._thread.is_alive():
            self._selector.close()
        os.close(self._wake_r)
        os.close(self._wake_w)
        self.board.close()
