"""What the pool builds batches for: ``Work`` (a computation as the scheduler sees it) and the
``ReadyBatch`` it hands back.

The pool (``pool.py``) depends on this interface, not on the streams' side: serve's
``Computation`` (server/serve/computation.py) implements it. In each dispatch the scheduler asks
a computation whether it wants work (``wants_work``), acquires a slot, and takes the batch index
to build (``take_task``: the computation may have closed, or a grant been revoked, in between, so
it may return None); the task carries the batch's samples (``batch_indices``), their global
positions (``batch_positions``) and the epoch's key (``random_key``). When the worker answers,
the pool hands the built batch back (``done``), queues it again (``retry``: its worker died) or
fails it (``fail``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from batchd.server.compute.protocol import StreamRequest, TensorLayout
from batchd.server.shm import Segment


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


class Work(Protocol):
    """The batches of one computation, as the pool's scheduler sees them. Every method may be
    called from the pool's thread while other threads (the streams' RPCs) use the computation:
    each takes the computation's own lock.

    id: the computation's number (logs). request: what every batch is built from (dataset,
    pipeline, batch_size, seed, epoch, image_encoding, hedge...). indices: this shard's sample
    order, int64 [N]. closed: nothing more is built (no reader is left, or it was closed).
    slot_hint: bytes of its last batch, the slot size to ask for next (the pool sets it).
    samples_skipped: bad samples left out so far (``on_error: skip``; the pool counts them).
    """

    id: int
    request: StreamRequest
    indices: np.ndarray
    closed: bool
    slot_hint: int
    samples_skipped: int

    def wants_work(self) -> bool:
        """Whether a batch is there to build: one to retry, or one granted and neither built nor being built."""
        ...

    def take_task(self) -> int | None:
        """The batch index to build next (a retried one first), now in flight; None if there is none any more."""
        ...

    def batch_indices(self, b: int) -> np.ndarray:
        """The sample indices of batch b: int64 [B] (the last batch of an epoch may be shorter)."""
        ...

    def batch_sources(self, b: int) -> np.ndarray | None:
        """A mix's source of each of batch b's samples, int64 [B] (``request.mix.sources[k]``); None
        when every sample is of ``request.dataset``."""
        ...

    def batch_positions(self, b: int) -> np.ndarray:
        """The global positions of batch b's samples (``batchd.sampler.global_positions``): int64 [B]."""
        ...

    def random_key(self) -> np.ndarray:
        """The key of the epoch's per-sample augmentation streams (``batchd.sampler.sample_key``): uint64 [2]."""
        ...

    def done(self, batch: ReadyBatch) -> None:
        """Batch ``batch.batch_index`` was built: keep it for its readers (its slot is theirs now)."""
        ...

    def retry(self, b: int) -> int:
        """Build batch b again (its worker died); returns how many times it has been tried."""
        ...

    def fail(self, error: BaseException, batch_index: int | None = None) -> None:
        """Batch ``batch_index`` (None: everything from the slowest reader on) failed with ``error``."""
        ...

    def evict_history(self) -> int:
        """Release the built batches kept only for late joiners (the slots ran short); returns how many."""
        ...

    def close(self) -> None:
        """Stop: build nothing more; built batches go back as their readers let go of them."""
        ...
