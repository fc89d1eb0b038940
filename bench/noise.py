"""How much CPU other processes on the machine used while we measured (the machine is shared).

A background thread samples /proc every 0.5 s and adds up the CPU time of every process that is
not this one or under it. A process that lives less than one sample interval is missed, so the
figure is a lower bound.
"""

from __future__ import annotations

import os
import threading

_TCK = os.sysconf("SC_CLK_TCK")


def _scan() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _TCK)
    return out


class NoiseMeter(threading.Thread):
    def __init__(self, interval: float = 0.5):
        super().__init__(name="bench-noise", daemon=True)
        self.interval = interval
        self.me = os.getpid()
        self.foreign = 0.0
        self._last: dict[int, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._sample(first=True)

    def _ours(self, pid: int, procs) -> bool:
        seen = 0
        while pid > 1 and seen < 64:
            if pid == self.me:
                return True
            pid = procs.get(pid, (0, 0))[0]
            seen += 1
        return False

    def _sample(self, first: bool = False) -> None:
        procs = _scan()
        added = 0.0
        last = {}
        for pid, (_, cpu) in procs.items():
            last[pid] = cpu
            if first or self._ours(pid, procs):
                continue
            added += cpu - self._last.get(pid, 0.0)  # a new process: all its CPU so far
        with self._lock:
            self.foreign += max(0.0, added)
            self._last = last

    def run(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def seconds(self) -> float:
        """Foreign CPU seconds since the meter was created."""
        with self._lock:
            return self.foreign

    def stop(self) -> None:
        self._stop.set()
