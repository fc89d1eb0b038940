"""Sizing the worker pool to what the trainers need (config ``workers: {min, max}``).

Cachew (USENIX ATC'22) sizes a loader by the trainer's wait for data rather than by a fixed
count; batchd does the same within one server. ``Autoscaler.decide`` is a pure function of what
the pool sees each round (the clock is passed in), so its rules are tested without processes:

* **Up** (``clients_waiting``): some client is waiting for data (``Demand``: the wait ratio its
  training loop reports is at least ``WAIT_UP``, or, for a client that reports nothing, the
  stream's RPC has waited ``RPC_WAIT_UP_S`` for its next batch), the workers were busy at least
  ``BUSY_UP`` of the last ``UP_WINDOW_S`` seconds (more batches need more workers, not a faster
  client or network), fewer than ``limit`` workers run, the last change is ``UP_WINDOW_S`` old
  and every worker started is ready.
* **Down** (``idle``): no client has waited for ``cool_down_s`` seconds, more than ``min``
  workers run, the last change is ``cool_down_s`` old, and one worker fewer would have been busy
  at most ``BUSY_DOWN`` of the cool-down at that load.

``limit`` is ``max`` capped by the CPUs the workers may use (``cpu_budget``: the container's
cgroup CPU limit, cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``, else the CPUs this process may
run on; never below ``min``), so a sidecar never takes the trainer's cores. The pool
(``server/compute/pool.py``) acts on each decision, logs it with its reason and counts it
(``batchd_worker_scaling_total{direction, reason}``).
"""

from __future__ import annotations

import collections
import math
import os
import pathlib
from dataclasses import dataclass

WAIT_UP = 0.1  # a client whose loop waits this fraction of its time (or more) wants more workers
RPC_WAIT_UP_S = 0.5  # a stream whose client reports nothing: its RPC waiting this long for a batch
BUSY_UP = 0.75  # workers busy at least this fraction of the last UP_WINDOW_S: adding one helps
UP_WINDOW_S = 2.0  # ... measured over this window; also the least time between two starts
BUSY_DOWN = 0.6  # retire one if the others would have been busy at most this fraction of the cool-down


@dataclass(frozen=True, slots=True)
class Demand:
    """What the clients need now: ``waiting`` streams whose clients wait for data, and the largest
    wait ratio any client reports (0..1; 0 when none reports)."""

    waiting: int = 0
    wait_ratio: float = 0.0


@dataclass(frozen=True, slots=True)
class Decision:
    """Start (``direction`` "up") or retire ("down") one worker; ``reason`` is a Prometheus label
    ("clients_waiting", "idle"), ``why`` the sentence logged."""

    direction: str
    reason: str
    why: str


class Autoscaler:
    """When to start or retire a worker, between ``min_workers`` and ``limit``.

    cpu_quota: CPUs the workers may use (None: ``cpu_budget()``). cool_down_s: seconds without a
    waiting client before a worker is retired, and between a change and a retirement.
    The workers' busy fraction over a window is the ratio of the differences of the pool's
    cumulative (busy, alive) worker-seconds (``WorkerPool.busy_totals``) across it, so it follows
    the load within the window (a moving average over 10 s would lag it by tens of seconds).
    Raises ValueError if min_workers < 1 or max_workers < min_workers.
    """

    def __init__(self, min_workers: int, max_workers: int, *, cpu_quota: float | None = None,
                 cool_down_s: float = 30.0, now: float = 0.0):
        if min_workers < 1 or max_workers < min_workers:
            raise ValueError(f"workers: need 1 <= min <= max, got min={min_workers}, max={max_workers}")
        self.min_workers, self.max_workers = min_workers, max_workers
        self.cpu_quota = cpu_budget() if cpu_quota is None else float(cpu_quota)
        self.limit = max(min_workers, min(max_workers, math.floor(self.cpu_quota + 1e-9)))
        self.cool_down_s = cool_down_s
        self.last_change = now
        self.last_demand = now
        self._history: collections.deque[tuple[float, float, float]] = collections.deque()  # (now, busy, alive)

    @property
    def fixed(self) -> bool:
        return self.min_workers == self.limit

    def busy_over(self, window: float) -> float | None:
        """The workers' busy fraction over the last ``window`` seconds of history (at least half of
        it must be there; None otherwise)."""
        if not self._history:
            return None
        now, busy, alive = self._history[-1]
        old = next((h for h in self._history if h[0] >= now - window), self._history[0])
        if now - old[0] < 0.5 * window or alive <= old[2]:
            return None
        return min(1.0, max(0.0, (busy - old[1]) / (alive - old[2])))

    def decide(self, *, workers: int, starting: int, busy_seconds: float, alive_seconds: float, demand: Demand,
               now: float) -> Decision | None:
        """One round: ``workers`` running (``starting`` of them not ready yet), the pool's cumulative
        busy and alive worker-seconds, the clients' ``demand``; ``now`` in seconds (monotonic)."""
        self._history.append((now, busy_seconds, alive_seconds))
        keep = max(UP_WINDOW_S, self.cool_down_s) + 1.0
        while self._history[0][0] < now - keep:
            self._history.popleft()
        if demand.waiting:
            self.last_demand = now
        if self.fixed:
            return None
        busy = self.busy_over(UP_WINDOW_S)
        if (demand.waiting and busy is not None and busy >= BUSY_UP and workers < self.limit and not starting
                and now - self.last_change >= UP_WINDOW_S):
            self.last_change = now
            return Decision("up", "clients_waiting", (
                f"{demand.waiting} stream(s) waiting for data (client wait ratio up to {demand.wait_ratio:.0%}), "
                f"workers {busy:.0%} busy over {UP_WINDOW_S:g} s; {workers} -> {workers + 1} of at most "
                f"{self.limit} (max {self.max_workers}, cpu quota {self.cpu_quota:g})"))
        quiet = now - self.last_demand
        if workers <= self.min_workers or quiet < self.cool_down_s or now - self.last_change < self.cool_down_s:
            return None
        busy = self.busy_over(self.cool_down_s)
        if busy is not None and busy * workers <= BUSY_DOWN * (workers - 1):
            self.last_change = now
            return Decision("down", "idle", (
                f"no client waited for data in {quiet:.0f} s and workers were {busy:.0%} busy over it; "
                f"{workers} -> {workers - 1} (min {self.min_workers})"))
        return None


def cpu_budget(root: str | os.PathLike[str] = "/sys/fs/cgroup", proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup",
               available: int | None = None) -> float:
    """CPUs this process may use: the cgroup CPU limit when one is set (``cgroup_cpu_limit``),
    else (and at most) the CPUs it may run on (``os.sched_getaffinity``)."""
    if available is None:
        available = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    limit = cgroup_cpu_limit(root, proc_cgroup)
    return float(available) if limit is None else min(float(available), limit)


def cgroup_cpu_limit(root: str | os.PathLike[str] = "/sys/fs/cgroup",
                     proc_cgroup: str | os.PathLike[str] = "/proc/self/cgroup") -> float | None:
    """The CPU limit of this process's cgroup and its ancestors, in CPUs (quota / period: "200000
    100000" in cgroup v2's ``cpu.max`` is 2.0), the smallest found; None when none is set ("max",
    v1's -1) or the files are not there. Reads cgroup v2 (``root`` or ``root/unified``) and v1
    (``root/cpu`` or ``root/cpu,cpuacct``: ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``)."""
    root = pathlib.Path(root)
    try:
        lines = pathlib.Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return None
    limits: list[float] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2
            for mount in (root, root / "unified"):
                limits += _along(mount, rel, _v2_limit)
        elif "cpu" in controllers.split(","):  # v1
            for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                limits += _along(mount, rel, _v1_limit)
    return min(limits) if limits else None


def _along(mount: pathlib.Path, rel: str, read) -> list[float]:
    """Limits in the cgroup at ``mount/rel`` and each of its ancestors up to ``mount``."""
    if not mount.is_dir():
        return []
    out, here = [], mount / rel if rel else mount
    while True:
        limit = read(here)
        if limit is not None:
            out.append(limit)
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _v2_limit(folder: pathlib.Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _v1_limit(folder: pathlib.Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
