"""What the training loop took from one server in one pass, as the server is told: ``Progress``.

Each pass of a loader opens one request on each server's call (a ``Batches`` call's ``open``), and
the server keeps a stream for it: what its client took (``batches_taken``, ``samples_taken``), how
much of its time the loop spent waiting for that server's batches (a moving ratio, ``WaitMeter``)
and the loader's profile verdict (``batchd.client.loader.profile``) ride on the call's messages
(``batchd.client.transport.outbox.Outbox``: at most every half second while they change, and a
pass's last before the next ``open``). The server shows them in ``batchd top``, its metrics, and
uses the wait to scale its workers (server/compute/autoscale.py).
"""

from __future__ import annotations

import math
import threading
import time

from batchd.v1 import loader_pb2 as pb

WINDOW_S = 10.0  # time constant of the moving wait ratio reported to servers (seconds)


class WaitMeter:
    """The fraction of recent loop time spent waiting: exponentially weighted sums of wait and of
    wait + step, time constant ``window`` seconds. ``ratio`` is 0..1 (0 before any batch)."""

    __slots__ = ("window", "_t", "_wait", "_loop")

    def __init__(self, window: float = WINDOW_S):
        self.window, self._t, self._wait, self._loop = window, None, 0.0, 0.0

    def add(self, wait: float, step: float, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        decay = 1.0 if self._t is None else math.exp(-max(0.0, now - self._t) / self.window)
        self._t = now
        self._wait = self._wait * decay + wait
        self._loop = self._loop * decay + wait + step

    @property
    def ratio(self) -> float:
        return min(1.0, self._wait / self._loop) if self._loop > 0 else 0.0


class Progress:
    """One pass of one server as its client saw it: ``took`` runs in the consumer's thread (a batch
    taken), ``loop_waited`` too (the loop's wait for it), ``progress`` in gRPC's request thread
    (what to report). Thread-safe."""

    __slots__ = ("batches_taken", "samples_taken", "waits", "verdict", "_reported", "_lock")

    def __init__(self) -> None:
        self.batches_taken = 0
        self.samples_taken = 0
        self.waits = WaitMeter()
        self.verdict = ""  # the loader's profile verdict, reported with the progress
        self._reported = (0, 0)
        self._lock = threading.Lock()

    def took(self, samples: int) -> None:
        """The training loop took one batch of ``samples`` samples of this server's."""
        with self._lock:
            self.batches_taken += 1
            self.samples_taken += samples

    def loop_waited(self, wait: float, step: float, verdict: str) -> None:
        """The loop waited ``wait`` seconds for one of these batches, after a step of ``step``
        seconds; ``verdict``: the loader's profile verdict now."""
        with self._lock:
            self.waits.add(wait, step)
            self.verdict = verdict

    def progress(self, force: bool = False) -> pb.StreamProgress | None:
        """The progress to report, or None if it did not change since the last report (``force``:
        report it anyway)."""
        with self._lock:
            now = (self.batches_taken, self.samples_taken)
            if now == self._reported and not force:
                return None
            self._reported = now
            wait_ratio, verdict = self.waits.ratio, self.verdict
        return pb.StreamProgress(batches_taken=now[0], samples_taken=now[1], wait_ratio=wait_ratio, verdict=verdict)
