"""The pool's scheduler: one thread's rounds.

One thread (``_loop``) owns every worker pipe. It waits, on one selector kept for its lifetime
(epoll on Linux: no selector built per wait), on the pipes, the worker processes' sentinels and a
wake-up pipe, and in each round:

1. collects finished batches and hands them to their stream's reorder buffer;
2. notices dead workers (within ``_POLL_S``), logs the exit code or signal, rebuilds their
   in-flight batches on other workers and starts a replacement (``processes.py``);
3. fails batches that took longer than ``worker_timeout_s`` running (their worker is killed; its
   slots stay held until the process is reaped, since it may still be writing them; then it is
   replaced);
4. dispatches new tasks: streams are served round robin, each stream at most ``prefetch``
   batches in flight or buffered; a worker is sent its next tasks before the current one
   finishes (at least one waiting, more while fewer than ``read_ahead`` samples wait, see
   ``handles.WorkerHandle.wants_task``), so its reader reads their samples ahead; nothing once
   ``stop_dispatch`` was called (the server is shutting down);
5. with an ``Autoscaler`` (config ``workers: {min, max}``), starts a worker while clients wait for
   data, or retires one after a cool-down (``server/compute/autoscale.py``, ``sizing.py``): a
   retiring worker gets no new task, is told to stop once its tasks are done, and is reaped when
   it has exited.

Each finished batch's timings (``server/compute/stages.py``) gain ``queued`` (from sending its
task until the worker began it) and ``worker``.

``Scheduler`` is the part of ``WorkerPool`` (``server/compute/pool.py``) that runs the rounds;
the computations it builds for are ``Work`` (``server/compute/work.py``). The wake-up protocol
(``WorkerPool.wake``) is described in ``pool.py``.
"""

from __future__ import annotations

import fcntl
import logging
import os
import struct
import termios
import time
from dataclasses import dataclass

import numpy as np

from batchd.errors import SampleError, WorkerError
from batchd.server.compute.handles import InFlight, WorkerHandle, reraisable
from batchd.server.compute.protocol import BatchDone, Ready, Task, TaskFailed
from batchd.server.compute.stages import work_seconds
from batchd.server.compute.work import ReadyBatch, Work

log = logging.getLogger("batchd.server.compute.pool")  # one logger for the pool's decisions

_POLL_S = 0.5
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


class Scheduler:
    """Mixed into ``WorkerPool``: the scheduler thread's rounds. Needs the pool's ``_selector``,
    ``_wake_r``, ``_wake_lock``, ``_waiting_for``, ``_changed``, ``_wake_pending``, ``_blocked``,
    ``_plain``, ``counts``, ``_closing``, ``_lock``, ``_streams``, ``_workers``, ``_retired``,
    ``_in_flight``, ``_task_ids``, ``_random_keys``, ``slots``, ``_skip``,
    ``_max_skipped_fraction``, ``worker_timeout_s``, ``max_batch_bytes``, ``read_ahead``,
    ``_next_expire``, ``_dispatch_lock``, ``_dispatch_stopped``, the counters it updates
    (``batches_built``, ``hedge_batches_built``, ``work_seconds``), ``_on_death``,
    ``_retire_idle`` and ``_autoscale``."""

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
        allowed = min(self._max_skipped_fraction.get(d, 0.0) for d in req.datasets) * len(stream.indices)
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
            mix = req.mix
            task = Task(
                task_id=next(self._task_ids),
                dataset=req.dataset if mix is None else mix.sources[0].dataset,
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
                sources=() if mix is None else tuple((m.dataset, m.pipeline_key, m.pipeline_json) for m in mix.sources),
                source_ids=stream.batch_sources(b),
                drawn=req.drawn,
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
