"""A server's pace, as the loader measures it: ``Pace`` (its rate, its workers' time, its latencies).

The assigner (``batchd.client.assign``) reads it to size a server's window (``rate`` and
``work_time``, ``batchd.client.windows``), to pick who finishes a batch soonest, and to judge the
other servers' lateness by it (``latencies``, ``batchd.client.lateness``). One ``Pace`` per
server, kept across its iterations (its ``pace`` in ``batchd.client.membership``); a ``Lane``
(``batchd.client.lane``) points at its server's for one iteration. Updated once per batch that
arrived on time (``Assigner.arrived``), under the feed's lock; read several times per batch, so
the median worker time is kept as batches arrive rather than computed on each read.
"""

from __future__ import annotations

import collections
import statistics

RATE_ALPHA = 0.25  # weight of a new sample in a moving mean: a server's gap between batches, the loop's step


class Pace:
    """What the loader knows of one server's speed, kept across its iterations.

    rate: batches per second while it had grants outstanding (1 / the moving mean gap between
    its batches; a batch that arrived late is not counted, so a server that stalls does not
    lower its own bar); 0.0 before any. work: its workers' seconds per batch (``BatchTimings``:
    read + decode + pipeline + cache + write), recent. latencies: grant-to-arrival seconds of its
    recent batches (the yardstick of the others' lateness, ``HedgePolicy.late_after``).
    """

    __slots__ = ("rate", "work", "latencies", "_gap", "_work_time")

    def __init__(self, window: int = 100):
        self.rate = 0.0
        self.work: collections.deque[float] = collections.deque(maxlen=32)
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)
        self._gap: float | None = None
        self._work_time = 0.0  # the median of ``work``, kept as batches arrive (read several times per batch)

    def record(self, gap: float | None, latency: float, work: float) -> None:
        """One batch arrived on time: ``gap`` seconds after the previous one (or after the server
        got work; None: unknown), ``latency`` seconds after its grant, ``work`` worker seconds."""
        if gap is not None and gap >= 0:  # (0: two batches at once, from two workers)
            self._gap = gap if self._gap is None else (1 - RATE_ALPHA) * self._gap + RATE_ALPHA * gap
            if self._gap > 0:
                self.rate = 1.0 / self._gap
        self.latencies.append(latency)
        if work > 0:
            self.work.append(work)
            self._work_time = statistics.median(self.work)

    @property
    def work_time(self) -> float:
        """Median worker seconds per batch (0.0 unknown)."""
        return self._work_time
