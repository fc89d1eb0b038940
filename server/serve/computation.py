"""Computations: what to build next for the streams reading them, and the ordered reorder buffer.

(``Stream``, one client's cursor, is in ``stream.py``.)

A ``Computation`` builds the batches of one (dataset, pipeline, batch_size, shuffle, seed,
epoch, drop_last, rank, world_size, start_position): those fields fix every batch's bytes, so streams (clients)
that agree on them can share one computation. A ``Stream`` is one client's cursor into a
computation. Workers finish batches in any order; ``Stream.next`` hands them out strictly by
batch index.

Bounds, with ``front``/``back`` the positions of the fastest/slowest reader:

* batch ``b`` is built only if ``b < front + prefetch`` (prefetch: the largest of the readers'),
  so a lone reader has at most ``prefetch`` batches in flight or buffered;
* built batches are kept until every reader has passed them, and then up to ``window`` more
  as history, so a stream that starts a little later (another experiment launched a few
  seconds after the first) joins and reads them instead of recomputing; history goes first
  when the slot pool runs short (``evict_history``). At most ``2 * window + prefetch`` slots;
* a reader more than ``window`` batches behind the fastest is moved to a computation of its
  own, starting at its position: it gets the same bytes (recomputed), and nobody waits for it
  (Ray Data's streaming_split makes every consumer wait for the slowest, ray#41973).

The pool thread calls ``wants_work``/``take_task``/``done``/``retry``/``fail`` on computations;
RPC threads call ``next``/``release``/``close`` on streams. A computation's state is under its
condition variable.

Strided streams (a client spreading an epoch over ``stride`` servers) read the batches
``first, first + stride, ...`` only. Positions are still batch indices and advance by ``stride``;
``prefetch`` and ``window`` count this stream's batches (so they span ``stride`` times as many
indices). The residue ``first % stride`` is part of the sharing key: only streams reading the
same batches share a computation. So is ``end_batch`` (a hedged request for one batch builds
that batch only, and never limits a stream reading on).
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from batchd.sampler import global_positions, sample_key
from batchd.server.compute.protocol import StreamRequest, TensorLayout
from batchd.server.serve.shm import Segment

if TYPE_CHECKING:
    from batchd.server.serve.stream import Stream

log = logging.getLogger(__name__)

_computation_ids = itertools.count(1)


@dataclass(slots=True)
class ReadyBatch:
    """A finished batch waiting in its slot. ``Stream.release`` must be called once it is sent.

    timings: the worker's ``BatchDone.timings`` plus "queued" and "worker" (``WorkerPool``);
    ready_at: ``time.monotonic()`` when it came back from its worker (its reorder wait starts).
    """

    batch_index: int
    slot: Segment
    tensors: tuple[TensorLayout, ...]
    timings: dict[str, float] = field(default_factory=dict)
    skipped: tuple[int, ...] = ()
    ready_at: float = 0.0


class _Moved(Exception):
    """The reader was moved to another computation while it waited."""


class Computation:
    """The batches of one request key, built once for every stream reading it.

    indices: this shard's sample order, int64 [N] (of the epoch's remainder from
    ``request.start_position``). num_batches: nothing at or past this batch index is built (the
    epoch's end, or ``request.end_batch``). window: how far (batches) readers may drift apart
    before the slowest is moved to a computation of its own.
    """

    def __init__(self, request: StreamRequest, indices: np.ndarray, num_batches: int, *,
                 release_slot: Callable[[Segment], None], window: int, start: int):
        self.id = next(_computation_ids)
        self.request = request
        self.indices = indices
        self.num_batches = num_batches
        self.window = window
        self.stride = request.stride  # positions step by this; window and prefetch count steps
        self._release_slot = release_slot
        self._cond = threading.Condition()
        self._readers: dict[int, Stream] = {}
        self._next_submit = start
        self._history_start = start  # every batch in [_history_start, _next_submit) is built or being built
        self._retry: collections.deque[int] = collections.deque()
        self._in_flight: set[int] = set()
        self._ready: dict[int, ReadyBatch] = {}
        self._users: collections.Counter[int] = collections.Counter()  # readers encoding batch b now
        self.attempts: collections.Counter[int] = collections.Counter()
        self.error: BaseException | None = None  # set on the first failure: nothing new is submitted
        self._failed: dict[int, BaseException] = {}  # batch index -> why it could not be built
        self.closed = False
        self.slot_hint = 0  # bytes of the last batch: the slot size to ask for next
        self.samples_skipped = 0
        self.on_fall_behind: Callable[[Stream], None] = lambda stream: None

    # --- readers -----------------------------------------------------------------------------

    def attach(self, stream: Stream, *, first: bool = False) -> bool:
        """Add a reader at ``stream.position``; False if this computation cannot serve it from there
        (its batches before that are gone, or it is too far ahead to share)."""
        with self._cond:
            if self.closed or self.error is not None:
                return False
            if not first and not self._history_start <= stream.position <= self._next_submit:
                return False
            self._readers[stream.id] = stream
            stream.computation = self
            self._cond.notify_all()
            return True

    def detach(self, stream: Stream) -> bool:
        """Remove a reader; its batches go back once nobody needs them. True if no reader is left."""
        with self._cond:
            self._readers.pop(stream.id, None)
            empty = not self._readers
            if empty:
                self.closed = True
            self._sweep()
            self._cond.notify_all()
            return empty

    @property
    def readers(self) -> int:
        with self._cond:
            return len(self._readers)

    def _back(self) -> int:
        return min((r.position for r in self._readers.values()), default=self._next_submit)

    def _front(self) -> int:
        return max((r.position for r in self._readers.values()), default=self._next_submit)

    def _sweep(self, keep: int | None = None) -> int:
        """Release built batches that every reader has passed (and none is still sending), oldest
        first, keeping the last ``keep`` (default: window) as history. Returns how many."""
        if not self._readers:  # nobody will read anything: release all that is not being sent
            idle = [b for b in self._ready if not self._users[b]]
            for b in idle:
                self._release_slot(self._ready.pop(b).slot)
            return len(idle)
        limit = min(self._back(), self._front() - (self.window if keep is None else keep) * self.stride)
        released = 0
        while self._history_start < limit:
            b = self._history_start
            if self._users[b]:
                break
            batch = self._ready.pop(b, None)
            if batch is not None:
                self._release_slot(batch.slot)
                released += 1
            self._users.pop(b, None)
            self._history_start = b + self.stride
        return released

    def evict_history(self) -> int:
        """Release every passed batch kept as history (the slot pool is short). Returns how many."""
        with self._cond:
            return self._sweep(keep=0)

    # --- pool thread -------------------------------------------------------------------------

    def wants_work(self) -> bool:
        with self._cond:
            if self.closed or not self._readers:
                return False
            limit = min(self._failed) if self._failed else self.num_batches  # nothing past a failure
            back = self._back()
            self._retry = collections.deque(b for b in self._retry if back <= b < limit)
            if self._retry:
                return True
            prefetch = max(r.prefetch for r in self._readers.values())
            return self._next_submit < min(limit, self._front() + prefetch * self.stride)

    def take_task(self) -> int:
        """The batch index to build next (a retried one first). Call only if wants_work()."""
        with self._cond:
            if self._retry:
                b = self._retry.popleft()
            else:
                b, self._next_submit = self._next_submit, self._next_submit + self.stride
            self._in_flight.add(b)
            return b

    def batch_indices(self, b: int) -> np.ndarray:
        bs = self.request.batch_size
        return self.indices[b * bs : (b + 1) * bs]

    def batch_positions(self, b: int) -> np.ndarray:
        """Global positions (``batchd.sampler.global_positions``) of batch b's samples: int64 [B]."""
        bs, req = self.request.batch_size, self.request
        start = min(b * bs, len(self.indices))
        return global_positions(start, min(start + bs, len(self.indices)), rank=req.rank, world_size=req.world_size,
                                start_position=req.start_position)

    def random_key(self) -> np.ndarray:
        """The key of this epoch's per-sample augmentation streams (``batchd.sampler.sample_key``): uint64 [2]."""
        return sample_key(seed=self.request.seed, epoch=self.request.epoch)

    def done(self, batch: ReadyBatch) -> None:
        with self._cond:
            self._in_flight.discard(batch.batch_index)
            if self.closed or batch.batch_index < self._history_start:
                self._release_slot(batch.slot)  # nobody needs it (anymore)
                return
            self._ready[batch.batch_index] = batch
            self._cond.notify_all()

    def retry(self, b: int) -> int:
        """Build batch b again (its worker died); returns how many times it has been tried."""
        with self._cond:
            self._in_flight.discard(b)
            self.attempts[b] += 1
            if not self.closed:
                self._retry.appendleft(b)
            return self.attempts[b]

    def fail(self, error: BaseException, batch_index: int | None = None) -> None:
        """Batch ``batch_index`` (or, if None, everything from the slowest reader on) failed.

        Batches before a failed one are still delivered; the error is raised in its place.
        """
        with self._cond:
            if batch_index is None:
                self._failed.setdefault(self._back(), error)
            else:
                self._in_flight.discard(batch_index)
                self._failed.setdefault(batch_index, error)
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    def backlog(self, position: int = 0) -> tuple[int, int]:
        """(batches being built, batches built and waiting at or after ``position``); history
        kept for late joiners does not count."""
        with self._cond:
            return len(self._in_flight), sum(1 for b in self._ready if b >= position)

    # --- RPC threads -------------------------------------------------------------------------

    def get(self, stream: Stream, timeout: float) -> ReadyBatch | None:
        """The reader's next batch (see Stream.next). Raises _Moved if it was moved away."""
        deadline = time.monotonic() + timeout
        laggards: list[Stream] = []
        with self._cond:
            while True:
                if stream.id not in self._readers:
                    raise _Moved
                b = stream.position
                batch = self._ready.get(b)
                if batch is not None:
                    self._users[b] += 1
                    stream.position = b + self.stride
                    laggards = [r for r in self._readers.values()
                                if r.position < stream.position - self.window * self.stride]
                    self._sweep()
                    break
                if self._failed and min(self._failed) <= b:
                    raise self._failed[min(self._failed)]
                if b >= self.num_batches or self.closed:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)
        for laggard in laggards:
            self.on_fall_behind(laggard)
        return batch

    def put_back(self, batch: ReadyBatch) -> None:
        """A reader finished sending ``batch`` (a lease, if it lent the slot, holds its own reference)."""
        with self._cond:
            self._users[batch.batch_index] -= 1
            if self.closed and not self._users[batch.batch_index] and self._ready.get(batch.batch_index) is batch:
                del self._ready[batch.batch_index]
                self._release_slot(batch.slot)
                return
            self._sweep()

    def close(self) -> None:
        """Stop: built batches are released now, those in flight when they arrive, and those a reader
        is still sending (a stream moved away, or waiting for a lease) when it puts them back."""
        with self._cond:
            self.closed = True
            ready = {b: x for b, x in self._ready.items() if not self._users[b]}
            self._ready = {b: x for b, x in self._ready.items() if self._users[b]}
            self._retry.clear()
            for error in self._failed.values():
                # raised from get(), the error's traceback holds frames that hold this
                # computation: a cycle that would keep the shard's indices (80 MB at 10M rows)
                # until a full garbage collection
                error.__traceback__ = None
            self._cond.notify_all()
        for batch in ready.values():
            self._release_slot(batch.slot)
