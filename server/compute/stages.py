"""Where a worker's time on a batch goes, and what each worker is doing now.

A worker's time on a batch is split into ``STAGES`` (the ``BatchTimings`` fields of loader.proto):

* ``read``: its thread waiting for samples' bytes (reads run ahead on I/O threads,
  ``server/data/reader.py``; only the wait that decoding did not hide counts);
* ``decode``: bytes -> arrays; ``pipeline``: the albumentations pipeline and its checks;
* ``cache``: the decoded-sample cache (lookups, copying hits out, storing misses);
* ``write``: writing samples, labels, indices and positions into the batch's slot.

``StageClock`` measures them with one ``perf_counter`` call per stage change: the worker loops
over a batch's samples with ``StageClock.samples`` and calls ``enter(STAGE)`` where its work changes, and each interval goes to the stage it was in; for
samples too cheap to time each one, it times one in ``every`` and shares the rest of the loop's
time out in their proportions (see ``StageClock``). The same call marks the worker's current
stage on the ``StageBoard``, one byte per worker in a small shared-memory segment the server
reads (``batchd top``: a worker's current stage) without a message.

``BatchDone.timings`` (``server/compute/protocol.py``) carries the clock's seconds per stage, plus
``read_io`` (the I/O threads' own read time, which overlaps the rest), ``started`` (the
``time.monotonic()`` at which the worker began the batch: the server's ``queued`` time is from
sending the task until then; CLOCK_MONOTONIC is one clock for every process of a host) and
``cache_hits`` (samples served by the cache). ``work_seconds`` is the worker's time on it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator

from batchd.server.shm import Segment

STAGES = ("read", "decode", "pipeline", "cache", "write")
READ, DECODE, PIPELINE, CACHE, WRITE = range(len(STAGES))
IDLE = len(STAGES)  # the board's code for a worker without a batch
_NAMES = (*STAGES, "idle")


def work_seconds(timings: dict[str, float]) -> float:
    """A worker's time on a batch: the sum of its ``STAGES`` in ``BatchDone.timings`` (seconds)."""
    return sum(timings.get(s, 0.0) for s in STAGES)


class StageBoard:
    """One byte per worker id in the segment ``<prefix>stages``: the stage it is in now.

    The pool creates it (``create``, ``slots`` = the largest worker count) and unlinks it
    (``close``); each worker attaches to it by name (``attach``: None if it is missing, so a
    worker started by a server without one still runs). Bytes are written by one worker each and
    read racily by the server: a stage read a moment late is all ``batchd top`` needs.
    """

    def __init__(self, segment: Segment, owner: bool):
        self._segment, self._owner = segment, owner
        self._buf = segment.buf

    @staticmethod
    def name(prefix: str) -> str:
        return f"{prefix}stages"

    @classmethod
    def create(cls, prefix: str, slots: int) -> "StageBoard":
        board = cls(Segment.create(cls.name(prefix), slots), owner=True)
        board._buf[:slots] = bytes([IDLE]) * slots
        return board

    @classmethod
    def attach(cls, prefix: str) -> "StageBoard | None":
        try:
            return cls(Segment.attach(cls.name(prefix)), owner=False)
        except OSError:
            return None

    def set(self, worker_id: int, stage: int) -> None:
        if worker_id < len(self._buf):
            self._buf[worker_id] = stage

    def get(self, worker_id: int) -> str:
        """The worker's stage now: one of ``STAGES`` or "idle"."""
        code = self._buf[worker_id] if worker_id < len(self._buf) else IDLE
        return _NAMES[code] if code < len(_NAMES) else "idle"

    def close(self) -> None:
        self._buf.release()
        self._segment.close()
        if self._owner:
            self._segment.unlink()


class StageClock:
    """Seconds per stage of one batch, for one worker (its thread only).

    ``start(stage)`` begins a batch in ``stage``; ``enter(stage)`` closes the current interval and
    begins the next; ``stop()`` returns {stage: seconds} for every stage in ``STAGES`` (and marks
    the worker idle on the board). ``started`` is the batch's start in ``time.monotonic()``.

    Samples are timed one in ``every``: the per-sample loop is bracketed by ``begin_samples`` and
    ``end_samples``; the worker times sample k (its ``enter`` calls, guarded by ``on``) only if
    ``k % every == 0`` and calls ``pause`` when a timed sample ends. The loop's own time is then
    measured whole and shared among the stages as the timed samples shared theirs, so the totals
    stay those of the whole batch. ``every`` adapts after each batch so that the clock costs
    about ``BUDGET`` of the work per sample (every sample once one takes a few ms, as decoding a
    photo does; one a batch for Fashion-MNIST's 28 x 28 samples without a pipeline).
    """

    BUDGET = 0.001  # of a sample's work, spent on timing it
    __slots__ = ("_board", "_worker", "_stage", "_t", "_totals", "_timed", "_loop_t", "started", "on", "every",
                 "_cost")

    def __init__(self, board: StageBoard | None = None, worker_id: int = 0):
        self._board, self._worker = board, worker_id
        self._stage, self._t, self._totals, self._timed = IDLE, 0.0, [0.0] * len(STAGES), None
        self._loop_t = 0.0
        self.started = 0.0
        self.on = True  # the current sample is timed (the worker guards its enter calls with it)
        self.every = 1
        self._cost = self._calibrate()  # seconds one timed sample's clock calls take

    def _calibrate(self, n: int = 50, repeat: int = 5) -> float:
        """Seconds a timed sample's clock calls take here (4 stages, a pause, the board's writes):
        the least of ``repeat`` rounds of ``n`` (a round another process interrupted counts for nothing)."""
        self._timed = [0.0] * len(STAGES)
        cost = math.inf
        for _ in range(repeat):
            t0 = time.perf_counter()
            for _ in range(n):
                self.enter(READ)
                self.enter(DECODE)
                self.enter(PIPELINE)
                self.enter(WRITE)
                self.pause()
            cost = min(cost, (time.perf_counter() - t0) / n)
        self._stage, self._timed = IDLE, None
        if self._board is not None:
            self._board.set(self._worker, IDLE)
        return cost

    def start(self, stage: int) -> None:
        self._totals = [0.0] * len(STAGES)
        self._timed = None
        self.on = True
        self.started = time.monotonic()
        self._t = time.perf_counter()
        self._mark(stage)

    def enter(self, stage: int) -> None:
        now = time.perf_counter()
        if self._stage < IDLE:
            (self._totals if self._timed is None else self._timed)[self._stage] += now - self._t
        self._t = now
        if stage != self._stage:
            self._mark(stage)

    def pause(self) -> None:
        """A timed sample ended: close its last interval; nothing counts until the next ``enter``."""
        now = time.perf_counter()
        if self._stage < IDLE and self._timed is not None:
            self._timed[self._stage] += now - self._t
        self._stage = IDLE

    def begin_samples(self) -> None:
        """The per-sample loop starts: from here, samples are timed one in ``every``."""
        self.enter(IDLE)
        self._timed = [0.0] * len(STAGES)
        self._loop_t = self._t

    def end_samples(self, samples: int, stage: int) -> None:
        """The loop over ``samples`` samples ended (the last timed one paused); continue in ``stage``.
        Its time goes to the stages in the timed samples' proportions; ``every`` adapts."""
        now = time.perf_counter()
        loop, timed = now - self._loop_t, self._timed
        self._timed = None
        measured = sum(timed)
        for i, seconds in enumerate(timed):
            self._totals[i] += seconds * loop / measured if measured > 0 else 0.0
        if samples:
            per_sample = loop / samples
            self.every = max(1, min(samples, math.ceil(self._cost / (self.BUDGET * per_sample)))) if per_sample > 0 else 1
        self.on = True
        self._t = now
        self._stage = IDLE
        self._mark(stage)

    def samples(self, n: int, then: int = WRITE) -> Iterator[int]:
        """The worker's loop over a batch's ``n`` samples, as the clock needs it: yields 0..n-1
        between ``begin_samples`` and ``end_samples(n, then)``, sets ``on`` (this sample is timed:
        one in ``every``) before each and pauses after each timed one. The body guards its
        ``enter`` calls with ``on``; ``continue`` skips a sample. The worker, Table 14
        (bench/tables/table_timings.py) and tests/compute/test_stages.py all loop through it."""
        self.begin_samples()
        every, on = self.every, False
        for k in range(n):
            if on:
                self.pause()
            on = self.on = not k % every
            yield k
        if on:
            self.pause()
        self.end_samples(n, then)

    def stop(self) -> dict[str, float]:
        if self._timed is not None:  # the batch failed inside its loop
            self._timed = None
        self.enter(IDLE)
        return dict(zip(STAGES, self._totals))

    def _mark(self, stage: int) -> None:
        self._stage = stage
        if self._board is not None:
            self._board.set(self._worker, stage)
