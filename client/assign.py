"""Who builds which batch: the assigner of one iteration (dynamic work, deterministic output).

Batch b of an epoch is a pure function of the request and b, whichever server builds it, so the
loader may hand out batch indices as servers have room for them and put the batches back in
order (tf.data service's dynamic sharding, with the determinism it lacks). ``Assigner`` is that
decision, on plain objects (no threads, no network, no clock of its own: ``now`` is passed in):

* **Lanes.** One per server of the iteration (``Lane``): its grants outstanding (granted, not
  arrived, not revoked), whether its call is open, whether it is stalled, and its ``Pace`` (kept
  across iterations: its rate and latencies).
* **Windows (credits).** A lane may hold ``window`` grants outstanding. Windows are sized to one
  common *horizon* H, in seconds: ``window = ceil(rate x H)`` (at least ``floor``, the loader's
  ``prefetch``; at most ``MAX_WINDOW``; 1 for a server that joins while the others' rates are
  known, until its own is: its first batch includes its start), where rate is the server's measured rate (batches per
  second while it had work) and H = max(``MIN_HORIZON_S``, the slowest server's median worker
  time per batch + ``HEADROOM_S``). A server then has enough in flight to keep its workers busy
  (rate x worker time = busy workers; a window that limits it grows by at least one per batch)
  and no more, and every healthy server's grant-to-arrival latency is about H, whatever its
  speed: what makes one server's latency a yardstick for another's (``batchd.client.hedge``).
  A lane over shared memory also keeps its grants plus the batches it sent that wait here below
  ``lease_limit`` (the server's lease cap per session, less what the loop and the converter
  hold): a server at its cap would wait for a lease the loop cannot free while it waits for a
  batch.
* **Lookahead.** Indices are granted in order, each to the lane that will finish it soonest
  (``(outstanding + 1) / rate``), never ``lookahead`` or more past the next batch the loop takes
  (``base``): memory and leases stay bounded. The lookahead is what keeps every window full with
  as much again arrived (2 x the windows), but no more than the loop needs: about 2 x H of its
  own pace (a loop that steps slower than the servers build gets fewer batches ahead), at least
  ``floor`` per lane (each server ``prefetch`` ahead; all there is before the loop's first step),
  at most ``MAX_LOOKAHEAD`` batches and ``MAX_LOOKAHEAD_BYTES``. Batches of a lane that went down
  come first (``lost``).
* **Stride** (``mode="stride"``, for the benchmark's comparison with the old split only): lane i
  of n (in the order they were added) is granted exactly the batches b with ``(b - start) % n ==
  i``, ``floor`` ahead; a lane that goes down leaves its batches to whoever has room.
* **Late batches** (``check``): with a ``HedgePolicy`` and two lanes or more, a lane whose oldest
  grant is older than its threshold (``threshold``) is *stalled* (no new grants until something
  arrives from it), and when the batch the loop waits for (``base``) is late, it is granted to
  another lane too (a hedge), and so (``chase``) is every batch the stalled lane holds, within
  the ``Budget``. The first copy to arrive wins (``arrived``); the other grants are revoked, but
  for a stalled lane's oldest one: that one stays granted as its *probe* (most likely being built
  already), and its copy arriving, dropped, is how the loader learns that the lane lives again.
  Revoking it too would leave a lane that resumed with nothing to send and nothing granted.

Thread-safety: none; the feed calls it under its one lock.
"""

from __future__ import annotations

import collections
import heapq
import math
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable


from batchd.client.hedge import Budget, HedgePolicy

MIN_HORIZON_S = 0.1  # the shortest horizon a window is sized to (seconds)
HEADROOM_S = 0.05  # beyond the slowest worker time: the round trip and this loader's reaction (seconds)
MAX_WINDOW = 32  # grants one server may hold (batches)
MAX_LOOKAHEAD = 64  # batches granted past the one the loop takes next, at most
MAX_LOOKAHEAD_BYTES = 1 << 30  # ... and at most about this many bytes of them
_RATE_ALPHA = 0.25  # weight of a new gap in a server's mean gap between batches
_THRESHOLDS_EVERY_S = 0.05  # lateness thresholds are recomputed at most this often (seconds)
MODES = ("dynamic", "stride")


class Pace:
    """What the loader knows of one server's speed, kept across its iterations.

    rate: batches per second while it had grants outstanding (1 / the moving mean gap between
    its batches; a batch that arrived late is not counted, so a server that stalls does not
    lower its own bar); 0.0 before any. work: its workers' seconds per batch (``BatchTimings``:
    read + decode + pipeline + cache + write), recent. latencies: grant-to-arrival seconds of its
    recent batches (the yardstick of the others' lateness, ``HedgePolicy.late_after``).
    """

    __slots__ = ("rate", "work", "latencies", "_gap", "_work_time")

    def __init__(self, window: int = 100):
        self.rate = 0.0
        self.work: collections.deque[float] = collections.deque(maxlen=32)
        self.latencies: collections.deque[float] = collections.deque(maxlen=window)
        self._gap: float | None = None
        self._work_time = 0.0  # the median of ``work``, kept as batches arrive (read several times per batch)

    def record(self, gap: float | None, latency: float, work: float) -> None:
        """One batch arrived on time: ``gap`` seconds after the previous one (or after the server
        got work; None: unknown), ``latency`` seconds after its grant, ``work`` worker seconds."""
        if gap is not None and gap >= 0:  # (0: two batches at once, from two workers)
            self._gap = gap if self._gap is None else (1 - _RATE_ALPHA) * self._gap + _RATE_ALPHA * gap
            if self._gap > 0:
                self.rate = 1.0 / self._gap
        self.latencies.append(latency)
        if work > 0:
            self.work.append(work)
            self._work_time = statistics.median(self.work)

    @property
    def work_time(self) -> float:
        """Median worker seconds per batch (0.0 unknown)."""
        return self._work_time


@dataclass(eq=False)
class Lane:
    """One server in one iteration. ``key``: the caller's handle (its server)."""

    key: Hashable
    pace: Pace
    order: int  # its place among the lanes (stride mode)
    lease_limit: int | None = None  # shared memory: grants + batches waiting here stay below it
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


@dataclass(frozen=True, slots=True)
class Arrival:
    """What ``Assigner.arrived`` decided: ``keep`` the batch (the first copy), or drop it; the
    grants to revoke (lane key -> batches), the other copies' now that this one came."""

    keep: bool
    revoke: dict[Hashable, list[int]]


class Assigner:
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
        self._step: float | None = None  # the loop's seconds per batch besides waiting, moving
        self._handed_at: float | None = None  # when the loop got its latest batch
        self._thresholds: dict[Hashable, float | None] = {}  # lane -> threshold, computed at _thresholds_at
        self._thresholds_at = -math.inf

    # --- lanes ---------------------------------------------------------------------------------

    def add_lane(self, key: Hashable, pace: Pace, lease_limit: int | None = None) -> Lane:
        """A server joins the iteration (not yet open: ``open_lane`` once its call is up)."""
        lane = Lane(key, pace, self._order, lease_limit)
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

    # --- sizing --------------------------------------------------------------------------------

    def horizon(self) -> float:
        """Seconds of work every window is sized to (module docstring)."""
        work = max((lane.pace.work_time for lane in self.lanes.values()), default=0.0)
        return max(MIN_HORIZON_S, work + HEADROOM_S)

    def _size(self, lane: Lane, horizon: float | None = None) -> None:
        if self.mode == "stride":
            lane.window = self.floor
            return
        rate = lane.pace.rate
        if rate <= 0 and any(other.pace.rate > 0 for other in self.lanes.values()):
            lane.window = 1  # joined a running iteration: one batch until its pace is known (its first is slow)
            return
        want = math.ceil(rate * (self.horizon() if horizon is None else horizon)) if rate > 0 else 0
        lane.window = max(self.floor, min(MAX_WINDOW, want))

    def lookahead(self, now: float | None = None) -> int:
        """Batches that may be granted past ``base`` now (module docstring, *Lookahead*)."""
        working = self.working()
        windows = sum(lane.window for lane in working)
        least = max(2, self.floor * len(working))  # each server ``prefetch`` ahead, as a lone server would be
        ahead = max(2 * windows, windows + len(working) + 1)  # every window full, and as much arrived
        step = self.demand_step(now)
        if step is None:
            ahead = least  # (no step of the loop seen yet: it may be slow)
        elif step > 0:
            ahead = min(ahead, math.ceil(2 * self.horizon() / step) + len(working))
        if self.batch_bytes > 0:
            ahead = min(ahead, int(MAX_LOOKAHEAD_BYTES // self.batch_bytes))
        return max(least, min(self.max_lookahead, ahead))

    def asked(self, now: float) -> None:
        """The loop asked for its next batch: the step since the last one counts in its pace."""
        if self._handed_at is not None:
            step = max(0.0, now - self._handed_at)
            self._step = step if self._step is None else (1 - _RATE_ALPHA) * self._step + _RATE_ALPHA * step
            self._handed_at = None

    def handed(self, now: float) -> None:
        """The loop got a batch (its step begins)."""
        self._handed_at = now

    def demand_step(self, now: float | None) -> float | None:
        """Seconds the loop spends per batch besides waiting (a moving mean of its steps, or the
        step it is in if that is longer); None before its first step."""
        if self._step is None:
            return None
        if now is not None and self._handed_at is not None:
            return max(self._step, now - self._handed_at)
        return self._step

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
        n = len(self._stride)
        for b in range(self.next_new, limit):
            if b in self._ahead:
                continue
            owner = self.lanes.get(self._stride[(b - self.start) % n]) if n else None
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

    def _pick(self, working: list[Lane], b: int) -> Lane | None:
        """The lane with room for batch b that would finish it soonest (unknown rates: the one
        with the fewest grants)."""
        best, best_key = None, None
        default = self._default_rate(working)
        for lane in working:
            if lane.room(b) <= 0:
                continue
            key = (lane.expected(default), len(lane.outstanding), lane.order)
            if best_key is None or key < best_key:
                best, best_key = lane, key
        return best

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

    # --- lateness and hedges -----------------------------------------------------------------------

    def threshold(self, lane: Lane) -> float | None:
        """Seconds after its grant when a batch of ``lane`` is late: ``HedgePolicy.late_after`` of
        the other working lanes' latencies, and never less than ``factor`` x the latency ``lane``'s
        own window implies at its healthy rate (window / rate: a server slower than the others is
        not late for being slower; its rate leaves late batches out, so stalls do not raise it).
        None without hedging, with fewer than two lanes, or before the others' warmup."""
        if self.policy is None or len(self.lanes) < 2:
            return None
        yardstick = self.policy.late_after(other.pace.latencies for other in self.lanes.values()
                                           if other is not lane and other.open)
        if yardstick is None:
            return None
        own = lane.window / lane.pace.rate if lane.pace.rate > 0 else 0.0
        return max(yardstick, self.policy.factor * own)

    def _threshold(self, lane: Lane, now: float) -> float | None:
        """``threshold``, recomputed for every lane at most every ``_THRESHOLDS_EVERY_S`` (a
        percentile per lane per batch would cost the loop's CPU)."""
        if self.policy is None or len(self.lanes) < 2:
            return None
        if now - self._thresholds_at >= _THRESHOLDS_EVERY_S or lane.key not in self._thresholds:
            self._thresholds = {key: self.threshold(other) for key, other in self.lanes.items()}
            self._thresholds_at = now
        return self._thresholds.get(lane.key)

    def check(self, now: float) -> tuple[dict[Hashable, list[int]], float | None]:
        """Mark stalled lanes and hedge the batch the loop waits for if it is late (module
        docstring). Returns (hedge grants: lane key -> batches, the next time something may
        turn late: a monotonic deadline, or None)."""
        grants: dict[Hashable, list[int]] = {}
        if self.policy is None or len(self.lanes) < 2:
            return grants, None
        deadline: float | None = None
        thresholds: dict[Hashable, float | None] = {}
        for lane in self.lanes.values():
            thresholds[lane.key] = threshold = self._threshold(lane, now)
            if threshold is None or not lane.outstanding:
                continue
            due = min(lane.outstanding.values()) + threshold
            if now >= due:
                lane.stalled = True
            elif deadline is None or due < deadline:
                deadline = due
        b = self.base
        if b >= self.total or b in self._arrived:
            return grants, deadline
        holders = self.holders(b)
        if len(holders) != 1:
            return grants, deadline
        lane = holders[0]
        threshold = thresholds.get(lane.key)
        if threshold is None:
            return grants, deadline
        due = lane.outstanding[b] + threshold
        if now < due:
            return grants, due if deadline is None else min(deadline, due)
        lane.stalled = True
        late = [b] + (sorted(x for x in lane.outstanding if x != b and len(self._holders.get(x, ())) == 1)
                      if self.policy.chase else [])
        for x in late:
            if not self._hedge(lane, x, now, grants):
                break
        return grants, deadline

    def _hedge(self, slow: Lane, b: int, now: float, grants: dict) -> bool:
        """Grant b, held by ``slow``, to the working lane that would finish it soonest (room
        beyond its window allowed; over shared memory its lease limit still holds), if the
        budget allows. False when it did not."""
        candidates = [lane for lane in self.working() if lane is not slow and not lane.stalled
                      and b not in lane.outstanding and lane.lease_room(b)]
        if not candidates or self.budget is None or not self.budget.can_spend():
            return False
        default = self._default_rate(candidates)
        lane = min(candidates, key=lambda x: (x.expected(default), len(x.outstanding), x.order))
        self.budget.spend()
        lane.hedges_issued += 1
        self._count("hedges_issued")
        self._grant(lane, b, now, grants, hedge=True)
        return True

    def silent(self, now: float, timeout: float) -> list[Lane]:
        """Open lanes with grants outstanding that sent nothing for ``timeout`` seconds while
        another lane sent something meanwhile (candidates to be marked down)."""
        out = []
        for lane in self.lanes.values():
            if not lane.outstanding:
                continue
            since = max(lane.last_arrival or 0.0, min(lane.outstanding.values()))
            if now - since < timeout:
                continue
            if any(o is not lane and o.last_arrival is not None and o.last_arrival > since for o in self.lanes.values()):
                out.append(lane)
        return out

    def figures(self) -> dict[Hashable, dict[str, Any]]:
        """Per lane: batches it sent first this iteration, its window, grants outstanding,
        whether it is stalled, its rate (batches/s), its hedges issued / won / wasted."""
        return {k: {"batches": lane.delivered, "window": lane.window, "outstanding": len(lane.outstanding),
                    "stalled": lane.stalled, "rate": lane.pace.rate, "hedges_issued": lane.hedges_issued,
                    "hedges_won": lane.hedges_won, "hedges_wasted": lane.hedges_wasted,
                    "duplicates": lane.duplicates}
                for k, lane in self.lanes.items()}
