"""Streams: one call's cursor into a (possibly shared) computation (``computation.py``), what it
was granted, what it sent and what its client took (for stats).

Two kinds, one machinery. A StreamBatches call is *ordered*: the server grants on the client's
behalf every stride-th batch from ``position``, ``prefetch`` ahead, up to ``end``, and sends them
in index order. A Batches call is *granted*: its client grants batch indices (``grant``:
idempotent, a batch outstanding is not granted twice, one sent or revoked is granted anew; at
most ``max_grants`` granted and unsent), takes grants back (``revoke``), and the stream sends any
granted batch that is built, lowest index first. Its ``position`` is its lowest granted batch not
yet sent (one past the highest it ever granted while none is outstanding). A Batches call that
switches to another request (a later ``open``: the next epoch) gets a new stream, numbered by
``open_seq`` (0, 1, ...), which every batch it sends carries.

The grant state (``granted``, ``ready``, ``position``) changes only under the stream's
computation's lock; stats read it without (an int, a ``len``).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time

import numpy as np

from batchd.errors import ResourceExhaustedError
from batchd.server.compute.protocol import StreamRequest
from batchd.server.compute.rates import RateMeter
from batchd.server.compute.work import ReadyBatch
from batchd.server.serve.computation import Computation, _Moved

__all__ = ["Computation", "ReadyBatch", "Stream"]

_stream_ids = itertools.count(1)
# what a client's profile may report (StreamProgress.verdict; batchd.client.loader.profile.VERDICTS)
VERDICTS = frozenset({"trainer-bound", "storage-bound", "cpu-bound", "transport-bound", "copy-bound"})


class Stream:
    """One StreamBatches call (``request.granted`` false: ordered) or Batches call (granted): a
    client's place in a (possibly shared) computation."""

    def __init__(self, request: StreamRequest, num_batches: int, open_seq: int = 0):
        self.id = next(_stream_ids)
        self.open_seq = open_seq  # a Batches call's count of `open` messages before this stream's (Batch.open_seq)
        self.request = request
        self.ordered = not request.granted
        self.num_batches = num_batches  # in the epoch (its remainder from request.start_position) for this shard
        self.end = min(num_batches, request.end_batch or num_batches)  # the stream stops before this batch
        self.prefetch = request.prefetch
        # ordered: the batch this client gets next (steps by request.stride); granted: the lowest granted not sent
        self.position = request.first_batch if self.ordered else 0
        # --- a Batches call's grants (under the computation's lock) ---------------------------------
        self.granted: dict[int, None] = {}  # granted, not sent, not revoked (grant order)
        self.ready: set[int] = set()  # ... of them built
        self._low: list[int] = []  # heap of granted indices (stale ones popped lazily)
        self._high = 0  # one past the highest index granted
        self.granted_total = 0
        self.revoked_total = 0
        self.half_closed = False  # the client will grant nothing more
        self.done = False  # ... and said so (BatchesControl.done): the stream counts finished, not cancelled
        self.interrupted = False  # stop waiting: the call ends (a control error)
        self.failed = False  # the call ended with an error (a batch's, or a control message's)
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
        self.data_bytes_sent = 0  # bytes written on its data connection, headers and padding included (socket)
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
        """The next batch to send (ordered: the next in index order; granted: the lowest-index granted
        batch that is built), or None if none came within ``timeout`` seconds, the stream is over
        (``finished``), or it was interrupted. The caller sends it, then calls ``release``.

        Raises the computation's error (a worker's exception, re-raised with its traceback) in place
        of the failed batch, once every batch the stream wants below it has been taken.
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
        """Ordered: sent its last batch. Granted: the client half-closed and every grant was sent (or
        revoked); it counts finished only if the client said ``done`` (``completed``)."""
        if self.ordered:
            return self.position >= self.end
        return self.half_closed and not self.granted

    @property
    def completed(self) -> bool:
        """Finished as the client meant it to: ordered and sent its last batch, or granted and
        finished after the client said ``done`` (a request stream that just ended may be a cancel)."""
        return self.finished and (self.ordered or self.done)

    @property
    def idle(self) -> bool:
        """Nothing to wait for: finished, or (granted) the call is being ended."""
        return self.finished or self.interrupted

    @property
    def batches_due(self) -> int:
        """Batches this stream sends in all: ordered, every stride-th from its first one up to
        ``end``; granted, those granted and not revoked so far."""
        if not self.ordered:
            return self.granted_total - self.revoked_total
        first, stride = self.request.first_batch, self.request.stride
        return max(0, -(-(self.end - first) // stride))

    @property
    def outstanding(self) -> int:
        """Batches granted and not yet sent (ordered: those of its prefetch window)."""
        if not self.ordered:
            return len(self.granted)
        return len(range(self.position, min(self.end, self.position + self.prefetch * self.request.stride),
                         self.request.stride))

    # --- grants (called by the computation, under its lock) -----------------------------------------

    def needs(self, b: int) -> bool:
        """The stream will send batch b if it is built (an ordered stream: any of its batches from
        its position on; granted: a batch granted and not sent)."""
        if not self.ordered:
            return b in self.granted
        r = self.request
        return self.position <= b < self.end and (b - r.first_batch) % r.stride == 0

    def wants(self, b: int) -> bool:
        """Batch b is granted: to be built now (an ordered stream: within ``prefetch`` of its position)."""
        if not self.ordered:
            return b in self.granted
        return self.needs(b) and b < self.position + self.prefetch * self.request.stride

    def wanted(self) -> list[int]:
        """Every batch granted now, in grant order."""
        if not self.ordered:
            return list(self.granted)
        stride = self.request.stride
        return list(range(self.position, min(self.end, self.position + self.prefetch * stride), stride))

    def new_grants(self, indices, max_grants: int) -> list[int]:
        """The batches of ``indices`` not outstanding now, each once, in order (a grant is
        idempotent: one outstanding is not granted again; one sent or revoked is granted anew).
        Raises ValueError naming an index out of [0, num_batches), ResourceExhaustedError if the
        grants not yet sent would exceed ``max_grants``; then nothing is granted."""
        new: dict[int, None] = {}
        for b in indices:
            if not 0 <= b < self.num_batches:
                raise ValueError(f"grant: batch {b} is not in [0, {self.num_batches}) (the epoch's batches)")
            if b not in self.granted:
                new[b] = None
        if len(self.granted) + len(new) > max_grants:
            raise ResourceExhaustedError(
                f"grant: {len(self.granted) + len(new)} batches granted and not yet sent on this call, more than "
                f"the server's max_grants={max_grants}")
        return list(new)

    def add_grant(self, b: int) -> None:
        self.granted[b] = None
        heapq.heappush(self._low, b)
        self._high = max(self._high, b + 1)
        self.granted_total += 1
        self._lowest()

    def sent(self, b: int, *, revoked: bool = False) -> None:
        """Granted batch b is being sent (or was revoked): no longer outstanding."""
        del self.granted[b]
        self.ready.discard(b)
        if revoked:
            self.revoked_total += 1
        self._lowest()

    def _lowest(self) -> None:
        low = self._low
        while low and low[0] not in self.granted:
            heapq.heappop(low)
        self.position = low[0] if low else self._high

    # --- the call's side -----------------------------------------------------------------------------

    def grant(self, indices, *, max_grants: int) -> int:
        """Grant batch indices (a Batches call); returns how many were not outstanding. Raises as
        ``new_grants``."""
        return self.computation.grant(self, indices, max_grants=max_grants)

    def revoke(self, indices) -> int:
        """Take grants back (a Batches call); returns how many were outstanding."""
        return self.computation.revoke(self, indices)

    def revoke_all(self) -> int:
        """Take every grant back (the call switches to another request); returns how many."""
        c = self.computation
        return 0 if c is None else c.revoke(self, None)

    def switch(self) -> None:
        """The call switched to another request (a later ``open``): every grant is revoked and the
        stream ends as finished once what is being sent went out."""
        self.revoke_all()
        self.interrupt(half_closed=True, done=True)

    def interrupt(self, *, half_closed: bool = False, done: bool = False) -> None:
        """The client half-closed (``half_closed``; ``done``: it said so), or the call must end now:
        wake its waiting sender."""
        if half_closed:
            self.done = self.done or done  # (first: a sender that sees half_closed sees done)
            self.half_closed = True
        else:
            self.interrupted = True
        c = self.computation
        if c is not None:
            c.wake()

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
        """(batches being built, batches built and waiting) for this stream (``Computation.backlog``)."""
        return self.computation.backlog(self) if self.computation is not None else (0, 0)
