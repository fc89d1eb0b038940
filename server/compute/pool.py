"""The persistent worker pool and its scheduler.

One thread (``_loop``) owns every worker pipe. It waits on the pipes, the worker processes'
sentinels and a wake-up pipe, and in each round:

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

Workers are started from a ``forkserver`` context, created before any gRPC server exists, so no
process is ever forked from a process running gRPC threads (grpc doc/fork_support.md).
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import os
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Callable

from batchd.errors import SampleError, WorkerError
from batchd.server.compute.autoscale import Autoscaler, Demand
from batchd.server.compute.handles import InFlight, WorkerHandle, describe_exit, reraisable
from batchd.server.compute.protocol import BatchDone, Ready, Shutdown, Task, TaskFailed
from batchd.server.compute.sizing import PoolSizing
from batchd.server.compute.stages import StageBoard, work_seconds
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT
from batchd.server.serve.shm import SlotPool
from batchd.server.serve.stream import Computation, ReadyBatch
from batchd.server.compute.worker import worker_main

log = logging.getLogger(__name__)

_POLL_S = 0.5
_JOIN_S = 5.0


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
        self._streams: collections.deque[Computation] = collections.deque()
        self._in_flight: dict[int, InFlight] = {}
        self._task_ids = iter(range(1, 1 << 62))
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
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

    def add_computation(self, stream: Computation) -> None:
        with self._lock:
            self._streams.append(stream)
        self.wake()

    def remove_computation(self, stream: Computation) -> None:
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

    def wake(self) -> None:
        if self._closing:
            return
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
        return WorkerHandle(worker_id, process, parent_conn)

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
        self._receive(w)  # batches it finished before dying still count
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
        w.conn.close()
        self._forget_worker(w)
        if w.retiring:  # it was stopping anyway: the pool shrinks now
            del self._workers[w.worker_id]
            return
        self.restarts += 1
        self._workers[w.worker_id] = self._start_worker(w.worker_id)

    # --- the loop ----------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._closing:
            handles = {w.conn: w for w in self._workers.values()}
            sentinels = {w.process.sentinel: w for w in self._workers.values()}
            try:
                ready = wait([*handles, *sentinels, self._wake_r], _POLL_S)
            except OSError:
                continue
            try:
                self._round(ready, handles, sentinels)
            except Exception as e:  # a scheduler bug or an OS error must not leave streams hanging
                log.exception("scheduler round failed; failing the open streams")
                with self._lock:
                    streams = list(self._streams)
                for stream in streams:
                    stream.fail(WorkerError(f"the server's scheduler failed: {type(e).__name__}: {e}"))

    def _round(self, ready, handles, sentinels) -> None:
        for obj in ready:
            if obj == self._wake_r:
                os.read(self._wake_r, 4096)
            elif obj in handles:
                self._receive(handles[obj])
        for obj in ready:
            if obj in sentinels and not self._closing:
                self._on_death(sentinels[obj])
        self._expire()
        self._dispatch()
        self._retire_idle()
        self._autoscale()

    def _receive(self, w: WorkerHandle) -> None:
        try:
            while w.conn.poll():
                self._handle(w, w.conn.recv())
        except (EOFError, OSError):
            pass  # the worker died; its sentinel reports it

    def _handle(self, w: WorkerHandle, msg) -> None:
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
            job.stream.slot_hint = max(t.offset + t.nbytes for t in msg.tensors)
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

    def _expire(self) -> None:
        """Fail each running task that has run over ``worker_timeout_s`` and kill its worker. The
        worker gets no new task, and its slots stay held until ``_on_death`` has reaped it (a
        process that is killed may still be writing them for a moment)."""
        now = time.monotonic()
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

    def _dispatch(self) -> None:
        with self._dispatch_lock:
            if not self._dispatch_stopped:
                self._dispatch_locked()

    def _dispatch_locked(self) -> None:
        with self._lock:  # least recently served first
            streams = [s for s in self._streams if not s.closed]
        while streams:
            # the worker with the fewest tasks queued, among those that want one
            free = [w for w in self._workers.values() if w.wants_task(self._in_flight, self.read_ahead)]
            if not free:
                return
            w = min(free, key=lambda w: len(w.tasks))
            # round robin: the least recently served computation that wants work gets the worker
            stream = next((s for s in streams if s.wants_work()), None)
            if stream is None:
                return
            slot = self.slots.acquire(stream.slot_hint)
            if slot is None and sum(c.evict_history() for c in streams):
                slot = self.slots.acquire(stream.slot_hint)  # batches kept for late joiners made room
            if slot is None:
                return  # every slot is held; a release wakes us
            b = stream.take_task()
            req = stream.request
            task = Task(
                task_id=next(self._task_ids),
                dataset=req.dataset,
                pipeline_key=req.pipeline_key,
                pipeline_json=req.pipeline_json,
                indices=stream.batch_indices(b),
                random_key=stream.random_key(),
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
