"""Where a loader's batches spent their time: each batch's stages, and the training loop's wait.

Every batch brings the server's ``BatchTimings`` (loader.proto: queued, read, decode, pipeline,
cache, write, reorder, send). The client adds its own stages (``BatchTimes``): ``receive``
(its call's thread waiting for the message from gRPC), ``unpack`` (the converter thread: message
-> tensors: parsing, LZ4, mapping a shared-memory slot, decoding JPEGs for
``decode_on_client``), ``copy`` (host to device) and ``gpu_transform``. On CUDA the last two are device times, read from CUDA events
once they have completed (until then they count as 0); without a device ``gpu_transform`` is
its CPU time and ``copy`` is 0.

The training loop's side is ``LoopTimings``, fed by ``RemoteDataLoader.__iter__``: ``wait`` is
the time ``__next__`` blocked for a batch (a ``batchd.wait`` range in profiler and NVTX traces:
``waiting``), and ``step`` is the time between two ``__next__`` calls (the training step). The first batch of an
iteration is not counted as wait (it includes connecting and the pipeline's warm-up): it is
``startup``. ``wait_ratio`` = wait / (wait + step), over the epoch so far; a moving version
(about the last ``progress.WINDOW_S`` seconds) is what the loader reports to each server
(``StreamProgress.wait_ratio``), so a server sizes its workers by the recent wait, not the
epoch's.

All times are seconds (floats) and ratios are in [0, 1]. ``batchd.client.loader.profile`` turns the
totals into ``loader.profile()``'s verdict.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

import torch

from batchd.client.transport.progress import WaitMeter
from batchd.client.transport.receiver import BatchTimes, delivered, take_delivered

# BatchTimes, delivered and take_delivered are the receiver's, public here too (bench/tables/table_timings.py)
__all__ = ["BatchTimes", "LoopTimings", "delivered", "take_delivered", "timed", "waiting"]

T = TypeVar("T")
WAIT_RANGE = "batchd.wait"  # the profiler / NVTX range around the loop's wait for a batch

SERVER_STAGES = ("queued", "read", "decode", "pipeline", "cache", "write", "reorder", "send")
WORKER_STAGES = ("read", "decode", "pipeline", "cache", "write")  # a worker's time on a batch
CLIENT_STAGES = ("receive", "unpack", "copy", "gpu_transform")  # the call's and the converter's threads, per batch
LOOP_STAGES = ("wait", "step")  # the training loop
STAGES = (*LOOP_STAGES, *SERVER_STAGES, *CLIENT_STAGES)


@dataclass
class LoopTimings:
    """Totals for the epoch so far (``begin`` with another epoch starts over): seconds per stage
    (``STAGES``), batches counted, the first batch's wait (``startup``), the workers' busy ratio
    the latest batch of each call carried (each is the pool's since that call's stream opened),
    and the moving wait ratio. Used from the consumer's thread."""

    epoch: int | None = None
    batches: int = 0
    startup: float = 0.0
    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STAGES, 0.0))
    busy: dict[int, float] = field(default_factory=dict)  # id(call) -> its latest BatchTimings.workers_busy_ratio
    moving: WaitMeter = field(default_factory=WaitMeter)
    _pending: list[BatchTimes] = field(default_factory=list)  # CUDA times not read yet
    _first: bool = True

    def begin(self, epoch: int) -> None:
        """An iteration starts: its first batch is ``startup``; a new epoch resets the totals."""
        if epoch != self.epoch:
            self.__init__(epoch=epoch)  # type: ignore[misc]
        self._first = True

    def add(self, wait: float, step: float, times: BatchTimes | None, call: object = None) -> float:
        """One batch taken: the loop waited ``wait`` seconds in ``__next__`` after a step of ``step``
        seconds (since the previous batch was handed over); ``times``: its stages; ``call``: the
        StreamBatches call it came on (its server). Returns the wait counted (0 for an iteration's
        first batch: its wait is ``startup``)."""
        first, self._first = self._first, False
        if first:
            self.startup += wait
            wait = 0.0
        else:
            self.totals["wait"] += wait
        self.totals["step"] += step
        self.moving.add(wait, step)
        self.batches += 1
        if times is not None:
            if times.server is not None:
                self.busy[id(call)] = times.server.workers_busy_ratio
                for stage in SERVER_STAGES:
                    self.totals[stage] += getattr(times.server, f"{stage}_seconds")
            for stage in CLIENT_STAGES:  # (copy and gpu_transform: 0 while their CUDA times are pending)
                self.totals[stage] += getattr(times, stage)
            if times.events is not None:
                self._pending.append(times)
            self._resolve()
        return wait

    def finished_step(self, step: float) -> None:
        """The loop came back after its last batch (the iteration ended): count that step."""
        self.totals["step"] += step

    def _resolve(self, wait: bool = False) -> None:
        """Add the CUDA times of batches whose copies have completed."""
        for times in [t for t in self._pending if t.resolve(wait)]:
            self._pending.remove(times)
            self.totals["copy"] += times.copy
            self.totals["gpu_transform"] += times.gpu_transform

    @property
    def wait_ratio(self) -> float:
        """wait / (wait + step) over the epoch so far, the first batch left out: 0..1."""
        loop = self.totals["wait"] + self.totals["step"]
        return min(1.0, self.totals["wait"] / loop) if loop > 0 else 0.0

    @property
    def workers_busy_ratio(self) -> float:
        """How busy the servers' workers were (0..1; 0 without timings): the mean over the calls of
        this epoch of what each one's latest batch says."""
        return sum(self.busy.values()) / len(self.busy) if self.busy else 0.0

    def snapshot(self) -> "LoopTimings":
        """A copy with every completed CUDA time read (waiting for those in flight)."""
        self._resolve(wait=True)
        return LoopTimings(self.epoch, self.batches, self.startup, dict(self.totals), dict(self.busy))


def waiting(take: Callable[[], T], cuda: bool) -> T:
    """``take()`` inside a ``torch.profiler.record_function(WAIT_RANGE)`` range while a profiler
    runs (about 30 us a call, so not otherwise), and an NVTX range of that name when ``cuda`` and
    torch has NVTX (Nsight Systems shows it)."""
    profiled = torch.autograd._profiler_enabled()
    with torch.profiler.record_function(WAIT_RANGE) if profiled else contextlib.nullcontext():
        nvtx = cuda and _nvtx()
        if nvtx:
            torch.cuda.nvtx.range_push(WAIT_RANGE)
        try:
            return take()
        finally:
            if nvtx:
                torch.cuda.nvtx.range_pop()


@functools.cache
def _nvtx() -> bool:
    """Whether this torch can mark NVTX ranges (a CPU build cannot)."""
    try:
        torch.cuda.nvtx.range_push(WAIT_RANGE)
        torch.cuda.nvtx.range_pop()
        return True
    except (RuntimeError, AttributeError):
        return False


_END = object()  # what ``next`` gives at the end (a collate_fn may return None for a batch)


def timed(batches: Iterator[T], timings: LoopTimings, *, cuda: bool, verdict: Callable[[float], str],
          stats: Any) -> Iterator[T]:
    """``batches`` as the training loop takes them, timed: each ``next`` is a wait (``waiting``), the
    time between two is a step; both go to ``timings`` and to the batch's call record (its
    progress reports them), with ``verdict(now)``, and each wait, as measured, to ``stats`` (a
    ``batchd.client.loader.stats.LoaderStats``: ``loader.stats()``). Closing it closes ``batches``."""
    handed = None  # perf_counter() when the loop got the previous batch
    try:
        while True:
            asked = time.perf_counter()
            stats.asking(asked)
            step = asked - handed if handed is not None else 0.0
            batch = waiting(lambda: next(batches, _END), cuda)
            if batch is _END:
                timings.finished_step(step)  # (0 when no batch came)
                return
            handed = time.perf_counter()
            times, record, samples = take_delivered()
            stats.waited(handed - asked, batch, handed, samples)
            wait = timings.add(handed - asked, step, times, record)
            if record is not None:
                record.loop_waited(wait, step, verdict(handed))
            yield batch
            batch = None  # (an error raised by the next one must not keep this one alive in its traceback)
    finally:
        batches.close()
