"""The worker pool's size and load: how busy its workers are, and starting or retiring them.

``PoolSizing`` is the part of ``WorkerPool`` (``server/compute/pool.py``) that the pool's
scheduler thread runs each round to size the pool (config ``workers: {min, max}``, the policy in
``server/compute/autoscale.py``) and that stats read from any thread: each worker's busy ratio
(``handles.WorkerHandle.busy``, counted from when it is ready) and the pool's cumulative busy and
alive worker-seconds, from which ``Loader`` derives each stream's ``BatchTimings.workers_busy_ratio``.

Starting: a worker that is retiring but still running its last tasks is kept instead (it is ready,
its pipelines built); otherwise a new process gets the lowest free id below ``max_workers`` (the
cache's counter rows and the stage board are sized for them), else the id of a worker that was
told to stop and has not exited yet, and takes tasks once it says Ready. When no id is left, the
pool does not grow this time (logged; never an error in the scheduler's round). Retiring: the
highest id gets no new task, is told to stop once its tasks are done, and is reaped when it has
exited.
"""

from __future__ import annotations

import logging
import time

from batchd.server.compute.handles import WorkerHandle
from batchd.server.compute.protocol import Shutdown

log = logging.getLogger("batchd.server.compute.pool")  # one logger for the pool's decisions

_SCALE_EVERY_S = 0.25  # how often the autoscaler is asked


class PoolSizing:
    """Mixed into ``WorkerPool``: needs its ``_workers``, ``_retired``, ``_gone``, ``autoscaler``,
    ``_demand``, ``scaling``, ``_scaled_at``, ``max_workers``, ``board``, ``_closing``,
    ``_start_worker``, ``_unwatch`` and ``wake``."""

    def busy_ratio(self, now: float | None = None) -> float:
        """Fraction of the workers' time with a batch to build, moving over about 10 s: 0..1."""
        workers = [w for w in list(self._workers.values()) if w.ready]
        return sum(w.busy.ratio(now=now) for w in workers) / len(workers) if workers else 0.0

    def busy_totals(self, now: float | None = None) -> tuple[float, float]:
        """(seconds workers had a batch to build, seconds workers were alive), summed over every
        worker since the pool started: the pool's busy ratio between two calls is the ratio of the
        differences (``Loader``: per stream, ``BatchTimings.workers_busy_ratio``)."""
        now = time.monotonic() if now is None else now
        busy, alive = self._gone
        for w in list(self._workers.values()):
            if w.ready:  # (a starting worker's time is neither busy nor idle)
                busy += w.busy.busy_seconds(now=now)
                alive += w.busy.alive_seconds(now=now)
        return busy, alive

    def _forget_worker(self, w: WorkerHandle) -> None:
        """``w`` leaves ``_workers``: keep its busy and alive seconds in the pool's totals."""
        if not w.ready:
            return
        now = time.monotonic()
        self._gone[0] += w.busy.busy_seconds(now=now)
        self._gone[1] += w.busy.alive_seconds(now=now)

    def workers(self, now: float | None = None) -> list[dict]:
        """For stats, from any thread: per worker (by id) its id, pid, busy ratio (0..1, moving),
        stage now ("starting", "retiring", "idle" or a stage of ``server/compute/stages.py``) and tasks."""
        out = []
        for w in sorted(list(self._workers.values()), key=lambda w: w.worker_id):
            stage = "starting" if not w.ready else "retiring" if w.retiring else self.board.get(w.worker_id)
            out.append({"id": w.worker_id, "pid": w.process.pid or 0,
                        "busy_ratio": w.busy.ratio(now=now) if w.ready else 0.0,
                        "stage": stage, "tasks": len(w.tasks)})
        return out

    def _autoscale(self) -> None:
        """Ask the autoscaler (at most every ``_SCALE_EVERY_S``) and act: start a worker, or mark one retiring."""
        a = self.autoscaler
        now = time.monotonic()
        if a is None or self._closing or now - self._scaled_at < _SCALE_EVERY_S:
            return
        self._scaled_at = now
        active = [w for w in self._workers.values() if not w.retiring]
        busy, alive = self.busy_totals(now)
        decision = a.decide(workers=len(active), starting=sum(1 for w in active if not w.ready), busy_seconds=busy,
                            alive_seconds=alive, demand=self._demand(), now=now)
        if decision is None:
            return
        if decision.direction == "up":
            if not self._grow(decision):
                return
        else:
            w = max(active, key=lambda w: w.worker_id)
            w.retiring = True
            log.info("workers: retiring worker %d (%s): %s", w.worker_id, decision.reason, decision.why)
        self.scaling[(decision.direction, decision.reason)] += 1

    def _grow(self, decision) -> bool:
        """One more active worker: a retiring one kept (the lowest id; it still runs), else a new
        process (``new_worker_id``). False, logged, when every id is taken."""
        retiring = [w for w in self._workers.values() if w.retiring and not w.killed]
        if retiring:
            w = min(retiring, key=lambda w: w.worker_id)
            w.retiring = False
            self.wake()  # it takes tasks again: the next round dispatches
            log.info("workers: keeping worker %d, which was retiring (%s): %s", w.worker_id, decision.reason,
                     decision.why)
            return True
        worker_id = new_worker_id(self.max_workers, set(self._workers), {w.worker_id for w in self._retired})
        if worker_id is None:
            log.warning("workers: not starting a worker (%s): all %d ids are in use (%s)", decision.reason,
                        self.max_workers, decision.why)
            return False
        self._workers[worker_id] = self._start_worker(worker_id)
        log.info("workers: starting worker %d (%s): %s", worker_id, decision.reason, decision.why)
        return True

    def _retire_idle(self) -> None:
        """Tell each retiring worker whose tasks are done to stop; reap those that have stopped."""
        for w in [w for w in self._workers.values() if w.retiring and not w.tasks]:
            del self._workers[w.worker_id]
            self._forget_worker(w)
            self._unwatch(w)  # its pipe's EOF would end every wait of the loop; it is reaped below
            try:
                w.conn.send(Shutdown())
            except (OSError, ValueError):
                pass
            self._retired.append(w)
        for w in list(self._retired):
            if not w.process.is_alive():
                w.process.join(0)
                w.conn.close()
                self._retired.remove(w)
                log.info("workers: worker %d (pid %d) stopped; %d running", w.worker_id, w.process.pid,
                         len(self._workers))


def new_worker_id(max_workers: int, running: set[int], stopping: set[int]) -> int | None:
    """The id for a new worker process: the lowest id below ``max_workers`` that no worker has, else
    the lowest of ``stopping`` (workers told to stop, not yet reaped) that no running worker has;
    None if every id is taken."""
    free = set(range(max_workers)) - running
    return min(free - stopping, default=None) if free - stopping else min(free, default=None)
