"""Computations: what to build next for the streams reading them, and the buffer of built batches.

(``Stream``, one call's cursor, is in ``stream.py``.)

A ``Computation`` builds the batches of one (dataset, pipeline, batch_size, shuffle, seed,
epoch, drop_last, rank, world_size, start_position): those fields fix every batch's bytes, so streams (calls)
that agree on them can share one computation. Workers finish batches in any order.

Grants. Each reader (``Stream``) *grants* the batch indices it wants built, and the computation
builds the union of its readers' grants that are not built or being built yet, in the order
they were granted (``wants_work``/``take_task``):

* a Batches call's client grants indices itself (``grant``; ``revoke`` takes a grant back), and
  its stream takes any of its granted batches that is built, lowest index first (as built, not
  in order);
* a StreamBatches call is the same machinery with the server granting on the client's behalf
  (an *ordered* stream): every stride-th index from its position, ``prefetch`` of them ahead, up
  to its end; it takes its batches strictly in order, so old clients get the same bytes in the
  same order.

Bounds and sharing, with the *front* the position of the furthest reader (a reader's position: an
ordered stream's next batch; a Batches call's lowest granted batch not yet sent):

* a built batch is kept while a reader needs it (an ordered reader needs every batch of its own
  from its position on; a Batches call those it granted and has not been sent), and then as
  history (the last ``window`` of them, lowest index released first), so that a stream that
  starts a little later (another experiment launched a few seconds after the first) joins and
  reads them instead of recomputing; history goes first when the slot pool runs short
  (``evict_history``). A lone ordered reader holds at most ``prefetch`` batches ahead and
  ``window`` behind; a Batches call at most what it granted;
* an ordered reader more than ``window`` batches behind the front is moved to a computation of
  its own, starting at its position: it gets the same bytes (recomputed), and nobody waits for it
  (Ray Data's streaming_split makes every consumer wait for the slowest, ray#41973). A Batches
  call is never moved: it holds nothing beyond its own grants.

Failures. ``fail(error, b)``: nothing at or past the lowest failed batch is built any more; a
reader gets the error in place of that batch, once it has taken every batch it wants before it
(an ordered reader: its batches before b; a Batches call: its granted batches below b, built and
sent as usual; granted batches above b that were already built may have been sent before).

The pool thread calls ``wants_work``/``take_task``/``done``/``retry``/``fail`` on computations
(the ``Work`` protocol of server/compute/work.py, which ``Computation`` implements in
``build_queue.py``);
RPC threads call ``get``/``put_back``/``grant``/``revoke``/``wake`` (through ``Stream``). A
computation's state, and the grant state of its readers, is under its condition variable.

Strided streams (a client spreading an epoch over ``stride`` servers with StreamBatches) read the
batches ``first, first + stride, ...`` only. Positions are still batch indices and advance by
``stride``; ``prefetch`` and ``window`` count this stream's batches (so they span ``stride`` times
as many indices). The residue ``first % stride`` is part of the sharing key: only streams reading
the same batches share a computation. So is ``end_batch`` (a hedged request for one batch builds
that batch only, and never limits a stream reading on). A Batches call's key is a plain
stream's (stride 1, no end), so it shares with a StreamBatches call of the same request.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from batchd.server.compute.protocol import StreamRequest
from batchd.server.compute.work import ReadyBatch
from batchd.server.serve.build_queue import BuildQueue
from batchd.server.shm import Segment

if TYPE_CHECKING:
    from batchd.server.serve.stream import Stream

log = logging.getLogger(__name__)

_computation_ids = itertools.count(1)


class _Moved(Exception):
    """The reader was moved to another computation while it waited."""


class Computation(BuildQueue):
    """The batches of one request key, built once for every stream reading it.

    indices: this shard's sample order, int64 [N] (of the epoch's remainder from
    ``request.start_position``); sources: a mix's source of each, int64 [N] (None otherwise). num_batches: nothing at or past this batch index is built (the
    epoch's end, or ``request.end_batch``). window: how far (batches) ordered readers may drift
    behind the front before they are moved to a computation of their own, and how many built
    batches no reader needs are kept as history.
    """

    def __init__(self, request: StreamRequest, indices: np.ndarray, num_batches: int, *,
                 release_slot: Callable[[Segment], None], window: int, sources: np.ndarray | None = None):
        self.id = next(_computation_ids)
        self.request = request
        self.indices = indices
        self.sources = sources
        self.num_batches = num_batches
        self.window = window
        self.stride = request.stride  # ordered positions step by this; window and prefetch count steps
        self._release_slot = release_slot
        self._cond = threading.Condition()
        self._readers: dict[int, Stream] = {}
        self._queue: collections.deque[int] = collections.deque()  # granted, to build (grant order; stale ones skipped)
        self._queued: set[int] = set()
        self._retry: collections.deque[int] = collections.deque()
        self._in_flight: set[int] = set()
        self._ready: dict[int, ReadyBatch] = {}
        self._history: dict[int, None] = {}  # built batches no reader needs (a subset of _ready), at most window
        self._users: collections.Counter[int] = collections.Counter()  # readers encoding batch b now
        self.attempts: collections.Counter[int] = collections.Counter()
        self.error: BaseException | None = None  # set on the first failure: nothing new is submitted
        self._failed: dict[int, BaseException] = {}  # batch index -> why it could not be built
        self.closed = False
        self.slot_hint = 0  # bytes of the last batch: the slot size to ask for next
        self.samples_skipped = 0
        self.on_fall_behind: Callable[[Stream], None] = lambda stream: None
        self.on_grant: Callable[[], None] = lambda: None  # new work: wake the pool (Loader sets it)

    # --- readers -----------------------------------------------------------------------------

    def attach(self, stream: Stream, *, first: bool = False) -> bool:
        """Add a reader; False if this computation cannot serve it (closed, failed, or an ordered
        reader's position is more than ``window`` behind the front or past what is being built)."""
        with self._cond:
            if self.closed or self.error is not None:
                return False
            if not first and not self._can_join(stream):
                return False
            self._readers[stream.id] = stream
            stream.computation = self
            for b in stream.wanted():
                self._want(b)
            for b in [b for b in self._history if stream.needs(b)]:
                del self._history[b]  # needed again
            if not stream.ordered:
                stream.ready.update(b for b in stream.granted if b in self._ready)
            self._cond.notify_all()
            return True

    def _can_join(self, stream: Stream) -> bool:
        if not stream.ordered:
            return True
        front = self._front()
        ahead = max((r.prefetch for r in self._readers.values() if r.ordered), default=stream.prefetch)
        return front - self.window * self.stride <= stream.position <= front + max(ahead, stream.prefetch) * self.stride

    def detach(self, stream: Stream) -> bool:
        """Remove a reader; its batches go back once nobody needs them. True if no reader is left."""
        with self._cond:
            self._readers.pop(stream.id, None)
            empty = not self._readers
            if empty:
                self.closed = True
            for b in list(self._ready):
                self._settle(b)
            self._cond.notify_all()
            return empty

    @property
    def readers(self) -> int:
        with self._cond:
            return len(self._readers)

    def _front(self) -> int:
        return max((r.position for r in self._readers.values()), default=0)

    def _back(self) -> int:
        return min((r.position for r in self._readers.values()), default=0)

    def _needed(self, b: int) -> bool:
        return any(r.needs(b) for r in self._readers.values())

    def _wanted(self, b: int) -> bool:
        return any(r.wants(b) for r in self._readers.values())

    def _want(self, b: int) -> None:
        """Queue batch b to be built (a reader granted it), unless it is built, building or queued."""
        if b not in self._queued and b not in self._ready and b not in self._in_flight:
            self._queue.append(b)
            self._queued.add(b)

    def _settle(self, b: int) -> None:
        """Batch b may no longer be needed: keep it as history, or release it (nobody reads here)."""
        batch = self._ready.get(b)
        if batch is None or self._users[b]:
            return
        if self.closed or not self._readers:
            del self._ready[b]
            self._history.pop(b, None)
            self._release_slot(batch.slot)
            return
        if b in self._history or self._needed(b):
            return
        self._history[b] = None
        self._trim_history(self.window)

    def _trim_history(self, keep: int) -> int:
        """Release history beyond ``keep`` batches, lowest index first. Returns how many."""
        released = 0
        while len(self._history) > keep:
            b = min(self._history)
            del self._history[b]
            self._release_slot(self._ready.pop(b).slot)
            released += 1
        return released

    def evict_history(self) -> int:
        """Release every built batch kept as history (the slot pool is short). Returns how many."""
        with self._cond:
            return self._trim_history(0)

    def _laggards(self) -> list[Stream]:
        """Ordered readers more than ``window`` batches behind the front (to be moved)."""
        if len(self._readers) < 2:
            return []
        limit = self._front() - self.window * self.stride
        return [r for r in self._readers.values() if r.ordered and r.position < limit and not r.finished]

    # --- stats -------------------------------------------------------------------------------

    def backlog(self, stream: Stream) -> tuple[int, int]:
        """(batches being built, built batches waiting) for ``stream``: an ordered stream counts
        the computation's batches in flight and those built at or after its position; a Batches
        call its own granted ones. History kept for late joiners does not count."""
        with self._cond:
            if stream.ordered:
                return len(self._in_flight), sum(1 for b in self._ready if b >= stream.position and b not in self._history)
            return sum(1 for b in stream.granted if b in self._in_flight), len(stream.ready)

    # --- RPC threads -------------------------------------------------------------------------

    def get(self, stream: Stream, timeout: float) -> ReadyBatch | None:
        """The reader's next batch (see Stream.next). Raises _Moved if it was moved away."""
        deadline = time.monotonic() + timeout
        laggards: list[Stream] = []
        with self._cond:
            while True:
                if stream.id not in self._readers:
                    raise _Moved
                batch = self._take(stream)
                if batch is not None:
                    laggards = self._laggards()
                    break
                if stream.finished:  # nothing more to send: no failure is this call's any more
                    return None
                failed = min(self._failed) if self._failed else None
                if failed is not None and failed <= stream.position:
                    raise self._failed[failed]
                if self.closed or stream.idle:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        for laggard in laggards:
            self.on_fall_behind(laggard)
        return batch

    def _take(self, stream: Stream) -> ReadyBatch | None:
        """The stream's next built batch, marked as being sent (under the lock), or None."""
        if stream.ordered:
            b = stream.position
            batch = self._ready.get(b)
            if batch is None:
                return None
            stream.position = b + self.stride
            top = b + stream.prefetch * self.stride  # entered the stream's prefetch window
            if top < stream.end:
                self._want(top)
        else:
            if not stream.ready:
                return None
            b = min(stream.ready)
            batch = self._ready.get(b)
            if batch is None:  # closed: its built batches went back
                stream.ready.discard(b)
                return None
            stream.sent(b)
        self._users[b] += 1
        return batch

    def put_back(self, batch: ReadyBatch) -> None:
        """A reader finished sending ``batch`` (a lease, if it lent the slot, holds its own reference)."""
        b = batch.batch_index
        with self._cond:
            self._users[b] -= 1
            if self._users[b] <= 0:
                del self._users[b]
            if self.closed and not self._users[b] and self._ready.get(b) is batch:
                del self._ready[b]
                self._history.pop(b, None)
                self._release_slot(batch.slot)
                return
            self._settle(b)

    def grant(self, stream: Stream, indices, *, max_grants: int) -> int:
        """A Batches call's client grants ``indices`` (batch indices): build and send them (those
        outstanding on the call already are not granted twice; ``Stream.new_grants``). Returns how
        many were new.

        Raises ValueError naming an index out of [0, num_batches), ResourceExhaustedError past
        ``max_grants`` granted and not sent; then nothing is granted.
        """
        with self._cond:
            new = stream.new_grants(indices, max_grants)
            if stream.id not in self._readers:
                return 0  # the call is ending
            sendable = False
            for b in new:
                stream.add_grant(b)
                if b in self._ready:
                    stream.ready.add(b)
                    self._history.pop(b, None)
                    sendable = True
                else:
                    self._want(b)
            if sendable:  # the call's sender waits for a ready batch (get): a grant to build wakes no one
                self._cond.notify_all()
        if new:
            self.on_grant()
        return len(new)

    def revoke(self, stream: Stream, indices) -> int:
        """A Batches call's client takes grants back (``indices``; None: all of them): those not
        sent yet are not sent (a built copy stays as history, as any batch no reader needs).
        Returns how many were revoked."""
        with self._cond:
            revoked = 0
            for b in list(stream.granted) if indices is None else indices:
                if b in stream.granted:
                    stream.sent(b, revoked=True)
                    revoked += 1
                    self._settle(b)
            self._cond.notify_all()
            return revoked

    def wake(self) -> None:
        """Wake the readers waiting in ``get`` (a Batches call's client half-closed or erred)."""
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop: built batches are released now, those in flight when they arrive, and those a reader
        is still sending (a stream moved away, or waiting for a lease) when it puts them back."""
        with self._cond:
            self.closed = True
            ready = {b: x for b, x in self._ready.items() if not self._users[b]}
            self._ready = {b: x for b, x in self._ready.items() if self._users[b]}
            self._history.clear()
            self._retry.clear()
            self._queue.clear()
            self._queued.clear()
            for error in self._failed.values():
                # raised from get(), the error's traceback holds frames that hold this
                # computation: a cycle that would keep the shard's indices (80 MB at 10M rows)
                # until a full garbage collection
                error.__traceback__ = None
            self._cond.notify_all()
        for batch in ready.values():
            self._release_slot(batch.slot)

