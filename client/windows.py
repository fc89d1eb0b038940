"""How much each server may hold, and how far ahead: the assigner's windows and lookahead.

``Windows`` is the part of ``Assigner`` (``batchd.client.assign``) that sizes, before each
round of grants (``Assigner.plan``):

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
  (``(outstanding + 1) / rate``; or its home, ``batchd.client.assign``), never ``lookahead`` or
  more past the next batch the loop takes (``base``): memory and leases stay bounded. The
  lookahead is what keeps every window full with as much again arrived (2 x the windows), but
  no more than the loop needs: about 2 x H of its
  own pace (a loop that steps slower than the servers build gets fewer batches ahead), at least
  ``floor`` per lane (each server ``prefetch`` ahead; all there is before the loop's first step),
  at most ``MAX_LOOKAHEAD`` batches and ``MAX_LOOKAHEAD_BYTES``. Batches of a lane that went down
  come first (``lost``).

The loop's own pace (``asked``, ``handed``, ``demand_step``) is measured here too: it bounds
the lookahead. Thread-safety: none; the feed calls the assigner under its one lock.
"""

from __future__ import annotations

import math

from batchd.client.lane import Lane
from batchd.client.pace import RATE_ALPHA

MIN_HORIZON_S = 0.1  # the shortest horizon a window is sized to (seconds)
HEADROOM_S = 0.05  # beyond the slowest worker time: the round trip and this loader's reaction (seconds)
MAX_WINDOW = 32  # grants one server may hold (batches)
MAX_LOOKAHEAD = 64  # batches granted past the one the loop takes next, at most
MAX_LOOKAHEAD_BYTES = 1 << 30  # ... and at most about this many bytes of them


class Windows:
    """Mixed into ``Assigner``: needs its ``lanes``, ``mode``, ``floor``, ``max_lookahead``,
    ``batch_bytes``, ``_step``, ``_handed_at`` and ``working``."""

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
            self._step = step if self._step is None else (1 - RATE_ALPHA) * self._step + RATE_ALPHA * step
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
