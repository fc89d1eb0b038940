"""One client's stream of batches: what to build next, and the ordered reorder buffer.

Workers finish batches in any order; ``Stream.next`` hands them out strictly by batch index.
At most ``prefetch`` batches are in flight or waiting in the buffer, so a slow reader holds at
most ``prefetch`` slots. The pool thread calls ``take_task``/``done``/``retry``/``fail``; the
RPC thread calls ``next``/``release``/``close``. All state is under one condition variable.
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from batchd.server.protocol import TensorLayout
from batchd.server.shm import Segment
from batchd.server.stats import RateMeter

_ids = itertools.count(1)


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """A validated StreamBatches request (see loader.proto for the fields)."""

    dataset: str
    pipeline_key: str
    pipeline_json: str
    pipeline_name: str
    batch_size: int
    shuffle: bool
    seed: int
    epoch: int
    drop_last: bool
    rank: int
    world_size: int
    start_batch: int
    prefetch: int


@dataclass(slots=True)
class ReadyBatch:
    """A finished batch waiting in its slot. ``release`` must be called once it is sent."""

    batch_index: int
    slot: Segment
    tensors: tuple[TensorLayout, ...]
    timings: dict[str, float] = field(default_factory=dict)
    skipped: tuple[int, ...] = ()


class Stream:
    """State of one StreamBatches call. ``indices`` is this shard's sample order, int64 [N]."""

    def __init__(self, request: StreamRequest, indices: np.ndarray, num_batches: int, release_slot):
        self.id = next(_ids)
        self.request = request
        self.indices = indices
        self.num_batches = num_batches
        self.prefetch = request.prefetch
        self._release_slot = release_slot
        self._cond = threading.Condition()
        self._next_submit = request.start_batch
        self._next_yield = request.start_batch
        self._retry: collections.deque[int] = collections.deque()
        self._in_flight: set[int] = set()
        self._ready: dict[int, ReadyBatch] = {}
        self.attempts: collections.Counter[int] = collections.Counter()
        self.error: BaseException | None = None  # set on the first failure: nothing new is submitted
        self._failed: dict[int, BaseException] = {}  # batch index -> why it could not be built
        self.closed = False
        self.slot_hint = 0  # bytes of the last batch: the slot size to ask for next
        self.started = time.monotonic()
        self.batches_sent = 0
        self.samples_sent = 0
        self.samples_skipped = 0
        # --- for stats (server/stats.py); set by the servicer, which knows the call ---------
        self.bytes_sent = 0  # gRPC message bytes yielded
        self.peer = ""  # the client, as grpc's context.peer() names it
        self.transport = "inline"  # "shm" when batches are lent over a shared-memory session
        self.shared = False  # computed once for several identical streams
        self.waiting_since: float | None = None  # monotonic time the RPC began waiting for a batch
        self.meter = RateMeter()  # samples sent per second, moving

    # --- pool thread -------------------------------------------------------------------------

    def wants_work(self) -> bool:
        with self._cond:
            if self.closed:
                return False
            limit = min(self._failed) if self._failed else self.num_batches  # nothing past a failure
            while self._retry and self._retry[0] >= limit:
                self._retry.popleft()
            if not self._retry and self._next_submit >= limit:
                return False
            return len(self._in_flight) + len(self._ready) < self.prefetch

    def take_task(self) -> int:
        """The batch index to build next (a retried one first). Call only if wants_work()."""
        with self._cond:
            b = self._retry.popleft() if self._retry else self._take_next()
            self._in_flight.add(b)
            return b

    def _take_next(self) -> int:
        b = self._next_submit
        self._next_submit += 1
        return b

    def batch_indices(self, b: int) -> np.ndarray:
        bs = self.request.batch_size
        return self.indices[b * bs : (b + 1) * bs]

    def done(self, batch: ReadyBatch) -> None:
        with self._cond:
            self._in_flight.discard(batch.batch_index)
            if self.closed:
                self._release_slot(batch.slot)
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
        """Batch ``batch_index`` (or, if None, the whole stream) failed with ``error``.

        Batches before a failed one are still delivered; the error is raised in its place.
        """
        with self._cond:
            if batch_index is None:
                self._failed.setdefault(self._next_yield, error)
            else:
                self._in_flight.discard(batch_index)
                self._failed.setdefault(batch_index, error)
            if self.error is None:
                self.error = error
            self._cond.notify_all()

    # --- RPC thread --------------------------------------------------------------------------

    def next(self, timeout: float) -> ReadyBatch | None:
        """The next batch in order, or None if none came within ``timeout`` seconds or the stream is over.

        Raises the stream's error (a worker's exception, re-raised with its traceback) once
        the batches before it have been taken.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                batch = self._ready.pop(self._next_yield, None)
                if batch is not None:
                    self._next_yield += 1
                    return batch
                if self.error is not None and min(self._failed) <= self._next_yield:
                    raise self._failed[min(self._failed)]
                if self.finished or self.closed:
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._cond.wait(remaining)

    @property
    def next_index(self) -> int:
        """The batch the client gets next."""
        return self._next_yield

    @property
    def finished(self) -> bool:
        return self._next_yield >= self.num_batches

    def release(self, batch: ReadyBatch, *, lent: bool = False) -> None:
        """The batch was sent: its slot can be reused (unless it was lent to the client)."""
        if not lent:
            self._release_slot(batch.slot)
        with self._cond:
            self.batches_sent += 1
            self.samples_sent += batch.tensors[0].shape[0]
        self.meter.add(batch.tensors[0].shape[0])

    def backlog(self) -> tuple[int, int]:
        """(batches being built, batches built and waiting in the reorder buffer)."""
        with self._cond:
            return len(self._in_flight), len(self._ready)

    def close(self) -> None:
        """Stop: batches waiting are released now, those in flight when they arrive."""
        with self._cond:
            self.closed = True
            ready, self._ready = self._ready, {}
            self._retry.clear()
            self._cond.notify_all()
        for batch in ready.values():
            self._release_slot(batch.slot)
