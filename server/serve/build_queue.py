"""The pool's side of a computation: the queue of batches to build, and the built ones coming back.

``BuildQueue`` is the part of ``Computation`` (``computation.py``) that implements compute's
``Work`` protocol (server/compute/work.py), called from the pool's thread: the batches its
readers granted are built in grant order, a retried one first (``wants_work``, ``take_task``),
never one built or being built already, nor one at or past a failure; a built batch joins the
reorder buffer (``done``), a batch whose worker died is queued again (``retry``), a failure
stops everything from the failed batch on (``fail``).
"""

from __future__ import annotations

import numpy as np

from batchd.sampler import global_positions, sample_key
from batchd.server.compute.work import ReadyBatch


class BuildQueue:
    """Mixed into ``Computation``: needs its ``_cond``, ``closed``, ``_readers``, ``_queue``,
    ``_queued``, ``_retry``, ``_in_flight``, ``_ready``, ``_failed``, ``error``, ``attempts``,
    ``num_batches``, ``request``, ``indices``, ``sources``, ``_wanted``, ``_settle``, ``_back`` and
    ``_release_slot``; every method takes ``_cond``."""

    def _buildable(self, b: int, limit: int) -> bool:
        return b < limit and b not in self._ready and b not in self._in_flight and self._wanted(b)

    def wants_work(self) -> bool:
        with self._cond:
            return self._has_work()

    def _has_work(self) -> bool:
        """(Under the lock.) Whether a batch is there to build: a retried one, or one granted and
        not built nor being built; drops queued batches that can no longer be built."""
        if self.closed or not self._readers:
            return False
        limit = min(self._failed) if self._failed else self.num_batches  # nothing past a failure
        while self._retry and not self._buildable(self._retry[0], limit):
            self._retry.popleft()
        if self._retry:
            return True
        while self._queue and not self._buildable(self._queue[0], limit):
            self._queued.discard(self._queue.popleft())
        return bool(self._queue)

    def take_task(self) -> int | None:
        """The batch index to build next (a retried one first), or None if there is none any more.

        The pool asks ``wants_work`` and then, holding a slot, takes the task: in between, another
        thread may close the computation or revoke the grant (each under this lock), so the check
        is made again here, with the take, under the same lock."""
        with self._cond:
            if not self._has_work():
                return None
            if self._retry:
                b = self._retry.popleft()
            else:
                b = self._queue.popleft()
                self._queued.discard(b)
            self._in_flight.add(b)
            return b

    def batch_indices(self, b: int) -> np.ndarray:
        bs = self.request.batch_size
        return self.indices[b * bs : (b + 1) * bs]

    def batch_sources(self, b: int) -> np.ndarray | None:
        """A mix's source of each of batch b's samples, int64 [B]; None for one dataset."""
        if self.sources is None:
            return None
        bs = self.request.batch_size
        return self.sources[b * bs : (b + 1) * bs]

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
        b = batch.batch_index
        with self._cond:
            self._in_flight.discard(b)
            if self.closed or b in self._ready:
                self._release_slot(batch.slot)  # nobody needs it (anymore)
                return
            self._ready[b] = batch
            wanted = False
            for r in self._readers.values():
                if r.ordered:
                    wanted = True
                elif b in r.granted:
                    r.ready.add(b)
                    wanted = True
            self._settle(b)
            if wanted:  # a batch no reader was granted (kept for another) wakes no sender
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
