"""Moving rates over the last few seconds: events per second (``RateMeter``: images sent or taken
by a stream) and the fraction of time something was busy (``BusyClock``: a worker with a batch
to build). Both weigh the past by ``exp(-age / window)`` over about ``RATE_WINDOW_S`` seconds and
correct for a meter younger than its window; ``server/serve/stats.py`` reports them.
"""

from __future__ import annotations

import math
import threading
import time

RATE_WINDOW_S = 10.0


class RateMeter:
    """An exponentially weighted moving rate of events (e.g. images sent, worker seconds spent).

    ``add(n)`` at time t adds ``n`` with weight ``exp(-(now - t) / window)``; ``rate()`` is the
    weighted sum divided by the window, corrected for a meter younger than the window (so a
    2-second-old stream reports its average over those 2 seconds, not a fifth of it). A steady
    rate R reads R; a stopped one decays to 0 with time constant ``window``. Thread-safe.
    """

    __slots__ = ("window", "_start", "_t", "_value", "_lock")

    def __init__(self, window: float = RATE_WINDOW_S, *, now: float | None = None):
        self.window = window
        self._start = self._t = time.monotonic() if now is None else now
        self._value = 0.0  # the weighted sum of events, as of time _t
        self._lock = threading.Lock()

    def add(self, n: float, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            self._value = self._value * math.exp(-(now - self._t) / self.window) + n
            self._t = max(self._t, now)

    def rate(self, *, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            value = self._value * math.exp(-max(0.0, now - self._t) / self.window)
            age = now - self._start
        if age <= 0:
            return 0.0
        return value / (self.window * -math.expm1(-age / self.window))


class BusyClock:
    """How much of its time a worker has had a batch to build: an on/off state (``set``), its
    total on-time (``busy_seconds``, the current stretch included) and alive time
    (``alive_seconds``), and the on fraction as a moving ratio over about ``window`` seconds
    (``ratio``: exponentially weighted, corrected for a clock younger than the window, as
    ``RateMeter``). Times are ``time.monotonic()`` seconds. Thread-safe."""

    __slots__ = ("window", "_start", "_t", "_on", "_value", "_busy", "_lock")

    def __init__(self, window: float = RATE_WINDOW_S, *, now: float | None = None):
        self.window = window
        self._start = self._t = time.monotonic() if now is None else now
        self._on = False
        self._value = 0.0  # the weighted on-time, as of _t
        self._busy = 0.0  # total on-time up to _t
        self._lock = threading.Lock()

    def _advance(self, now: float) -> tuple[float, float]:
        dt = max(0.0, now - self._t)
        if not self._on:
            return self._value * math.exp(-dt / self.window), self._busy
        return self._value * math.exp(-dt / self.window) - self.window * math.expm1(-dt / self.window), self._busy + dt

    def set(self, on: bool, *, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        with self._lock:
            if now > self._t:
                self._value, self._busy = self._advance(now)
                self._t = now
            self._on = on

    def ratio(self, *, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            value, _ = self._advance(now)
            age = now - self._start
        if age <= 0:
            return 1.0 if self._on else 0.0
        return min(1.0, value / (self.window * -math.expm1(-age / self.window)))

    def busy_seconds(self, *, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        with self._lock:
            return self._advance(now)[1]

    def alive_seconds(self, *, now: float | None = None) -> float:
        return max(0.0, (time.monotonic() if now is None else now) - self._start)
