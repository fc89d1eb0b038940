"""What the pool's scheduler knows about each worker process and each task it sent.

Kept apart from ``pool.py`` (the loop that acts on them): a worker's queue of tasks, how deep it
may grow so the worker's reads stay ahead (``WorkerHandle.wants_task``), which of its tasks is
running (``running``: a worker runs its tasks in the order they were sent), and the slots a
killed worker may still be writing (``held_slots``, released only once its process is reaped).
"""

from __future__ import annotations

import multiprocessing as mp
import signal
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from batchd.errors import ResourceExhaustedError, SampleError, ShapeMismatchError, WorkerError
from batchd.server.compute.protocol import TaskFailed
from batchd.server.shm import Segment
from batchd.server.compute.rates import BusyClock
from batchd.server.compute.work import Work

MIN_DEPTH = 2  # tasks per worker: one running, one waiting, so a worker never idles
MAX_DEPTH = 4  # at most; more would only fill the pipe (a Task holds its indices)


@dataclass(slots=True)
class InFlight:
    """A task sent to a worker: batch ``batch_index`` of ``stream`` into ``slot``.

    started: when it was sent (``time.monotonic()``, seconds). samples: batch size (samples)."""

    stream: Work
    batch_index: int
    slot: Segment
    worker_id: int
    started: float
    samples: int = 0


@dataclass(slots=True)
class WorkerHandle:
    """One worker process as the scheduler sees it.

    tasks: ids of the tasks sent and not answered, run by the worker in increasing order.
    last_done: when it last answered a task (monotonic seconds): the running task started then,
    unless it was sent later. killed: the scheduler killed it (task timeout); it gets no new
    task, and ``held_slots`` (its expired tasks' slots) are released only after it is reaped.
    retiring: the pool is shrinking (``server/compute/autoscale.py``): it gets no new task and
    stops once its tasks are done. busy: whether it has a batch to build, over time (its busy ratio),
    from the moment it is ready (``became_ready``); a worker gets tasks only once it is ready, so a
    starting one never holds batches the client waits for.
    """

    worker_id: int
    process: mp.process.BaseProcess
    conn: Connection
    ready: bool = False
    tasks: set[int] = field(default_factory=set)
    last_done: float = 0.0
    killed: bool = False
    held_slots: list[Segment] = field(default_factory=list)
    retiring: bool = False
    busy: BusyClock = field(default_factory=BusyClock)
    fd: int = field(init=False, default=-1)  # the pipe's file descriptor (the pool's selector watches it)

    def __post_init__(self) -> None:
        self.fd = self.conn.fileno()

    def became_ready(self) -> None:
        """It said Ready: it takes tasks from now on, and its busy ratio counts from now."""
        self.ready = True
        self.busy = BusyClock()

    def running(self, in_flight: dict[int, InFlight]) -> tuple[int, float] | None:
        """(task id, when it started running) of the task this worker is on, or None if idle."""
        if not self.tasks:
            return None
        task_id = min(self.tasks)
        job = in_flight.get(task_id)
        return (task_id, max(job.started, self.last_done)) if job is not None else None

    def wants_task(self, in_flight: dict[int, InFlight], read_ahead: int) -> bool:
        """True if it should be sent another task: alive as far as the scheduler knows, fewer than
        ``MIN_DEPTH`` tasks, or (up to ``MAX_DEPTH``) fewer than ``read_ahead`` samples queued
        behind the running task, so that its reader has samples to read ahead.

        "Alive as far as the scheduler knows": not killed by it, and its sentinel has not fired.
        The pool's loop waits on every worker's sentinel and handles a death (``_on_death``)
        before it dispatches in the same round, so no system call is made here: a worker that
        dies after that is sent a task into its pipe, and its death rebuilds the task."""
        if self.killed or self.retiring or not self.ready:
            return False
        n = len(self.tasks)
        if n < MIN_DEPTH:
            return True
        if n >= MAX_DEPTH:
            return False
        sizes = {t: in_flight[t].samples for t in self.tasks if t in in_flight}
        return sum(sizes.values()) - sizes.get(min(self.tasks), 0) < read_ahead


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words: ``died with signal 9 (SIGKILL)``, ``exited with code 1``."""
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            return f"died with signal {-exitcode} ({signal.Signals(-exitcode).name})"
        except ValueError:
            return f"died with signal {-exitcode}"
    return f"exited with code {exitcode}"


def reraisable(msg: TaskFailed) -> BaseException:
    """The worker's exception, with its traceback in the message where the type allows."""
    err = msg.error
    if isinstance(err, (SampleError, ShapeMismatchError, ResourceExhaustedError)):
        return err  # data errors and limits: the message already says what and where
    if err is not None and isinstance(err, ValueError):
        err.add_note(f"Worker traceback:\n{msg.traceback}")
        return err
    return WorkerError(f"{msg.error_type}: {msg.message}\n\nWorker traceback:\n{msg.traceback}")
