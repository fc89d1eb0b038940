"""Hedged batch requests: a batch that is late from its server is also asked of another one.

A several-servers loader (``batchd.client.multi``) takes each batch from one server's stream,
in order, so one slow server (a pause, a noisy neighbour, a slow disk) holds every batch after
its own. A hedge ("The Tail at Scale", Dean and Barroso, 2013) asks another healthy server of the
split for that one batch: a StreamBatches call with ``start_batch=b``, ``end_batch=b + 1`` and
``hedge=true`` (the server builds that batch only, and counts it apart). The first complete copy
is yielded and the other dropped: a hedge that lost is cancelled (its call reported abandoned,
with the leases it received), and the slow server's late copy is dropped when it arrives (its
stream carries that server's later batches too, so it goes on). Batch b's bytes are a pure
function of the request, so they are the same whichever server won, and each batch is yielded
once.

When (``HedgePolicy``): a server's lag is how long the loop waited for its batch after another
server's next batch was already there (so the server was behind its peers; a server whose batch
keeps the loop waiting while the others' are not there yet is only as slow as they are). A batch
is late once that lag exceeds ``max(min_delay, factor * percentile of the server's recent
lags)``, counting only batches that came without a hedge, and only once the server delivered
``warmup`` batches. Chasing: once a
hedge won a server's batch and that server's own copy has not come, its next batch is hedged at
once (the server is most likely still stalled), and so on until anything comes from it. Budget: a token bucket that gains
``max_fraction`` per batch yielded (at most ``burst``) and pays 1 per hedge, so hedges issued
never exceed ``max_fraction`` x batches yielded. Counters: ``hedges_issued``, ``hedges_won``,
``hedges_wasted`` in ``loader.stats()`` (``batchd.client.loader_stats``).
"""

from __future__ import annotations

import collections
import logging
import math
import queue
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from batchd.client.loader_stats import LoaderStats
from batchd.client.receiver import Receiver, _End, _Failed

log = logging.getLogger(__name__)

_RACE_S = 0.001  # each copy's queue is polled this long in turn while two are outstanding
_SLICE_S = 0.1  # otherwise the stream's queue is waited on in slices of this (to notice a dead receiver)
_PEERS_S = 0.005  # ... or of this, while watching whether another server's next batch is there


@dataclass(frozen=True, slots=True)
class HedgePolicy:
    """When a several-servers loader asks a second server for a late batch, and how often.

    percentile, factor, min_delay: a batch is late once the loop has waited for it, after
        another server's next batch was there, more than ``max(min_delay, factor * the
        percentile-th percentile of that server's recent such lags)`` seconds (defaults: the
        95th, x2, at least 0.05 s).
    window: recent lags kept per server (batches; default 100).
    warmup: batches a server delivers before its own are hedged (default 10; the first ones
        include connecting and the workers' start).
    max_fraction: the budget: hedges issued never exceed ``max_fraction`` x batches yielded
        (default 0.05: 5%).
    burst: the budget's bucket capacity, hedges that may go out back to back (default 20).
    chase: once a hedge won a server's batch and that server's own copy has not come, hedge its
        next batch at once (default True).

    Raises ValueError naming a field out of range.
    """

    percentile: float = 95.0
    factor: float = 2.0
    min_delay: float = 0.05
    window: int = 100
    warmup: int = 10
    max_fraction: float = 0.05
    burst: float = 20.0
    chase: bool = True

    def __post_init__(self) -> None:
        checks = (("percentile", 0 < self.percentile <= 100), ("factor", self.factor > 0),
                  ("min_delay", self.min_delay >= 0), ("window", isinstance(self.window, int) and self.window >= 1),
                  ("warmup", isinstance(self.warmup, int) and self.warmup >= 1),
                  ("max_fraction", 0 <= self.max_fraction <= 1), ("burst", self.burst >= 1))
        for name, ok in checks:
            if not ok:
                raise ValueError(f"HedgePolicy.{name} is out of range: {getattr(self, name)!r}")


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


@dataclass(eq=False)
class _Hedge:
    batch: int
    server: Any  # the multi loader's _Server asked for it
    receiver: Receiver
    chased: bool  # asked before its batch was late (its server was behind)


class Hedger:
    """The hedges of one several-servers loader: each server's recent lags, the budget, the hedges
    in flight. Servers are the multi loader's ``_Server`` objects (``address``, ``conn``). Used from
    the consumer's thread only."""

    def __init__(self, policy: HedgePolicy, stats: LoaderStats):
        self.policy = policy
        self.stats = stats
        self._lags: dict[str, collections.deque[float]] = {}  # seconds, per server address
        self._delivered: collections.Counter[str] = collections.Counter()
        self._tokens = 0.0
        self._hedges: dict[int, _Hedge] = {}  # batch index -> the hedge asked for it
        self._won: set[int] = set()  # batches a hedge delivered: the slow server's copy is dropped on arrival
        self._behind: set[str] = set()  # servers whose batch a hedge won, own copy not come yet
        self._turn = 0
        self._open: Callable[[Any, int], Receiver] | None = None
        self._iteration = 0

    # --- an iteration ----------------------------------------------------------------------------

    def begin(self, open_hedge: Callable[[Any, int], Receiver]) -> int:
        """A new iteration: ``open_hedge(server, b)`` opens the one-batch call for batch b.
        Returns the iteration's number, for ``end``."""
        self.end(self._iteration)
        self._iteration += 1
        self._open = open_hedge
        return self._iteration

    def end(self, iteration: int) -> None:
        """Iteration ``iteration`` is over (nothing if a newer one began): cancel the hedges in
        flight (counted wasted) and forget its batches."""
        if iteration != self._iteration:
            return
        for b in list(self._hedges):
            self._cancel(b)
        self._won.clear()
        self._behind.clear()
        self._open = None

    # --- when -----------------------------------------------------------------------------------

    def delay(self, address: str) -> float | None:
        """Seconds of lag (module docstring) after which a batch of ``address`` is late; None
        before its warmup."""
        lags = self._lags.get(address)
        if lags is None or self._delivered[address] < self.policy.warmup:
            return None
        return max(self.policy.min_delay, self.policy.factor * float(np.percentile(lags, self.policy.percentile)))

    def _record(self, address: str, lag: float) -> None:
        lags = self._lags.get(address)
        if lags is None:
            lags = self._lags[address] = collections.deque(maxlen=self.policy.window)
        lags.append(lag)

    def issue(self, b: int, candidates: list[Any], chased: bool = False) -> bool:
        """Ask one of ``candidates`` (servers other than b's) for batch b, if the budget allows
        (``chased``: b is not late yet, its server is behind)."""
        if b in self._hedges or self._open is None or self._tokens < 1.0:
            return False
        candidates = [s for s in candidates if s.address not in self._behind]
        if not candidates:
            return False
        load = collections.Counter(h.server.address for h in self._hedges.values())
        self._turn += 1
        server = min(candidates, key=lambda s: (load[s.address], (candidates.index(s) - self._turn) % len(candidates)))
        try:
            receiver = self._open(server, b)
        except (ConnectionError, RuntimeError) as e:
            log.debug("could not hedge batch %d on %s: %s", b, server.address, e)
            return False
        self._tokens -= 1.0
        self._hedges[b] = _Hedge(b, server, receiver, chased)
        self.stats.count("hedges_issued")
        log.debug("batch %d is late; asked %s for it too", b, server.address)
        return True

    # --- waiting ----------------------------------------------------------------------------------

    def wait(self, b: int, server: Any, receiver: Receiver, peers: list[Receiver], timeout: float, what: str,
             candidates: Callable[[], list[Any]]) -> tuple[Any, Receiver, Any]:
        """Batch b from ``server``'s ``receiver``, or from a hedge: (item, the receiver it came on,
        the server that sent it). ``peers``: the other servers' streams of the split. Raises the
        primary's errors, and TimeoutError after ``timeout`` seconds without batch b."""
        start = time.monotonic()
        deadline = start + timeout
        delay = self.delay(server.address)
        ready_at: float | None = None  # when a peer's next batch was there: b's server is behind them since
        attempted = b in self._hedges  # (a chased hedge, or one asked before a re-split)
        while True:
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"no batch from {server.address} for {timeout:g} s ({what})")
            if ready_at is None and any(not p.queue.empty() for p in peers):
                ready_at = now
            hedge = self._hedges.get(b)
            hedge_at = math.inf if delay is None or ready_at is None or attempted else ready_at + delay
            if hedge is None and now >= hedge_at:
                self.issue(b, candidates())
                attempted = True  # once per batch, whether the budget allowed it or not
                continue
            if hedge is not None:
                slice_s = _RACE_S
            elif ready_at is None and delay is not None and peers:
                slice_s = _PEERS_S  # watching for a peer's batch
            else:
                slice_s = min(hedge_at, deadline, now + _SLICE_S) - now
            item = _poll(receiver, slice_s, what)
            if item is not None:
                self._behind.discard(server.address)
                if not isinstance(item, _End) and item.batch_index < b and item.batch_index in self._won:
                    self._won.discard(item.batch_index)  # the late copy of a batch a hedge delivered
                    continue
                self._delivered[server.address] += 1
                if not attempted:  # (a late batch's lag is not recorded: a stall would raise the delay)
                    self._record(server.address, 0.0 if ready_at is None else time.monotonic() - ready_at)
                return item, receiver, server
            if hedge is not None and (got := self._poll_hedge(hedge)) is not None:
                return got, hedge.receiver, hedge.server

    def _poll_hedge(self, hedge: _Hedge) -> Any:
        """The hedge's batch if it came; a failed or ended hedge is dropped (wasted)."""
        try:
            item = hedge.receiver.queue.get(timeout=_RACE_S)
        except queue.Empty:
            if hedge.receiver.is_alive():
                return None
            item = _Failed(RuntimeError("the receiver thread ended"))
        if isinstance(item, (_Failed, _End)) or item.batch_index != hedge.batch:
            why = item.error if isinstance(item, _Failed) else "it ended without its batch"
            log.debug("the hedge for batch %d on %s failed: %s", hedge.batch, hedge.server.address, why)
            self._cancel(hedge.batch)
            return None
        return item

    def settled(self, b: int, by_hedge: bool, server: Any, receiver: Receiver, next_of_server: int | None,
                candidates: Callable[[], list[Any]]) -> None:
        """Batch b was handed over (``by_hedge``: a hedge's copy; ``server``/``receiver``: b's own
        server and stream). The other copy is dropped, the budget grows, and a server still behind
        has its next batch (``next_of_server``, None if it has none in this split) chased."""
        self._tokens = min(self.policy.burst, self._tokens + self.policy.max_fraction)
        hedge = self._hedges.get(b)
        if hedge is None:
            return
        if not by_hedge:
            self._cancel(b)
            return
        del self._hedges[b]
        hedge.receiver.stop()  # (it ends after its one batch; the batch's lease stays with its tensors)
        self.stats.count("hedges_won")
        self._won.add(b)  # b's own copy is dropped when it comes
        if not receiver.queue.empty():
            self._behind.discard(server.address)  # it came meanwhile: the server is not behind
            return
        if not hedge.chased:  # b was late and its own copy is still not here: the server is behind
            self._behind.add(server.address)
        # (a chased hedge that won keeps the server behind only while its late batch is missing)
        if self.policy.chase and next_of_server is not None and server.address in self._behind:
            self.issue(next_of_server, [s for s in candidates() if s is not server], chased=True)

    def _cancel(self, b: int) -> None:
        hedge = self._hedges.pop(b, None)
        if hedge is not None:
            hedge.receiver.stop()  # cancelled, reported abandoned with the leases received
            self.stats.count("hedges_wasted")


def _poll(receiver: Receiver, timeout: float, what: str) -> Any:
    """The receiver's next item within ``timeout`` seconds, or None; raises a failed stream's error."""
    try:
        item = receiver.queue.get(timeout=max(0.0, timeout))
    except queue.Empty:
        if not receiver.is_alive() and receiver.queue.empty():
            raise RuntimeError(f"the receiver thread for {receiver.address} ended without a result ({what})") from None
        return None
    if isinstance(item, _Failed):
        raise item.error
    return item
