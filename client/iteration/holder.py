"""One server as the rule sees it (batchd.client.iteration.credit): what it can build
(``Capacity``, as it says, kept across passes) and its state in one pass (``Holder``: its grants,
its credit, whether it is stalled), with the questions the rule asks of it."""

from __future__ import annotations

import collections
import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Hashable

DEFAULT_BUILD_S = 0.1  # a server's seconds per batch while none is measured (seconds)
STALL_FACTOR = 2.0  # a grant is late past this many times the latency its server's capacity implies
STALL_SLACK_S = 0.1  # ... plus this (scheduling, a garbage collection, the network; seconds)
_BUILD_WINDOW = 32  # recent batches whose build times make a server's median


class Capacity:
    """What one server can build, as it says: ``workers`` (its worker processes) and
    ``build_time``, the median worker seconds per batch of its recent batches (None before its
    first); ``max_leases`` over shared memory (None otherwise), and ``leases_held()``: how many of
    its session's leases are not released yet (batches waiting to be taken, the loop's, and those
    freed that ride on the next grant). Kept across passes (``Servers.capacity``)."""

    __slots__ = ("workers", "max_leases", "leases_held", "build_time", "_builds")

    def __init__(self, workers: int = 1, max_leases: int | None = None,
                 leases_held: Callable[[], int] = lambda: 0):
        self.workers = max(1, workers)
        self.max_leases = max_leases
        self.leases_held = leases_held
        self.build_time: float | None = None
        self._builds: collections.deque[float] = collections.deque(maxlen=_BUILD_WINDOW)

    def record(self, seconds: float, workers: int = 0) -> None:
        """A batch of this server arrived: its worker ``seconds`` (read + decode + pipeline + cache
        + write, 0: unknown) and the server's ``workers`` when it was sent (0: unknown)."""
        if workers > 0:
            self.workers = workers
        if seconds > 0:
            self._builds.append(seconds)
            self.build_time = statistics.median(self._builds)


@dataclass(eq=False)
class Holder:
    """One server in one pass: the batches granted to it and not arrived (``outstanding``: batch
    -> when granted, monotonic s), its state; and the questions the rule asks of it."""

    key: Hashable
    capacity: Capacity
    home: str
    open: bool = False  # its call is up for this pass: it may be granted batches
    stalled: bool = False
    probe: int | None = None  # a stalled server's one grant left
    outstanding: dict[int, float] = field(default_factory=dict)
    credit: int = 1
    # this pass's counts (``Credit.figures``)
    delivered: int = 0  # batches it sent first
    duplicates: int = 0  # copies it sent after another (dropped)
    stalls: int = 0  # times it was found stalled
    regranted: int = 0  # its batches granted to another server when it stalled or went

    def build_time(self, default: float) -> float:
        t = self.capacity.build_time
        return t if t is not None else default

    def delivery(self, default: float) -> float:
        """Seconds until it would deliver one more batch granted now (its queue, then that one)."""
        return (len(self.outstanding) // self.capacity.workers + 1) * self.build_time(default)

    def deadline(self, default: float) -> float:
        """Seconds after which its oldest grant is late (module docstring, *Stalls*); a server not
        measured yet gets at least ``DEFAULT_BUILD_S`` per batch."""
        rounds = math.ceil(self.credit / self.capacity.workers) + 1
        return STALL_FACTOR * rounds * self.build_time(max(default, DEFAULT_BUILD_S)) + STALL_SLACK_S

    def room(self, b: int, base: int) -> bool:
        """Whether batch b may be granted to it now: free credit, and over shared memory a lease
        for it that leaves one for the batch the loop waits for (``base``), which is granted
        whatever the leases (the batches the loop holds wait for it, and it frees them).

        The leases counted are what the server counts: its grants, and every lease of its
        session not released yet (``Capacity.leases_held``). A batch granted past them would take
        the lease ``base`` needs; the server, at its cap, then holds ``base`` back for a lease only
        ``base`` can free, until its ``LEASE_WAIT_S`` (2 s) runs out and it copies it inline: a
        loop that keeps its last batches saw that whenever the server finished a later batch
        first. So only ``base`` can bring the server to its cap (``at_lease_cap``)."""
        if self.stalled or not self.open or len(self.outstanding) >= self.credit:
            return False
        leases = self.capacity.max_leases
        if leases is None or b == base:
            return True
        spoken_for = len(self.outstanding) + (base not in self.outstanding)
        return spoken_for + self.capacity.leases_held() < leases

    def at_lease_cap(self) -> bool:
        """Whether its grants and the leases not released reach its cap: it may hold a batch back
        until one comes back (the loop, about to wait, sends what it freed at once: else those
        ride on the next grant, as ``room`` leaves the server a lease for each)."""
        leases = self.capacity.max_leases
        return leases is not None and len(self.outstanding) + self.capacity.leases_held() >= leases
