"""Hedged grants: a batch late from its server is also granted to another one, within a budget.

A loader of several servers (``batchd.client.feed``) grants each batch index to one server's
``Batches`` call and yields the batches in order, so a server that stalls (a long pause, a noisy
neighbour, SIGSTOP) holds every batch after its own. A hedge ("The Tail at Scale", Dean and
Barroso, 2013) grants that batch on another server's call too; the first copy to arrive is
used, the other grant is revoked, and a copy that arrives anyway is dropped (its lease
released). Batch b's bytes are a pure function of the request and b, so they are the same
whichever server sent them, and each batch is yielded once.

When (``HedgePolicy``). The yardstick is the pace of the *healthy* servers, never the late
server's own history: a server that stalls again and again would make the stall its own
percentile and never be late again (measured before this design: ``hedges_issued`` stayed 0
while one of two servers stalled 2 s of every 3 s). The batch the loop waits for next is late
once its age (seconds since it was granted) exceeds

    max(min_delay, factor x P),  P = the ``percentile``-th percentile of the latencies (grant to
    arrival) of the *other* servers' recent batches.

Every server's window is sized to one common horizon (``batchd.client.windows``), so a healthy
server's latency is about that horizon whatever its speed, and the others' latency is a fair
yardstick. A server whose oldest grant is late in that sense is *stalled*: it gets no new grants
until something arrives from it. When the batch the loop waits for is late, it is hedged, and
(``chase``) so is every other batch the stalled server holds, oldest first.

Budget: a token bucket. It starts empty, gains ``max_fraction`` per batch yielded (up to
``burst``) and pays 1 per hedge, so the hedges issued never exceed ``max_fraction`` x the
batches yielded (10% by default), and at most ``burst`` go out back to back. Counters in
``loader.stats()``: ``hedges_issued``, ``hedges_won`` (the hedge's copy came first),
``hedges_wasted`` (the other copy came first; the hedge was revoked), per server and in total.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When a several-servers loader grants a late batch to a second server, and how often.

    percentile, factor, min_delay: the batch the loop waits for is late once its age (seconds
        since it was granted) exceeds ``max(min_delay, factor x the percentile-th percentile of
        the other servers' recent grant-to-arrival latencies)`` (defaults: the median, x2, at
        least 0.05 s). Never compared with the late server's own latencies.
    window: recent latencies kept per server (batches; default 100).
    warmup: batches the other servers must have delivered before anything is hedged (default 5:
        the first ones include connecting and the workers' start).
    max_fraction: the budget: hedges issued never exceed ``max_fraction`` x batches yielded
        (default 0.1: 10%).
    burst: the budget's bucket capacity, hedges that may go out back to back (default 10).
    chase: once a server is found stalled, hedge every batch it holds (oldest first, within the
        budget), not only the one the loop waits for (default True).

    Raises ValueError naming a field out of range.
    """

    percentile: float = 50.0
    factor: float = 2.0
    min_delay: float = 0.05
    window: int = 100
    warmup: int = 5
    max_fraction: float = 0.1
    burst: float = 10.0
    chase: bool = True

    def __post_init__(self) -> None:
        checks = (("percentile", 0 < self.percentile <= 100), ("factor", self.factor > 0),
                  ("min_delay", self.min_delay >= 0), ("window", isinstance(self.window, int) and self.window >= 1),
                  ("warmup", isinstance(self.warmup, int) and self.warmup >= 1),
                  ("max_fraction", 0 <= self.max_fraction <= 1), ("burst", self.burst >= 1))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"HedgePolicy.{name} is out of range: {getattr(self, name)!r}")

    def late_after(self, others: Iterable[Any]) -> float | None:
        """Seconds of age after which a batch of a server is late, from ``others`` (the other
        working servers' latency deques, seconds); None while they have fewer than ``warmup``
        latencies together (nothing is late yet)."""
        pooled = [x for lat in others for x in lat]
        if len(pooled) < self.warmup:
            return None
        return max(self.min_delay, self.factor * float(np.percentile(pooled, self.percentile)))


def hedge_policy(hedge: Any) -> HedgePolicy | None:
    """``RemoteDataLoader(hedge=...)``: True -> the default policy, False/None -> no hedging, or a
    ``HedgePolicy``. Raises ValueError for anything else."""
    if hedge is True:
        return HedgePolicy()
    if hedge is False or hedge is None:
        return None
    if isinstance(hedge, HedgePolicy):
        return hedge
    raise ValueError(f"hedge must be True, False or a batchd.client.hedge.HedgePolicy, not {hedge!r}")


class Budget:
    """The token bucket of one loader (module docstring): ``earn()`` per batch yielded, ``spend()``
    per hedge. Not thread-safe (the feed calls it under its lock)."""

    __slots__ = ("policy", "tokens")

    def __init__(self, policy: HedgePolicy):
        self.policy = policy
        self.tokens = 0.0

    def earn(self, batches: int = 1) -> None:
        self.tokens = min(self.policy.burst, self.tokens + self.policy.max_fraction * batches)

    def can_spend(self) -> bool:
        return self.tokens >= 1.0 - 1e-9

    def spend(self) -> bool:
        """Pay for one hedge; False (nothing paid) when the bucket holds less than one token."""
        if not self.can_spend():
            return False
        self.tokens = max(0.0, self.tokens - 1.0)
        return True

