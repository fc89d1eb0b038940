"""Streams: one StreamBatches call's cursor into a (possibly shared) computation (``computation.py``),
and what it sent and what its client took (for stats)."""

from __future__ import annotations

import itertools
import threading
import time

import numpy as np

from batchd.server.serve.computation import Computation, ReadyBatch, _Moved
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.stats import RateMeter

__all__ = ["Computation", "ReadyBatch", "Stream"]

_stream_ids = itertools.count(1)
# what a client's profile may report (StreamProgress.verdict; batchd.client.profile.VERDICTS)
VERDICTS = frozenset({"trainer-bound", "storage-bound", "cpu-bound", "transport-bound", "copy-bound"})


class Stream:
    """One StreamBatches call: a client's position in a (possibly shared) computation."""

    def __init__(self, request: StreamRequest, num_batches: int):
        self.id = next(_stream_ids)
        self.request = request
        self.num_batches = num_batches  # in the epoch (its remainder from request.start_position) for this shard
        self.end = min(num_batches, request.end_batch or num_batches)  # the stream stops before this batch
        self.prefetch = request.prefetch
        self.position = request.first_batch  # the batch this client gets next (steps by request.stride)
        self.computation: Computation | None = None
        self.closed = False  # set by Loader.close_stream; a closed stream is never moved
        self._from: Computation | None = None  # the computation of the batch being sent
        self.started = time.monotonic()
        self.batches_sent = 0
        self.samples_sent = 0
        # --- for stats (server/serve/stats.py) -----------------------------------------------------
        self.bytes_sent = 0  # gRPC message bytes yielded
        self.peer = request.peer  # the client, as grpc's context.peer() names it
        self.transport = request.transport  # "shm" when batches are lent over a shared-memory session
        self.was_shared = False  # read batches that another stream also read
        self.waiting_since: float | None = None  # monotonic time the RPC began waiting for a batch
        self.meter = RateMeter()  # samples sent per second, moving
        self.bytes_copied = 0  # batch bytes copied out of slots for this stream (server/serve/transport.py)
        # what the client took (progress reports, else leases it released): server/serve/transport.py
        self.batches_taken = 0
        self.samples_taken = 0
        self.reports_progress = False  # the client reports progress: released leases no longer count
        self.taken_meter = RateMeter()  # samples taken per second, moving
        self.reorder_seconds = 0.0  # how long the batch being sent waited, built, in the reorder buffer
        self.send_started: float | None = None  # perf_counter() when the servicer began sending it
        self.busy_mark: tuple[float, float] | None = None  # the pool's (busy, alive) worker-seconds at its first batch
        # what the client reports of its training loop (StreamProgress): wait_ratio None until it does
        self.wait_ratio: float | None = None
        self.verdict = ""
        self.wait_reported_at = 0.0  # time.monotonic() of the last report
        self._lock = threading.Lock()

    @property
    def shared(self) -> bool:
        """Reading a computation together with other streams right now."""
        c = self.computation
        return c is not None and c.readers > 1

    @property
    def error(self) -> BaseException | None:
        c = self.computation
        return None if c is None else c.error

    @property
    def samples_skipped(self) -> int:
        c = self.computation
        return 0 if c is None else c.samples_skipped

    @property
    def indices(self) -> np.ndarray:
        return self.computation.indices

    def next(self, timeout: float) -> ReadyBatch | None:
        """The next batch in order, or None if none came within ``timeout`` seconds or the stream is over.

        Raises the computation's error (a worker's exception, re-raised with its traceback) once
        the batches before it have been taken.
        """
        deadline = time.monotonic() + timeout
        while True:
            computation = self.computation
            try:
                batch = computation.get(self, max(0.0, deadline - time.monotonic()))
            except _Moved:
                continue
            if batch is not None:
                self._from = computation  # where release() must return it
                self.reorder_seconds = max(0.0, time.monotonic() - batch.ready_at) if batch.ready_at else 0.0
                if computation.readers > 1:
                    self.was_shared = True
            return batch

    @property
    def next_index(self) -> int:
        return self.position

    @property
    def finished(self) -> bool:
        return self.position >= self.end

    @property
    def batches_due(self) -> int:
        """Batches this stream sends in all (every stride-th from its first one, up to ``end``)."""
        first, stride = self.request.first_batch, self.request.stride
        return max(0, -(-(self.end - first) // stride))

    def release(self, batch: ReadyBatch, *, sent: bool = True) -> None:
        """The batch was sent (copied into a message, or its slot lent under a lease that holds a
        reference of its own), or will not be (``sent=False``): the computation drops it once no
        reader needs it."""
        self._from.put_back(batch)
        if not sent:
            return
        n = batch.tensors[0].samples
        with self._lock:
            self.batches_sent += 1
            self.samples_sent += n
        self.meter.add(n)

    def took(self, batches: int, samples: int, *, reported: bool) -> None:
        """The client took batches: ``reported`` totals from its progress reports (the first replaces
        what released leases counted; later ones only raise it), else one more released lease
        (``batches`` and ``samples`` added, until the client reports progress)."""
        with self._lock:
            if reported:
                if not self.reports_progress:
                    self.reports_progress = True
                    self.batches_taken = self.samples_taken = 0
                added = max(0, samples - self.samples_taken)
                self.batches_taken = max(self.batches_taken, batches)
                self.samples_taken = max(self.samples_taken, samples)
            elif self.reports_progress:
                return
            else:
                added = samples
                self.batches_taken += batches
                self.samples_taken += samples
        if added:
            self.taken_meter.add(added)

    def client_waits(self, wait_ratio: float, verdict: str) -> None:
        """The client's report of its training loop (StreamProgress): the fraction of its time spent
        waiting for this stream's batches (clipped to [0, 1]) and its profile verdict (one of
        ``VERDICTS``; anything else is kept as "")."""
        self.wait_ratio = min(1.0, max(0.0, float(wait_ratio))) if wait_ratio == wait_ratio else 0.0  # NaN: 0
        self.verdict = verdict if verdict in VERDICTS else ""
        self.wait_reported_at = time.monotonic()

    def backlog(self) -> tuple[int, int]:
        """(batches being built, batches built and waiting) in this stream's computation."""
        return self.computation.backlog(self.position) if self.computation is not None else (0, 0)
