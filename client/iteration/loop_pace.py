"""The training loop's own pace, as the loader sees it: ``LoopPace``.

Its step is the time between getting a batch and asking for the next (the training step; the
wait for data left out), a moving mean. The several-servers rule (``batchd.client.iteration.credit``)
bounds how far ahead it grants by it: a loop slower than the servers does not make them build
far ahead, nor hold their memory. Thread-safety: none (the pass calls it under its lock).
"""

from __future__ import annotations

STEP_ALPHA = 0.25  # weight of a new step in the moving mean


class LoopPace:
    """``asked(now)`` when the loop asks for a batch, ``handed(now)`` when it gets it (monotonic
    seconds); ``step()``: its seconds per batch besides waiting, or the step it is in if longer
    (``now``); None before its first step."""

    __slots__ = ("_step", "_handed_at")

    def __init__(self) -> None:
        self._step: float | None = None
        self._handed_at: float | None = None

    def asked(self, now: float) -> None:
        if self._handed_at is not None:
            step = max(0.0, now - self._handed_at)
            self._step = step if self._step is None else (1 - STEP_ALPHA) * self._step + STEP_ALPHA * step
            self._handed_at = None

    def handed(self, now: float) -> None:
        self._handed_at = now

    def step(self, now: float | None = None) -> float | None:
        if self._step is None:
            return None
        if now is not None and self._handed_at is not None:
            return max(self._step, now - self._handed_at)
        return self._step
