"""Stand-ins for a training step of fixed length T2.

``SleepStep``: ``time.sleep(T2)`` -- a GPU step as the CPU sees it (the Python thread waits on
the device and frees its core). ``BusyStep``: a fixed number of single-threaded torch matmuls,
calibrated on the idle machine to take T2 -- a CPU-bound trainer, which competes with the
loader's workers for the cores (so it takes longer than T2 when they run).
"""

from __future__ import annotations

import time

import torch


class SleepStep:
    kind = "sleep"

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self) -> None:
        time.sleep(self.seconds)


class BusyStep:
    kind = "busy"
    _N = 192

    def __init__(self, seconds: float):
        self.seconds = seconds
        self._a = torch.randn(self._N, self._N)
        self._b = torch.randn(self._N, self._N)
        # the fastest of several trials: other processes only ever slow a trial down
        per_iter = min(self._time_iterations(50) for _ in range(7)) / 50
        self.iterations = max(1, round(seconds / per_iter))
        self.measured = min(self._time_iterations(self.iterations) for _ in range(3))

    def _time_iterations(self, n: int) -> float:
        t0 = time.perf_counter()
        for _ in range(n):
            torch.mm(self._a, self._b)
        return time.perf_counter() - t0

    def __call__(self) -> None:
        for _ in range(self.iterations):
            torch.mm(self._a, self._b)


def train_loop(batches, step, warmup: int, steps: int) -> tuple[float, float]:
    """(seconds per step, seconds per step blocked in next()) over ``steps`` steps after ``warmup``."""
    it = iter(batches)
    for _ in range(warmup):
        b = next(it)
        step()
        del b
    t0 = time.perf_counter()
    waited = 0.0
    for _ in range(steps):
        ta = time.perf_counter()
        b = next(it)
        waited += time.perf_counter() - ta
        step()
        del b
    return (time.perf_counter() - t0) / steps, waited / steps
