"""Who builds which batch: the assigner of one iteration (dynamic work, deterministic output).

Batch b of an epoch is a pure function of the request and b, whichever server builds it, so the
loader may hand out batch indices as servers have room for them and put the batches back in
order (tf.data service's dynamic sharding, with the determinism it lacks). ``Assigner`` is that
decision, on plain objects (no threads, no network, no clock of its own: ``now`` is passed in).
This file holds its bookkeeping: who holds a grant of which batch, which copy arrived first,
what the loop took; the rest of it is in its own files:

* **Lanes** (``batchd.client.lane``). One ``Lane`` per server of the iteration: its grants
  outstanding (granted, not arrived, not revoked), whether its call is open, whether it is
  stalled, and its ``Pace`` (``batchd.client.pace``, kept across iterations: its rate and
  latencies).
* **Windows and lookahead** (``batchd.client.windows``, mixed in). A lane may hold ``window``
  grants outstanding, sized to its rate over one common horizon; indices are granted in order,
  each to the lane that will finish it soonest, never ``lookahead`` or more past the next batch
  the loop takes (``base``). Batches of a lane that went down come first (``lost``).
* **Homes.** Batch b's *home* is the (b mod n)-th of the n working servers in the order of their
  addresses, the same in every loader that reads from them. A batch goes home rather than to the
  lane that would finish it soonest when its home has room and would finish it at most one of its
  own batches later. Identical loaders over the same servers (experiments sharing them) then
  mostly grant a batch to the same server, where their calls share one computation and it is
  built once; when one server is faster, the soonest finish still decides and the shares follow
  the speeds. (With every window full, a batch goes to the first lane with room, whatever its
  home: loaders that read as fast as the servers build share less.)
* **Stride** (``mode="stride"``, for the benchmark's comparison with the old split only): lane i
  of n (in the order they were added) is granted exactly the batches b with ``(b - start) % n ==
  i``, ``floor`` ahead; a lane that goes down leaves its batches to whoever has room.
* **Late batches** (``batchd.client.lateness``, mixed in; the rule is ``batchd.client.hedge``'s):
  a lane whose oldest grant is late is stalled, and the batch the loop waits for is hedged to
  another lane, within the ``Budget``. The first copy to arrive wins (``arrived``); the other
  grants are revoked, but for a stalled lane's oldest one (its *probe*).

Thread-safety: none; the feed calls it under its one lock.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from typing import Any, Callable, Hashable

from batchd.client.hedge import Budget, HedgePolicy
from batchd.client.lane import Lane
from batchd.client.lateness import Lateness
from batchd.client.pace import Pace
from batchd.client.windows import MAX_LOOKAHEAD, Windows

MODES = ("dynamic", "stride")


@dataclass(frozen=True, slots=True)
class Arrival:
    """What ``Assigner.arrived`` decided: ``keep`` the batch (the first copy), or drop it; the
    grants to revoke (lane key -> batches), the other copies' now that this one came."""

    keep: bool
    revoke: dict[Hashable, list[int]]


class Assigner(Windows, Lateness):
    """The batches start .. total - 1 of one iteration, handed out to lanes (module docstring).

    policy, budget: hedging (None: never). floor: the smallest window (the loader's prefetch).
    mode: "dynamic" or "stride". count(name): told of each "hedges_issued", "hedges_won" and
    "hedges_wasted" (``LoaderStats.count``). Raises ValueError for a bad mode or range.
    """

    def __init__(self, start: int, total: int, *, floor: int = 2, policy: HedgePolicy | None = None,
                 budget: Budget | None = None, mode: str = "dynamic", max_lookahead: int = MAX_LOOKAHEAD,
                 count: Callable[[str], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"assignment must be one of {MODES}, got {mode!r}")
        if not 0 <= start <= total:
            raise ValueError(f"batches {start} .. {total} is not a range")
        self.start, self.total, self.floor, self.mode = start, total, max(1, floor), mode
        self.policy, self.budget = policy, budget if budget is not None or policy is None else Budget(policy)
        self.max_lookahead = max(2, max_lookahead)
        self.lanes: dict[Hashable, Lane] = {}
        self.base = start  # the next batch the loop takes
        self.next_new = start  # the lowest batch never granted (stride: never granted nor skipped)
        self._lost: list[int] = []  # heap: batches granted to lanes that went down, to grant again
        self._holders: dict[int, set[Hashable]] = {}  # batch -> lanes holding a grant of it
        self._arrived: dict[int, Hashable] = {}  # batch (>= base) -> the lane whose copy is kept
        self._ahead: set[int] = set()  # stride: batches >= next_new granted already
        self._order = 0
        self._stride: list[Hashable] = []  # stride: the lanes in order
        self.batch_bytes = 0.0  # a batch's message size, moving (bytes)
        self._count = count or (lambda name: None)
        # the loop's pace (Windows)
        self._step: float | None = None  # the loop's seconds per batch besides waiting, moving
        self._handed_at: float | None = None  # when the loop got its latest batch
        # lateness (Lateness)
        self._thresholds: dict[Hashable, float | None] = {}  # lane -> threshold, computed at _thresholds_at
        self._thresholds_at = -math.inf

    # --- lanes ---------------------------------------------------------------------------------

    def add_lane(self, key: Hashable, pace: Pace, lease_limit: int | None = None, home: str | None = None) -> Lane:
        """A server joins the iteration (not yet open: ``open_lane`` once its call is up). home:
        its name as every loader knows it (its address), for batches' homes (``_pick``)."""
        lane = Lane(key, pace, self._order, lease_limit, home)
        self._order += 1
        self.lanes[key] = lane
        self._stride.append(key)
        self._size(lane)
        return lane

    def open_lane(self, key: Hashable) -> list[int]:
        """The lane's (new) call is up. Returns its outstanding batches, in order, to grant again
        on it (a broken call lost them)."""
        lane = self.lanes[key]
        lane.open = True
        return sorted(lane.outstanding)

    def close_lane(self, key: Hashable) -> None:
        """The lane's call broke (it may come back): no new grants; its outstanding ones stay."""
        lane = self.lanes.get(key)
        if lane is not None:
            lane.open = False

    def remove_lane(self, key: Hashable) -> list[int]:
        """The lane is down, or left: its outstanding batches that no other lane holds are granted
        again first (to whoever has room). Returns them."""
        lane = self.lanes.pop(key, None)
        if lane is None:
            return []
        lost = []
        for b in lane.outstanding:
            holders = self._holders.get(b)
            if holders is not None:
                holders.discard(key)
                if not holders:
                    del self._holders[b]
                    lost.append(b)
        for b in lost:
            heapq.heappush(self._lost, b)
        return sorted(lost)

    def working(self) -> list[Lane]:
        return [lane for lane in self.lanes.values() if lane.open]


    # --- granting ------------------------------------------------------------------------------

    def plan(self, now: float) -> dict[Hashable, list[int]]:
        """New grants for the lanes with room: lane key -> batch indices (in order). Records them."""
        grants: dict[Hashable, list[int]] = {}
        working = [lane for lane in self.working() if not lane.stalled]
        if not working:
            return grants
        horizon = self.horizon()
        for lane in working:
            self._size(lane, horizon)
        limit = min(self.total, self.base + self.lookahead(now))
        while self._lost:  # first what lanes that went down held
            lane = self._pick(working, self._lost[0])
            if lane is None:
                return grants
            self._grant(lane, heapq.heappop(self._lost), now, grants)
        if self.mode == "stride":
            self._plan_stride(working, limit, now, grants)
            return grants
        while self.next_new < limit:
            lane = self._pick(working, self.next_new)
            if lane is None:
                break
            self._grant(lane, self.next_new, now, grants)
            self.next_new += 1
        return grants

    def _plan_stride(self, working: list[Lane], limit: int, now: float, grants: dict) -> None:
        for b in range(self.next_new, limit):
            if b in self._ahead:
                continue
            owner = self._stride_owner(b)
            if owner is not None:
                if not owner.open or owner.stalled or owner.room(b) <= 0:
                    continue  # its own batch: it waits (for its call, or for room)
                lane = owner
            else:  # (its owner left: whoever has room)
                lane = self._pick(working, b)
                if lane is None:
                    continue
            self._grant(lane, b, now, grants)
            self._ahead.add(b)
        while self.next_new in self._ahead:
            self._ahead.discard(self.next_new)
            self.next_new += 1

    def _stride_owner(self, b: int) -> Lane | None:
        """Under stride, the lane whose batches include b (None when it left, or no lane was added)."""
        return self.lanes.get(self._stride[(b - self.start) % len(self._stride)]) if self._stride else None

    def _pick(self, working: list[Lane], b: int) -> Lane | None:
        """The lane with room for batch b that would finish it soonest (unknown rates: the one
        with the fewest grants), unless b's home lane has room and would finish it at most one of
        its own batches later: then the home lane (module docstring, *Homes*)."""
        best, best_key = None, None
        default = self._default_rate(working)
        for lane in working:
            if lane.room(b) <= 0:
                continue
            key = (lane.expected(default), len(lane.outstanding), lane.order)
            if best_key is None or key < best_key:
                best, best_key = lane, key
        if best is None or len(working) < 2:
            return best
        home = self._home(working, b)
        if home is not None and home is not best and home.room(b) > 0:
            rate = home.pace.rate or default
            if home.expected(default) <= best_key[0] + (1 / rate if rate > 0 else math.inf):
                return home
        return best

    @staticmethod
    def _home(working: list[Lane], b: int) -> Lane | None:
        """Batch b's home among the working lanes: the (b mod n)-th by home name (None unless every
        lane has a name)."""
        if any(lane.home is None for lane in working):
            return None
        return sorted(working, key=lambda lane: lane.home)[b % len(working)]

    @staticmethod
    def _default_rate(lanes: list[Lane]) -> float:
        """The rate a lane not measured yet is taken to have: the others' mean (as fast as they
        are, so that it gets work and is measured), 0.0 when none is measured."""
        rates = [lane.pace.rate for lane in lanes if lane.pace.rate > 0]
        return sum(rates) / len(rates) if rates else 0.0

    def _grant(self, lane: Lane, b: int, now: float, grants: dict, hedge: bool = False) -> None:
        if not lane.outstanding:
            lane.busy_since = now
        lane.outstanding[b] = now
        if hedge:
            lane.hedges.add(b)
        self._holders.setdefault(b, set()).add(lane.key)
        grants.setdefault(lane.key, []).append(b)

    # --- arrivals --------------------------------------------------------------------------------

    def arrived(self, key: Hashable, b: int, now: float, work: float = 0.0, nbytes: int = 0) -> Arrival:
        """Batch b came from lane ``key``: keep it if it is the first copy (and was granted), else
        drop it. ``work``: its worker seconds (``BatchTimings``); ``nbytes``: its message size."""
        lane = self.lanes.get(key)
        if lane is None:
            return Arrival(False, {})
        granted_at = lane.outstanding.pop(b, None)
        was_hedge = b in lane.hedges
        lane.hedges.discard(b)
        holders = self._holders.get(b)
        if holders is not None:
            holders.discard(key)
        lane.stalled = False  # it lives
        if granted_at is None or b < self.base or b in self._arrived:
            lane.duplicates += 1
            if was_hedge:
                lane.hedges_wasted += 1
                self._count("hedges_wasted")
            if holders is not None and not holders:
                del self._holders[b]
            lane.last_arrival = now
            return Arrival(False, {})
        self._arrived[b] = key
        lane.held.add(b)
        lane.delivered += 1
        if nbytes:
            self.batch_bytes = nbytes if not self.batch_bytes else 0.8 * self.batch_bytes + 0.2 * nbytes
        revoke: dict[Hashable, list[int]] = {}
        for other in holders or ():
            other_lane = self.lanes.get(other)
            if other_lane is None:
                continue
            if other_lane.stalled and b == min(other_lane.outstanding):
                continue  # kept as its probe: the copy arriving (dropped) says it lives again
            other_lane.outstanding.pop(b, None)
            if b in other_lane.hedges:
                other_lane.hedges.discard(b)
                other_lane.hedges_wasted += 1  # its hedge lost
                self._count("hedges_wasted")
            revoke.setdefault(other, []).append(b)
        self._holders.pop(b, None)
        if was_hedge:
            lane.hedges_won += 1
            self._count("hedges_won")
        threshold = self._threshold(lane, now)
        late = was_hedge or bool(revoke) or (threshold is not None and now - granted_at > threshold)
        if not late:  # (a late batch is not counted in the pace: a stall would raise the bar)
            # the gap since the previous batch, or since the lane got work after it ran dry; not
            # for its first batch of the iteration (that one includes opening the call)
            since = None
            if lane.last_arrival is not None and lane.busy_since is not None:
                since = max(lane.last_arrival, lane.busy_since)
            lane.pace.record(None if since is None else now - since, now - granted_at, work)
        lane.last_arrival = now
        return Arrival(True, revoke)

    def take(self, b: int) -> Hashable:
        """The loop takes batch b (it must be ``base`` and have arrived): returns the lane key it
        came from. The lookahead moves on; the budget earns its share."""
        if b != self.base or b not in self._arrived:
            raise RuntimeError(f"batch {b} taken out of order (next is {self.base}, arrived: {b in self._arrived})")
        key = self._arrived.pop(b)
        lane = self.lanes.get(key)
        if lane is not None:
            lane.held.discard(b)
        self.base += 1
        if self.budget is not None:
            self.budget.earn()
        return key

    def requeue(self, b: int) -> None:
        """Batch b arrived but cannot be used (its shared-memory slot went with a restarted
        server): it is granted again, first, to whoever has room."""
        key = self._arrived.pop(b, None)
        if key is None:
            return
        lane = self.lanes.get(key)
        if lane is not None:
            lane.held.discard(b)
            lane.delivered -= 1
        heapq.heappush(self._lost, b)

    def arrived_from(self, key: Hashable) -> list[int]:
        """The batches of lane ``key`` that arrived and wait to be taken."""
        return sorted(b for b, k in self._arrived.items() if k == key)

    def has(self, b: int) -> bool:
        """Whether batch b arrived (and was kept) and is not taken yet."""
        return b in self._arrived

    def holders(self, b: int) -> list[Lane]:
        return [self.lanes[k] for k in self._holders.get(b, ()) if k in self.lanes]

    @property
    def done(self) -> bool:
        return self.base >= self.total

    def outstanding(self) -> int:
        return sum(len(lane.outstanding) for lane in self.lanes.values())

    def figures(self) -> dict[Hashable, dict[str, Any]]:
        """Per lane: batches it sent first this iteration, its window, grants outstanding,
        whether it is stalled, its rate (batches/s), its hedges issued / won / wasted."""
        return {k: {"batches": lane.delivered, "window": lane.window, "outstanding": len(lane.outstanding),
                    "stalled": lane.stalled, "rate": lane.pace.rate, "hedges_issued": lane.hedges_issued,
                    "hedges_won": lane.hedges_won, "hedges_wasted": lane.hedges_wasted,
                    "duplicates": lane.duplicates}
                for k, lane in self.lanes.items()}
