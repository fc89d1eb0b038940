"""The pool's worker processes: started, watched, awaited, and replaced when they die.

``PoolProcesses`` is the part of ``WorkerPool`` (``server/compute/pool.py``) that starts a worker
process (``worker_main``, from the pool's ``forkserver`` context), registers its pipe and its
sentinel on the scheduler's selector (``scheduler.py``), waits for every worker's Ready at start,
and handles a death in the round its sentinel fires (before that round dispatches, so no process
is polled per task): the worker is reaped, its slots released, its in-flight batches queued again
for other workers (or failed after ``max_task_retries``), and a replacement started.
"""

from __future__ import annotations

import logging
import os
import selectors
import time
from multiprocessing.connection import Connection, wait

from batchd.errors import WorkerError
from batchd.server.compute.handles import WorkerHandle, describe_exit
from batchd.server.compute.protocol import Ready
from batchd.server.compute.scheduler import _PIPE, _SENTINEL
from batchd.server.compute.worker import worker_main

log = logging.getLogger("batchd.server.compute.pool")  # one logger for the pool's decisions

_JOIN_S = 5.0


class PoolProcesses:
    """Mixed into ``WorkerPool``: needs its ``_ctx``, ``_dataset_configs``, ``_cache_dir``, ``slots``,
    ``reads_in_flight``, ``_python``, ``_selector``, ``_workers``, ``_in_flight``,
    ``max_task_retries``, ``restarts``, ``batches_rebuilt``, ``_plain``, ``_receive``,
    ``_forget_worker`` and ``close``."""

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
