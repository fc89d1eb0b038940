"""One server in one iteration, as the assigner sees it: ``Lane`` (its grants, window and state).

The assigner (``batchd.client.assign``) keeps one ``Lane`` per server of the iteration: the
batches granted to it and not arrived nor revoked (``outstanding``, with when each was granted),
which of them are hedges, whether its call is open and whether it is stalled, the batches it
sent first that wait to be taken (``held``), its window (sized by ``batchd.client.windows``),
its ``Pace`` (``batchd.client.pace``, the server's, kept across iterations) and this iteration's
counts (``Assigner.figures``). Its methods answer the questions granting asks of one lane: room
for a batch (window and, over shared memory, leases) and when it would deliver one more.

Thread-safety: none; the assigner is called under the feed's one lock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Hashable

from batchd.client.pace import Pace


@dataclass(eq=False)
class Lane:
    """One server in one iteration. ``key``: the caller's handle (its server)."""

    key: Hashable
    pace: Pace
    order: int  # its place among the lanes (stride mode)
    lease_limit: int | None = None  # shared memory: grants + batches waiting here stay below it
    home: str | None = None  # a name every loader gives this server alike (its address): batches' homes
    outstanding: dict[int, float] = field(default_factory=dict)  # batch -> when granted (monotonic s)
    hedges: set[int] = field(default_factory=set)  # of outstanding: granted as hedges
    open: bool = False  # a call is up: it may be granted batches
    stalled: bool = False  # its oldest grant is late: no new grants until something arrives
    held: set[int] = field(default_factory=set)  # batches it sent first that wait here (not yet taken)
    window: int = 1
    last_arrival: float | None = None
    busy_since: float | None = None  # when it last went from no grant to some
    delivered: int = 0  # batches of this iteration it sent first
    hedges_issued: int = 0
    hedges_won: int = 0
    hedges_wasted: int = 0
    duplicates: int = 0  # copies that arrived after another (dropped)

    def room(self, b: int | None = None) -> int:
        """Grants it may take now (negative: a hedge took it past its window), for batch ``b``:
        over shared memory its leases limit it too, unless ``b`` comes before every batch it
        holds here (those wait for b: refusing it would deadlock the loop on its own leases)."""
        room = self.window - len(self.outstanding)
        if self.lease_limit is not None and not (b is not None and self.held and b < min(self.held)):
            room = min(room, self.lease_limit - len(self.held) - len(self.outstanding))
        return room

    def lease_room(self, b: int) -> bool:
        """Whether a hedge of ``b`` may go to it (its window may be exceeded, its leases not, as
        in ``room``)."""
        if self.lease_limit is None or (self.held and b < min(self.held)):
            return True
        return self.lease_limit - len(self.held) - len(self.outstanding) > 0

    def expected(self, default_rate: float) -> float:
        """Seconds until it would deliver one more batch granted now (its queue, then that one);
        ``default_rate`` stands for its rate while it has none (a server that just joined)."""
        rate = self.pace.rate or default_rate
        return (len(self.outstanding) + 1) / rate if rate > 0 else math.inf
