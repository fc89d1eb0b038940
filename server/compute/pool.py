"""The persistent worker pool and its scheduler.

One thread (``_loop``) owns every worker pipe. It waits, on one selector kept for its lifetime
(epoll on Linux: no selector built per wait), on the pipes, the worker processes' sentinels and a
wake-up pipe, and in each round:

1. collects finished batches and hands them to their stream's reorder buffer;
2. notices dead workers (within ``_POLL_S``), logs the exit code or signal, rebuilds their
   in-flight batches on other workers and starts a replacement;
3. fails batches that took longer than ``worker_timeout_s`` running (their worker is killed; its
   slots stay held until the process is reaped, since it may still be writing them; then it is
   replaced);
4. dispatches new tasks: streams are served round robin, each stream at most ``prefetch``
   batches in flight or buffered; a worker is sent its next tasks before the current one
   finishes (at least one waiting, more while fewer than ``read_ahead`` samples wait, see
   ``handles.WorkerHandle.wants_task``), so its reader reads their samples ahead; nothing once
   ``stop_dispatch`` was called (the server is shutting down);
5. with an ``Autoscaler`` (config ``workers: {min, max}``), starts a worker while clients wait for
   data, or retires one after a cool-down (``server/compute/autoscale.py``): a retiring worker
   gets no new task, is told to stop once its tasks are done, and is reaped when it has exited.

Each finished batch's timings (``server/compute/stages.py``) gain ``queued`` (from sending its
task until the worker began it) and ``worker``; the workers' stages of the moment are on a
``StageBoard`` in shared memory.

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
import fcntl
import logging
import multiprocessing as mp
import os
import selectors
import struct
import termios
import threading
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Callable

import numpy as np

from batchd.errors import SampleError, WorkerError
from batchd.server.compute.autoscale import Autoscaler, Demand
from batchd.server.compute.handles import InFlight, WorkerHandle, describe_exit, reraisable
from batchd.server.compute.protocol import BatchDone, Ready, Shutdown, Task, TaskFailed
from batchd.server.compute.sizing import PoolSizing
from batchd.server.compute.stages import StageBoard, work_seconds
from batchd.server.compute.work import ReadyBatch, Work
from batchd.server.compute.worker import worker_main
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT
from batchd.server.shm import SlotPool

log = logging.getLogger(__name__)

_POLL_S = 0.5
_JOIN_S = 5.0
_EXPIRE_EVERY_S = 0.1  # how often running tasks are checked against worker_timeout_s

# why another thread wakes the scheduler (``WorkerPool.wake``); bits
WAKE_STREAM = 1  # a stream took a batch, or a computation's readers changed: one may want work
WAKE_SLOT = 2  # a shared-memory slot was freed
_ALWAYS = 4  # a reason every round waits for
WAKE_ANY = WAKE_STREAM | WAKE_SLOT | _ALWAYS  # anything else: always wakes the loop

# what the loop's selector watches (the data of each registration)
_WAKE, _PIPE, _SENTINEL = range(3)


@dataclass(slots=True)
class SchedulerCounts:
    """What the scheduler did since the pool started (``PoolStats.scheduler_*``): written by its
    thread (``wakeups`` by the waking threads, under the pool's wake lock), read by stats from any.

    rounds: rounds run (after an event, a timeout, or at once when a wake reason that mattered came
    in during the previous round). waits: times the loop blocked on its selector (a round run at
    once polls it without waiting). timeouts: waits that ended with nothing ready (an idle pool:
    about 1 / ``_POLL_S`` per second). wakeups: wake-ups written to the wake pipe by other threads
    (a wake that cannot end the loop's wait is only noted). passes: dispatch passes (a round whose
    events cannot have let a task be sent skips it). dispatches: tasks sent to workers. late: tasks
    sent in a round that began on a timeout: something changed that no event or wake signalled (a
    lost wake-up costs up to ``_POLL_S``); 0 in steady state (tests; not exported).
    """

    rounds: int = 0
    waits: int = 0
    timeouts: int = 0
    wakeups: int = 0
    passes: int = 0
    dispatches: int = 0
    late: int = 0


def _available(fd: int) -> int:
    """Bytes waiting to be read on pipe or socket ``fd`` (FIONREAD), without a selector."""
    return _INT.unpack(fcntl.ioctl(fd, termios.FIONREAD, _ZERO))[0]


_INT = struct.Struct("i")
_ZERO = _INT.pack(0)


class WorkerPool(PoolSizing):
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

    # --- workers -----------------------------------------------------------------------------

    def _start_worker(self, worker_id: int) -> WorkerHandle:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=worker_main,
            args=(worker_id, child_conn, self._dataset_configs, self._cache_dir, self.slots.prefix, os.getpid(),
                  self.reads_in_flight, *self._python),
            name=f"batchd-worker-{worker_id}",
            daemon=True,
        )
        process.start()
        child_conn.close()
        w = WorkerHandle(worker_id, process, parent_conn)
        self._selector.register(parent_conn.fileno(), selectors.EVENT_READ, (_PIPE, w))
        self._selector.register(process.sentinel, selectors.EVENT_READ, (_SENTINEL, w))
        return w

    def _unwatch(self, w: WorkerHandle, *, pipe: bool = True, sentinel: bool = True) -> None:
        """Stop waiting on ``w``'s pipe and/or sentinel (before they are closed, or once its pipe hit
        EOF: a readable EOF would end every wait). Idempotent."""
        for fd, wanted in ((w.fd, pipe), (w.process.sentinel, sentinel)):
            if not wanted:
                continue
            key = self._selector.get_map().get(fd)
            if key is not None and key.data[1] is w:
                self._selector.unregister(fd)

    def _await_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pending = {w.conn: w for w in self._workers.values()}
        while pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self.close(1.0)
                raise RuntimeError(f"{len(pending)} of {self.num_workers} workers did not start within {timeout:.0f} s")
            for conn in wait(list(pending) + [w.process.sentinel for w in pending.values()], remaining):
                if isinstance(conn, Connection):
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        continue  # it died while starting: its sentinel says how
                    if isinstance(msg, Ready):
                        pending.pop(conn).became_ready()
                else:
                    dead = next((w for w in pending.values() if w.process.sentinel == conn), None)
                    if dead is None:  # it had already said Ready
                        dead = next(w for w in self._workers.values() if w.process.sentinel == conn)
                    self.close(1.0)
                    raise RuntimeError(f"worker {dead.worker_id} {describe_exit(dead.process.exitcode)} while starting")
        log.info("%d workers ready (pids %s)", self.num_workers, self.worker_pids)

    def _on_death(self, w: WorkerHandle) -> None:
        """Its sentinel fired: reap it, then free its slots, rebuild its tasks, start a replacement."""
        self._plain = False
        self._receive(w, readable=False)  # batches it finished before dying still count
        w.process.join(_JOIN_S)  # reap first: only then can no write of it reach a slot
        if w.process.exitcode is None:  # not reaped (cannot happen once the sentinel fired): keep its slots
            log.error("worker %d (pid %d) could not be reaped; its %d slots stay held", w.worker_id, w.process.pid,
                      len(w.held_slots) + len(w.tasks))
            w.held_slots.clear()
            w.held_slots.extend(self._in_flight[t].slot for t in w.tasks)
        for slot in w.held_slots:  # slots of tasks it timed out on
            self.slots.release(slot)
        w.held_slots.clear()
        log.warning(
            "worker %d (pid %d) %s with %d batches in flight; rebuilding them and starting a replacement",
            w.worker_id, w.process.pid, describe_exit(w.process.exitcode), len(w.tasks),
        )
        cause = describe_exit(w.process.exitcode)
        for task_id in sorted(w.tasks):
            job = self._in_flight.pop(task_id)
            self.slots.release(job.slot)
            tries = job.stream.retry(job.batch_index)
            if tries > self.max_task_retries:
                ds, idx = job.stream.request.dataset, job.stream.batch_indices(job.batch_index)
                job.stream.fail(
                    WorkerError(
                        f"batch {job.batch_index} of dataset {ds!r} (samples {idx.tolist()}) killed its worker "
                        f"{tries} times (last: worker {cause}); giving up. A sample in it may crash the decoder."
                    ),
                    job.batch_index,
                )
            elif not job.stream.closed:  # queued again (retry), for the next free worker
                self.batches_rebuilt += 1
        self._unwatch(w)
        w.conn.close()
        self._forget_worker(w)
        if w.retiring:  # it was stopping anyway: the pool shrinks now
            del self._workers[w.worker_id]
            return
        self.restarts += 1
        self._workers[w.worker_id] = self._start_worker(w.worker_id)

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        again = False
        counts = self.counts
        while not self._closing:
            try:
                events = self._selector.select(0 if again else _POLL_S)
            except OSError:
                continue
            if not again:
                counts.waits += 1
                counts.timeouts += not events
            try:
                again = self._round(events, timed_out=not events and not again)
            except Exception as e:  # a scheduler bug or an OS error must not leave streams hanging
                again = False
                log.exception("scheduler round failed; failing the open streams")
                with self._lock:
                    streams = list(self._streams)
                for stream in streams:
                    stream.fail(WorkerError(f"the server's scheduler failed: {type(e).__name__}: {e}"))
        if self._closing:
            self._selector.close()

    def _round(self, events, timed_out: bool = False) -> bool:
        """Handle the events, then dispatch. True if a wake reason that matters for what the dispatch
        ended on came in meanwhile (run another round now)."""
        self.counts.rounds += 1
        sent = self.counts.dispatches
        woken = any(key.data[0] == _WAKE for key, _ in events)
        with self._wake_lock:
            changed = self._changed  # the reasons noted since the last round ended
            self._waiting_for = 0  # wakes during the round are noted (_changed) and checked at its end
            self._changed = 0
            if woken:
                self._wake_pending = False
        if woken:
            os.read(self._wake_r, 4096)
        self._plain = not timed_out
        dead = []
        for key, _ in events:
            kind, w = key.data
            if kind == _PIPE:
                self._receive(w)
            elif kind == _SENTINEL:
                dead.append(w)
        for w in dead:
            if not self._closing:
                self._on_death(w)
        now = time.monotonic()
        if now >= self._next_expire:
            self._next_expire = now + _EXPIRE_EVERY_S
            self._expire(now)
        if self._plain and self._blocked in (WAKE_STREAM, WAKE_SLOT):
            with self._wake_lock:
                changed |= self._changed
            skip = not changed & (self._blocked | _ALWAYS)  # still no stream that wants work, or no slot
        else:
            skip = False
        waits_for = self._blocked if skip else self._dispatch()
        self._blocked = waits_for
        if timed_out and self.counts.dispatches > sent:
            self.counts.late += self.counts.dispatches - sent
        if self._retired or any(w.retiring for w in self._workers.values()):
            self._retire_idle()
        self._autoscale()
        with self._wake_lock:
            self._waiting_for = waits_for | _ALWAYS
            return bool(self._changed & self._waiting_for)

    def _receive(self, w: WorkerHandle, readable: bool = True) -> None:
        """Handle every message in ``w``'s pipe: one at least if ``readable`` (the selector said so;
        EOF included), then as long as bytes are waiting. EOF: the worker died (its sentinel reports
        it); its pipe is no longer watched."""
        try:
            while readable or _available(w.fd):
                readable = False
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            self._unwatch(w, sentinel=False)

    def _handle(self, w: WorkerHandle, msg) -> None:
        if not isinstance(msg, BatchDone):  # a built batch frees a worker, never a stream's place or a slot
            self._plain = False
        if isinstance(msg, Ready):
            w.became_ready()
            return
        job = self._in_flight.pop(msg.task_id, None)
        w.tasks.discard(msg.task_id)
        w.last_done = time.monotonic()  # its next task starts running now
        w.busy.set(bool(w.tasks), now=w.last_done)
        if job is None:
            return
        if isinstance(msg, BatchDone):
            self.batches_built += 1
            if job.stream.request.hedge:
                self.hedge_batches_built += 1
            work = work_seconds(msg.timings)
            self.work_seconds += work
            started = msg.timings.get("started", 0.0)
            timings = {**msg.timings, "queued": max(0.0, started - job.started) if started else 0.0,
                       "worker": msg.worker_id}
            slot = self.slots.adopt(job.slot, msg.slot_name) if msg.grown else job.slot
            job.stream.slot_hint = max(t.offset + t.nbytes for t in msg.tensors)  # (no numpy call)
            job.stream.done(ReadyBatch(job.batch_index, slot, msg.tensors, timings, tuple(i for i, _, _ in msg.skipped),
                                       ready_at=time.monotonic()))
            if msg.skipped:
                self._count_skipped(job, msg.skipped)
        elif isinstance(msg, TaskFailed):
            self.slots.release(job.slot)
            job.stream.fail(reraisable(msg), job.batch_index)

    def _count_skipped(self, job: InFlight, skipped) -> None:
        stream, req = job.stream, job.stream.request
        for index, path, reason in skipped:
            log.warning("computation %d: skipped dataset %r sample %d (%s): %s", stream.id, req.dataset, index, path, reason)
        stream.samples_skipped += len(skipped)
        allowed = self._max_skipped_fraction.get(req.dataset, 0.0) * len(stream.indices)
        if stream.samples_skipped > allowed:
            index, path, reason = skipped[-1]
            stream.fail(SampleError(
                req.dataset, index, path,
                f"{reason}; too many bad samples: {stream.samples_skipped} of {len(stream.indices)} in this epoch "
                f"skipped, more than max_skipped_fraction={allowed / max(1, len(stream.indices)):g}",
            ), job.batch_index + 1)

    def _expire(self, now: float) -> None:
        """Fail each running task that has run over ``worker_timeout_s`` and kill its worker. The
        worker gets no new task, and its slots stay held until ``_on_death`` has reaped it (a
        process that is killed may still be writing them for a moment)."""
        for w in self._workers.values():
            running = w.running(self._in_flight)
            if w.killed or running is None or now - running[1] <= self.worker_timeout_s:
                continue
            task_id = running[0]
            job = self._in_flight.pop(task_id)
            log.error("worker %d took over %.0f s on batch %d; killing it", w.worker_id, self.worker_timeout_s, job.batch_index)
            w.process.kill()
            w.killed = True
            w.tasks.discard(task_id)
            w.busy.set(bool(w.tasks))
            w.held_slots.append(job.slot)
            job.stream.fail(
                WorkerError(
                    f"batch {job.batch_index} of dataset {job.stream.request.dataset!r} took longer than "
                    f"worker_timeout_s={self.worker_timeout_s:g} s"
                ),
                job.batch_index,
            )

    def _dispatch(self) -> int:
        """Send tasks while a worker, a stream and a slot are there for one. Returns the wake
        reasons that can let it send the next: 0 (no worker wants a task: only the loop's own
        events change that), ``WAKE_STREAM`` or ``WAKE_SLOT``."""
        with self._dispatch_lock:
            if self._dispatch_stopped:
                return 0
            self.counts.passes += 1
            return self._dispatch_locked()

    def _dispatch_locked(self) -> int:
        with self._lock:  # least recently served first
            streams = [s for s in self._streams if not s.closed]
        while True:
            # the worker with the fewest tasks queued, among those that want one
            free = [w for w in self._workers.values() if w.wants_task(self._in_flight, self.read_ahead)]
            if not free:
                return 0
            w = min(free, key=lambda w: len(w.tasks))
            # round robin: the least recently served computation that wants work gets the worker
            stream = next((s for s in streams if s.wants_work()), None)
            if stream is None:
                return WAKE_STREAM
            slot = self.slots.acquire(stream.slot_hint)
            if slot is None and sum(c.evict_history() for c in streams):
                slot = self.slots.acquire(stream.slot_hint)  # batches kept for late joiners made room
            if slot is None:
                return WAKE_SLOT  # every slot is held; a release wakes us
            b = stream.take_task()
            if b is None:  # closed or revoked since wants_work (checked again under its lock)
                self.slots.release(slot)
                continue
            req = stream.request
            task = Task(
                task_id=next(self._task_ids),
                dataset=req.dataset,
                pipeline_key=req.pipeline_key,
                pipeline_json=req.pipeline_json,
                indices=stream.batch_indices(b),
                random_key=self._random_key(stream),
                positions=stream.batch_positions(b),
                slot_name=slot.name,
                slot_capacity=slot.capacity,
                skip_bad_samples=self._skip.get(req.dataset, False),
                max_batch_bytes=self.max_batch_bytes,
                encoding=req.image_encoding,
            )
            self._in_flight[task.task_id] = InFlight(stream, b, slot, w.worker_id, time.monotonic(), len(task.indices))
            w.tasks.add(task.task_id)
            w.busy.set(True)
            self.counts.dispatches += 1
            try:
                w.conn.send(task)
            except (OSError, ValueError):
                w.killed = True  # dead (wants no task); _on_death will rebuild the task
            streams.remove(stream)
            streams.append(stream)
            with self._lock:  # served: to the back of the queue
                if stream in self._streams:
                    self._streams.remove(stream)
                    self._streams.append(stream)

    def _random_key(self, computation: Work) -> np.ndarray:
        """The computation's epoch key (``Work.random_key``: a SeedSequence), derived once per
        computation rather than once per task."""
        key = self._random_keys.get(computation)
        if key is None:
            key = self._random_keys[computation] = computation.random_key()
        return key
