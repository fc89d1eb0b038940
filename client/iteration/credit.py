"""Who builds which batch of one pass: credit sized by each server, one rule for stalls.

The rule. Batch b of an epoch is a pure function of the request and b, so any server may build
it, any number of times, and the first copy to arrive is the one the loop gets. So:

* **Credit.** A server may hold ``credit`` grants not yet arrived: what it can build within the
  horizon H, ``W + ceil(H x W / t)``, where W is its worker processes and t its median worker
  seconds per batch, both as the server itself says (``batchd-workers`` and every batch's
  ``BatchTimings``; ``Capacity``), and H the slowest server's t plus ``HEADROOM_S`` (at least
  ``MIN_HORIZON_S``): enough to keep its workers busy while its batches travel, and every
  server's deliveries spread over the same horizon, so that a fast server's credit covers a slow
  one's latency. Credit is at least the loader's ``prefetch`` and at most ``MAX_CREDIT``; over
  shared memory its grants plus the leases of its session this client holds (batches waiting
  to be taken, the loop's) stay below the server's lease cap (``batchd-max-leases``) with one
  lease left for the batch the loop waits for, which is granted whatever the leases (refusing
  it would wait on leases only the loop can free; ``Holder.room``).
* **Need.** The lowest batch not granted goes to the server with free credit that would
  deliver it soonest (``(outstanding // W + 1) x t``), or to its *home* (batch b's home is the
  (b mod n)-th server by address, the same in every loader, so identical loaders ask the same
  server for it and it is built once) when the home would deliver it at most ``HOME_SLACK`` of
  the soonest server's batches later.
  Grants run at most ``lookahead`` batches past the one the loop takes next: the servers'
  credits together and as far as a slow server's batches are needed, but no more than about two
  horizons of the loop's own pace (a loop slower than the servers does not make them build far
  ahead; before its first step, ``prefetch`` per server), at most ``MAX_LOOKAHEAD`` and about
  ``MAX_LOOKAHEAD_BYTES``. The loop's step is the time between getting a batch and asking for the
  next (the training step; the wait for data left out), a moving mean.
* **Stalls.** A server whose oldest grant is older than its deadline, ``STALL_FACTOR x
  (ceil(credit / W) + 1) x t + STALL_SLACK_S`` (its own capacity: never other servers' pace, never
  a budget), is stalled: every batch it holds is granted to the others at once; it keeps its
  oldest grant (the *probe*, granted elsewhere too) and gets nothing new until a batch arrives
  from it, which shows it is back. (With one server nobody can take its batches: it is waited
  for.) A stalled server stays stalled into the next pass, with a fresh probe.

Everything else follows from first-copy-wins: a copy that arrives after another is dropped (its
lease released), the others' grants of a batch that arrived are revoked, a server whose call
broke has its batches granted to the others at once and gets them again when it is back
(grants are idempotent on the server), a shared-memory batch whose slot went with a restarted
server is granted again (``requeue``).

Thread-safety: none; ``batchd.client.iteration.epoch.Epoch`` calls it under its one lock.
"""

from __future__ import annotations

import math
from typing import Hashable

from batchd.client.iteration.holder import DEFAULT_BUILD_S, Capacity, Holder

__all__ = ["Capacity", "Credit", "Holder", "MAX_LOOKAHEAD"]

MIN_HORIZON_S = 0.1  # the shortest horizon credit is sized to (seconds)
HEADROOM_S = 0.05  # beyond the slowest server's build time: the round trip and this loader's reaction (s)
MAX_CREDIT = 32  # grants one server may hold (batches)
MAX_LOOKAHEAD = 128  # batches granted past the one the loop takes next, at most
MAX_LOOKAHEAD_BYTES = 1 << 30  # ... and at most about this many bytes of them
HOME_SLACK = 4.0  # a batch goes home if the home delivers it at most this many of the other's batches later
STEP_ALPHA = 0.25  # weight of a new step of the loop in its moving mean


class Credit:
    """The batches ``start .. total - 1`` of one pass, granted to servers by the rule of the
    module docstring. ``prefetch``: the least credit of a server. ``regrant``: a stalled server's
    batches go to the others (False: it is waited for). Raises ValueError for a bad range."""

    def __init__(self, start: int, total: int, *, prefetch: int = 2, regrant: bool = True):
        if not 0 <= start <= total:
            raise ValueError(f"batches {start} .. {total} is not a range")
        self.start, self.total, self.prefetch, self.regrant = start, total, max(1, prefetch), regrant
        self.holders: dict[Hashable, Holder] = {}
        self.base = start  # the next batch the loop takes
        self.next_new = start  # the lowest batch never granted
        self._lost: set[int] = set()  # batches below next_new that no open server holds, to grant again
        self._arrived: dict[int, Hashable] = {}  # batch (>= base) -> the server whose copy is kept
        self.batch_bytes = 0.0  # a batch's size, moving (bytes)
        self.granted_at: dict[int, float] = {}  # batch -> when last granted (the loop's deadline moves then)
        self.loop_step: float | None = None  # the loop's step, moving (s; None before its first)
        self._handed_at: float | None = None  # when the loop got its last batch (None: it asked since)

    # --- servers ---------------------------------------------------------------------------------

    def add(self, key: Hashable, capacity: Capacity, home: str, *, stalled: bool = False) -> None:
        """A server joins the pass (not yet open: ``opened`` once its call is up)."""
        self.holders[key] = Holder(key, capacity, home, stalled=stalled)

    def opened(self, key: Hashable) -> list[int]:
        """Its call is up (again). Returns its outstanding batches to grant again on it (a new call
        lost them; grants are idempotent on the server)."""
        h = self.holders[key]
        h.open = True
        return sorted(h.outstanding)

    def closed(self, key: Hashable) -> None:
        """Its call broke (it may come back): its batches go to the others now; it gets nothing
        new until ``opened``."""
        h = self.holders.get(key)
        if h is not None and h.open:
            h.open = False
            self._let_go(h, keep=None)

    def remove(self, key: Hashable) -> None:
        """It left the pass (down, retired): its batches go to the others."""
        h = self.holders.pop(key, None)
        if h is not None:
            self._let_go(h, keep=None)

    def _let_go(self, h: Holder, keep: int | None) -> list[int]:
        """Its grants but ``keep`` (a stalled server's probe) go; each goes to the others unless a
        healthy server holds it already (the probe too). Returns the batches it let go of."""
        gone = [b for b in h.outstanding if b != keep]
        for b in gone:
            del h.outstanding[b]
            self._lose(b)
        if keep is not None:
            self._lose(keep)
        h.regranted += len(gone) + (keep is not None)
        return gone

    def _lose(self, b: int) -> None:
        """Batch b is to be granted again (first), unless it arrived or a healthy server holds it."""
        if b < self.base or b in self._arrived or any(b in h.outstanding for h in self._working()):
            return
        self._lost.add(b)

    def _working(self) -> list[Holder]:
        return [h for h in self.holders.values() if h.open and not h.stalled]

    # --- granting --------------------------------------------------------------------------------

    def horizon(self) -> float:
        """Seconds of work every server's credit covers (module docstring)."""
        default = self._default_build()
        slowest = max((h.build_time(default) for h in self.holders.values() if h.open), default=default)
        return max(MIN_HORIZON_S, slowest + HEADROOM_S)

    def _default_build(self) -> float:
        """The build time a server not measured yet is taken to have: the median of the measured
        ones (as fast as they are, so that it gets work and is measured), else ``DEFAULT_BUILD_S``."""
        measured = sorted(t for h in self.holders.values() if (t := h.capacity.build_time) is not None)
        return measured[len(measured) // 2] if measured else DEFAULT_BUILD_S

    def lookahead(self) -> int:
        """Batches that may be granted past ``base`` (module docstring, *Need*): the servers'
        credits, or as far as the slowest one's batches are needed, if further."""
        working = self._working()
        default = self._default_build()
        ahead = (sum(h.credit for h in working) + len(working)
                 + max((self._lead(h, working, default) for h in working), default=0))
        least = self.prefetch * max(1, len(working))  # (each server prefetch ahead, as one alone would be)
        if self.loop_step is None:
            ahead = least  # (no step of the loop seen yet: it may be slow)
        elif self.loop_step > 0:  # a loop slower than the servers needs about 2 horizons of its own pace
            ahead = min(ahead, math.ceil(2 * self.horizon() / self.loop_step) + len(working))
        if self.batch_bytes > 0:
            ahead = min(ahead, int(MAX_LOOKAHEAD_BYTES // self.batch_bytes))
        return max(least, min(MAX_LOOKAHEAD, ahead))

    def plan(self, now: float) -> dict[Hashable, list[int]]:
        """New grants: server key -> batches, in order. Records them."""
        grants: dict[Hashable, list[int]] = {}
        working = self._working()
        if not working:
            return grants
        horizon = self.horizon()
        for h in working:  # (credit: module docstring; unmeasured, what it surely builds at once)
            w, t = h.capacity.workers, h.capacity.build_time
            h.credit = max(self.prefetch, min(MAX_CREDIT, w if t is None else w + math.ceil(horizon * w / t)))
        limit = min(self.total, self.base + self.lookahead())
        default = self._default_build()
        homes = sorted(working, key=lambda h: h.home)
        candidates = list(working)
        while candidates:
            h = min(candidates, key=lambda x: x.delivery(default))  # (the first of equals: their order)
            b = self._unassigned(self._lead(h, working, default), limit, h)
            if b is None or not h.room(b, self.base):
                candidates.remove(h)
                continue
            home = homes[b % len(homes)]
            if (home is not h and b not in home.outstanding and home.room(b, self.base)
                    and home.delivery(default) <= h.delivery(default) + HOME_SLACK * h.build_time(default)):
                h = home
            if b in self._lost:
                self._lost.discard(b)
            else:  # (a batch never granted: those below it stay to grant)
                self._lost.update(range(self.next_new, b))
                self.next_new = b + 1
            self._grant(h, b, now, grants)
        self._probe(now, grants)
        return grants

    @staticmethod
    def _lead(h: Holder, working: list[Holder], default: float) -> int:
        """Batches the servers that deliver sooner than ``h`` would deliver before it does: ``h``
        is granted the batch after them (module docstring, *Need*)."""
        mine = h.delivery(default)
        lead = 0.0
        for other in working:
            theirs = other.delivery(default)
            if other is not h and theirs < mine:
                lead += (mine - theirs) * other.capacity.workers / other.build_time(default)
        return int(lead)

    def _unassigned(self, skip: int, limit: int, h: Holder) -> int | None:
        """The batch not granted to anyone after the first ``skip`` such batches (below ``limit``),
        not held by ``h``; None if there is none."""
        lost = [b for b in sorted(self._lost) if b not in h.outstanding]
        if skip < len(lost):
            return lost[skip]
        b = self.next_new + skip - len(lost)
        return b if b < limit else None

    def _grant(self, h: Holder, b: int, now: float, grants: dict) -> None:
        h.outstanding[b] = now
        self.granted_at[b] = now
        grants.setdefault(h.key, []).append(b)

    def _probe(self, now: float, grants: dict) -> None:
        """A stalled server without a grant (a new pass) gets one: its probe, the lowest batch
        granted to another server and not arrived (so the loop never waits on it)."""
        waiting = [h for h in self.holders.values() if h.stalled and h.open and not h.outstanding]
        if not waiting:
            return  # (the usual case: nothing to look at, every plan)
        held = {b for o in self.holders.values() for b in o.outstanding}
        probe = min((b for b in held if b >= self.base and b not in self._arrived), default=None)
        if probe is None:
            return
        for h in waiting:
            h.probe = probe
            self._grant(h, probe, now, grants)

    # --- stalls ----------------------------------------------------------------------------------

    def check(self, now: float) -> tuple[dict[Hashable, list[int]], float | None]:
        """Find stalled servers (module docstring, *Stalls*) and let go of their batches. Returns
        (revokes: key -> batches, the next time a grant may turn late: monotonic s, or None)."""
        revokes: dict[Hashable, list[int]] = {}
        healthy = self._working()
        if not self.regrant or len(healthy) < 2:
            return revokes, None  # (with one healthy server nobody could take its batches)
        default = self._default_build()
        deadline = None
        for h in healthy:
            if not h.outstanding:
                continue
            oldest_b = min(h.outstanding, key=h.outstanding.__getitem__)
            due = h.outstanding[oldest_b] + h.deadline(default)
            if now < due:
                deadline = due if deadline is None else min(deadline, due)
                continue
            h.stalled, h.probe = True, oldest_b
            h.stalls += 1
            gone = self._let_go(h, keep=oldest_b)
            if gone:
                revokes[h.key] = gone
        return revokes, deadline

    def silent(self, now: float, seconds: float) -> list[Hashable]:
        """The stalled servers whose probe was granted ``seconds`` ago or more (nothing came since)."""
        return [h.key for h in self.holders.values()
                if h.stalled and h.probe in h.outstanding and now - h.outstanding[h.probe] >= seconds]

    # --- arrivals --------------------------------------------------------------------------------

    def arrived(self, key: Hashable, b: int, nbytes: int = 0) -> dict[Hashable, list[int]] | None:
        """Batch b came from server ``key``: keep it if it is the first copy the pass needs (returns
        the other servers' grants of it to revoke: key -> batches), else drop it (returns None); a
        stalled server that sends anything is healthy again."""
        h = self.holders.get(key)
        if h is not None:
            h.outstanding.pop(b, None)
            if h.stalled:
                h.stalled, h.probe = False, None
        if h is None or not self.base <= b < self.next_new or b in self._arrived:  # (never granted: dropped too)
            if h is not None:
                h.duplicates += 1
            return None
        self._arrived[b] = key
        h.delivered += 1
        self._lost.discard(b)  # (granted again meanwhile, not yet to anyone)
        if nbytes:
            self.batch_bytes = nbytes if not self.batch_bytes else 0.8 * self.batch_bytes + 0.2 * nbytes
        revoke: dict[Hashable, list[int]] = {}
        for o in self.holders.values():
            if b not in o.outstanding or (o.stalled and o.probe == b):
                continue  # (a probe stays granted: its copy arriving, dropped, shows it is back)
            del o.outstanding[b]
            revoke[o.key] = [b]
        self.granted_at.pop(b, None)
        return revoke

    def take(self, b: int) -> Hashable:
        """The loop takes batch b (it must be ``base`` and have arrived): the server it came from."""
        if b != self.base or b not in self._arrived:
            raise RuntimeError(f"batch {b} taken out of order (next is {self.base}, "
                               f"arrived: {b in self._arrived})")
        key = self._arrived.pop(b)
        self.base += 1
        return key

    def requeue(self, b: int) -> None:
        """Batch b arrived but cannot be used (its shared-memory slot went with a restarted
        server): it is granted again, first."""
        key = self._arrived.pop(b, None)
        if key is None:
            return
        h = self.holders.get(key)
        if h is not None:
            h.delivered -= 1
        self._lost.add(b)

    def has(self, b: int) -> bool:
        """Whether batch b arrived (the copy kept) and waits to be taken."""
        return b in self._arrived

    def arrived_from(self, key: Hashable) -> list[int]:
        return sorted(b for b, k in self._arrived.items() if k == key)

    def outstanding(self) -> dict[Hashable, list[int]]:
        return {k: sorted(h.outstanding) for k, h in self.holders.items() if h.outstanding}

    # --- the loop's pace ---------------------------------------------------------------------------

    def asked(self, now: float) -> None:
        """The loop asks for a batch (monotonic s): the step since it got the last one is measured."""
        if self._handed_at is not None:
            step = max(0.0, now - self._handed_at)
            self.loop_step = step if self.loop_step is None else (
                (1 - STEP_ALPHA) * self.loop_step + STEP_ALPHA * step)
            self._handed_at = None

    def handed(self, now: float) -> None:
        """The loop got its batch (monotonic s)."""
        self._handed_at = now

    def figures(self) -> dict[Hashable, dict]:
        """Per server: batches it sent first this pass, its credit, grants outstanding, whether it
        is stalled, its stalls, batches re-granted from it, duplicates (its capacity: ``Capacity``)."""
        return {k: {"batches": h.delivered, "credit": h.credit, "outstanding": len(h.outstanding),
                    "stalled": h.stalled, "stalls": h.stalls, "regranted": h.regranted,
                    "duplicates": h.duplicates}
                for k, h in self.holders.items()}
