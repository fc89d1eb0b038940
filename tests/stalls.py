"""A process stopped and continued on a schedule: the stalling server of the hedging and
full-speed tests and of Tables 12 and 17 (``bench/tables/table_hedge.py``, ``table_fullspeed.py``)."""

from __future__ import annotations

import os
import signal
import threading


class Stalls:
    """SIGSTOP process ``pid`` for ``stall_s`` seconds every ``period_s`` seconds (the first stop
    ``first_s`` seconds in), from a thread, until the block ends; then SIGCONT. ``stops`` counts
    the stops."""

    def __init__(self, pid: int, stall_s: float = 2.0, period_s: float = 3.0, first_s: float = 1.0):
        self.pid, self.stall_s, self.period_s, self.first_s = pid, stall_s, period_s, first_s
        self.stops = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stalls", daemon=True)

    def _run(self) -> None:
        pause = self.first_s
        while not self._done.wait(pause):
            os.kill(self.pid, signal.SIGSTOP)
            self.stops += 1
            self._done.wait(self.stall_s)
            os.kill(self.pid, signal.SIGCONT)
            pause = self.period_s - self.stall_s

    def __enter__(self) -> "Stalls":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        os.kill(self.pid, signal.SIGCONT)
