"""Late batches in the assigner: stalled servers, hedges, and servers silent for too long.

``Lateness`` is the part of ``Assigner`` (``batchd.client.assign``) that applies the hedging
rule of ``batchd.client.hedge`` (``HedgePolicy``: when a batch is late, judged by the *other*
servers' latencies; ``Budget``: how many hedges it may cost) to the assigner's lanes:

* **Late batches** (``check``): with a ``HedgePolicy`` and two lanes or more, a lane whose oldest
  grant is older than its threshold (``threshold``) is *stalled* (no new grants until something
  arrives from it), and when the batch the loop waits for (``base``) is late, it is granted to
  another lane too (a hedge), and so (``chase``) is every batch the stalled lane holds, within
  the ``Budget``; under stride, where a stalled lane's own batches are granted to no one, the
  batch the loop waits for is hedged all the same. The first copy to arrive wins (``arrived``);
  the other grants are revoked, but for a stalled lane's oldest one: that one stays granted as
  its *probe* (most likely being built already), and its copy arriving, dropped, is how the
  loader learns that the lane lives again.
  Revoking it too would leave a lane that resumed with nothing to send and nothing granted.

``silent`` finds the servers that sent nothing for the loader's ``timeout`` while the others sent
batches (the feed marks them down). The feed runs ``check`` from its converter thread at the
deadlines it returns; ``Assigner.arrived`` reads a lane's threshold (``_threshold``, recomputed
at most every ``_THRESHOLDS_EVERY_S``) for every batch. Thread-safety: none; the feed calls the
assigner under its one lock.
"""

from __future__ import annotations

from typing import Hashable

from batchd.client.lane import Lane

_THRESHOLDS_EVERY_S = 0.05  # lateness thresholds are recomputed at most this often (seconds)


class Lateness:
    """Mixed into ``Assigner``: needs its ``lanes``, ``policy``, ``budget``, ``base``, ``total``,
    ``_arrived``, ``_holders``, ``_thresholds``, ``_thresholds_at``, ``_count``, ``working``,
    ``holders``, ``_default_rate``, ``_grant`` and, for stride, ``mode``, ``_stride_owner`` and
    ``_ahead``."""

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
        if not holders and self.mode == "stride":  # its own server is stalled: it grants it to no one
            owner = self._stride_owner(b)
            if owner is not None and owner.stalled and self._hedge(owner, b, now, grants):
                self._ahead.add(b)  # (granted: the plan skips it)
            return grants, deadline
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
