"""One iteration of a loader: batches from one or several servers' ``Batches`` calls, in order.

::

    per server: Batches call --lane thread--> raw reorder buffer (batch index -> WireBatch)
                                                    |
                   one converter thread, in batch order, max_ready ahead (the double buffer:
                   unpack, device copy, gpu_transform, decode_on_client, collate_fn)
                                                    |
                                   consumer: ``Feed.batches()`` yields b, b + 1, ... once each

With one server and CPU tensors as they came, the consumer converts each batch itself ("inline",
``batchd.client.delivery``).

``Feed`` holds the iteration's state under its one lock (``_lock``, with ``_cond`` and ``_work``
on it): the ``Assigner``, the reorder buffer, the lane threads, the error that ends it. This file
holds what changes who reads: servers that join, leave or fail, and what the lane threads report;
the parts have their own files:

* **Lanes** (``batchd.client.lane_runner``). Each server of the iteration has a lane thread
  (``LaneRunner``) that opens its Batches call, checks the server's id (the dataset is described
  again only when it changed), and hands each batch it receives to ``arrive``: it goes in the
  reorder buffer, or is dropped when another server's copy came first (its lease released on the
  call). The ``Assigner`` (``batchd.client.assign``) decides, under the feed's one lock, which
  server is granted which batch index: as each server has room in its window, sized to its rate.
* **The converter and the consumer** (``batchd.client.delivery``, mixed in): the next batch in
  order is converted outside the lock and handed to ``batches()``; while it waits, the converter
  runs the lateness check (hedges, stalled servers) and marks down a server silent for
  ``timeout`` seconds while others sent batches.
* **Failures.** A call that breaks (``ConnectionError``) is opened again within the owner's
  reconnect window (``reconnect_timeout`` with one server, ``failover_timeout`` with several);
  meanwhile its batches stay granted to it (hedges may take them). A server that does not come
  back, or comes back serving other data (the server refuses the call's expected size or
  fingerprints: ``ServerRefused``, or its new id's description differs), is given up
  (``lane_failed``): with one server the iteration raises, with several its batches go to the
  others. With no server left, the owner probes for ``reconnect_timeout`` seconds, then the
  iteration raises ConnectionError. Any other error (a sample that cannot be read, a worker that
  died) ends the iteration with it, after the batches before it that arrived.
* **The end.** Once the converter took the last batch, every call is half-closed (the server
  ends it); calls with grants still outstanding (a stalled server's) are cancelled. Closing the
  feed early (a ``break``) cancels the calls (each reported abandoned with the leases received
  on it) and releases the leases of batches received and never converted (``close``).

The owner (``SingleServerLoader``, ``MultiServerLoader``) provides ``options``, ``_transfer``,
``loader_stats``, ``budget``, ``assignment`` and the failure policy (``Owner``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Iterator, Protocol

from batchd.client.transport import fields

from batchd.client import forks
from batchd.client.assign import Assigner
from batchd.client.delivery import Delivery, release_dropped
from batchd.client.lane_runner import LaneRunner

log = logging.getLogger("batchd.client.loader.loader")


class Owner(Protocol):
    """What a feed needs of the loader it reads for (``SingleServerLoader``, ``MultiServerLoader``)."""

    options: Any
    _transfer: Any
    loader_stats: Any
    budget: Any
    assignment: str
    single: bool

    def reconnect_window(self) -> float: ...

    def lane_down(self, server: Any, error: BaseException, epoch: int, batch: int) -> BaseException | None: ...

    def wait_for_any(self, feed: "Feed", epoch: int, batch: int) -> BaseException | None: ...


def iterate(owner: Any, feed: "Feed") -> Iterator[Any]:
    """``feed``'s batches, as ``owner``'s iteration in progress (``owner._feed`` while they last,
    its figures kept in ``owner._last_figures`` after); the feed is closed at the end or on an
    early exit."""
    owner._feed = feed
    try:
        yield from feed.batches()
    finally:
        feed.close()
        if owner._feed is feed:
            owner._last_figures = feed.last_figures
            owner._feed = None


class Feed(Delivery):
    """Batches ``start .. total - 1`` of ``epoch`` (its remainder from global position
    ``start_position``) from ``servers`` (each with ``conn``, ``address``, ``pace``), in order.
    ``batches()`` is the consumer's iterator; ``close()`` ends everything (idempotent)."""

    def __init__(self, owner: Owner, servers: list[Any], epoch: int, start: int, total: int,
                 start_position: int = 0):
        self.owner = owner
        self.options = owner.options
        self.epoch, self.start, self.total, self.start_position = epoch, start, total, start_position
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)  # the consumer waits on it
        self._work = threading.Condition(self._lock)  # the converter waits on it
        self._loaned = threading.Condition(self._lock)  # a lane thread whose call is on loan waits on it
        # one server, batches handed out as they came: the consumer converts them (no thread hand-off)
        self._inline = owner.single and all(server.conn.converts_inline() for server in servers)
        policy = self.options.hedge if not owner.single else None
        self.assigner = Assigner(start, total, floor=self.options.prefetch, policy=policy,
                                 budget=owner.budget if policy is not None else None, mode=owner.assignment,
                                 count=owner.loader_stats.count)
        # batch -> (WireBatch, server, its connection, call record, receive seconds)
        self._raw: dict[int, tuple[Any, Any, Any, Any, float]] = {}
        self._ready: collections.deque = collections.deque()  # Received, _Failed or _END, in order
        self._runners: dict[Any, LaneRunner] = {}  # server -> its lane thread
        self._fatal: BaseException | None = None
        self._all_down_since: float | None = None
        self.stopping = threading.Event()
        self._closed = False
        self._owner_pid = forks.owner()
        forks.keep(self)
        self._silent_at = 0.0
        self.last_figures: dict = {}  # the assigner's figures when the feed closed
        self._converting: int | None = None  # the batch being converted (still in _raw)
        self._finished = False  # the calls were half-closed (every batch taken)
        with self._lock:
            for server in servers:
                self._add(server)
        self._converter = threading.Thread(target=self._convert_loop, name="batchd-convert", daemon=True)
        self._converter.start()

    # --- lanes -----------------------------------------------------------------------------------

    def add_server(self, server: Any) -> None:
        """A server came (back) up mid-iteration: it gets a lane, and work as it has room."""
        with self._lock:
            if self._closed or server in self._runners or self.assigner.done:
                return
            self._add(server)
            self._all_down_since = None
            self._wake_all()

    def _add(self, server: Any) -> None:  # (under the lock)
        self.assigner.add_lane(server, server.pace, home=server.address)
        runner = self._runners[server] = LaneRunner(self, server)
        runner.start()

    def retire(self, server: Any) -> None:
        """``server`` left the address: its grants go to the others now (not a failure)."""
        with self._lock:
            runner = self._runners.pop(server, None)
            if runner is None:
                return
            lost = self.assigner.remove_lane(server)
            self._fold(server, runner)
            self._plan()
            self._wake_all()
        log.info("%s left the address: its %d batches in flight go to the others", server.address, len(lost))
        runner.stop()

    def mark_all_down(self) -> None:
        """No server was up to begin with: the converter waits for one (``Owner.wait_for_any``)."""
        with self._lock:
            if not self._runners and self._all_down_since is None:
                self._all_down_since = time.monotonic()
                self._wake_all()

    @property
    def all_down_since(self) -> float | None:
        return self._all_down_since

    @property
    def direct(self) -> bool:
        """Whether the consumer reads the batches off the call itself (inline: one server, CPU
        tensors as they came), the call on loan from its lane thread (``batchd.client.lane_runner``)."""
        return self._inline

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def servers(self) -> list[Any]:
        with self._lock:
            return list(self._runners)

    def reads(self, server: Any) -> bool:
        with self._lock:
            return server in self._runners

    # --- from lane threads -------------------------------------------------------------------------

    def opened(self, runner: "LaneRunner") -> None:
        """``runner``'s call is up: grant it again what it held (a broken call lost it), then plan."""
        with self._lock:
            if self._runners.get(runner.server) is not runner:
                return
            # over shared memory, its leases bound it (the call's transport is known now)
            self.assigner.lanes[runner.server].lease_limit = runner.conn.lease_limit() if runner.record.shm else None
            again = self.assigner.open_lane(runner.server)
            if again:
                runner.outbox.grant(again)
            self._plan()

    def arrive(self, runner: "LaneRunner", raw: Any, received: float, nbytes: int, record: Any) -> None:
        """Lane thread: a batch came on ``runner``'s call."""
        b = raw.batch_index
        self.owner.loader_stats.received(*_transport(raw, nbytes))
        if raw.segment:
            if not record.add(raw.lease):
                return  # the call was given up and reported: this lease is the server's, never touch it
            if record.shm is not None:
                record.shm.hold(raw.lease)
        keep = False
        with self._lock:
            if not self._closed and self._runners.get(runner.server) is runner:
                if not self.start <= b < self.total:
                    self._fail(RuntimeError(f"{runner.server.address} sent batch {b}, not one of batches "
                                            f"{self.start}..{self.total - 1} of epoch {self.epoch}"))
                else:
                    arrival = self.assigner.arrived(runner.server, b, time.monotonic(), _work(raw), nbytes)
                    for server, batches in arrival.revoke.items():
                        other = self._runners.get(server)
                        if other is not None and other.outbox is not None:
                            other.outbox.revoke(batches)
                    keep = arrival.keep
                    if keep:
                        self._raw[b] = (raw, runner.server, runner.conn, record, received)
                        runner.failing_since = None
                        if b == self.assigner.base:  # (the one that converts it waits for it)
                            (self._cond if self._inline else self._work).notify_all()
                    self._plan()
        if not keep and raw.segment:
            release_dropped(raw, record)

    def lane_failed(self, runner: "LaneRunner", error: BaseException) -> BaseException | None:
        """``runner``'s server is given up (``error``). Returns the error that ends the iteration
        (one server), or None (its batches went to the others)."""
        with self._lock:
            if self._runners.get(runner.server) is not runner:
                return None
            b = min(runner.server_outstanding(self.assigner), default=self.assigner.base)
        fatal = self.owner.lane_down(runner.server, error, self.epoch, b)
        with self._lock:
            if self._runners.get(runner.server) is runner:
                del self._runners[runner.server]
                self.assigner.remove_lane(runner.server)
                self._fold(runner.server, runner)
            if fatal is not None:
                self._fail(fatal)
            elif not self._runners and self._all_down_since is None:
                self._all_down_since = time.monotonic()
            self._plan()
            self._wake_all()
        return fatal

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._fail(error)

    def _wake_all(self) -> None:  # (under the lock)
        self._cond.notify_all()
        self._work.notify_all()

    def _fail(self, error: BaseException) -> None:  # (under the lock)
        if self._fatal is None:
            self._fatal = error
        self._wake_all()

    def _plan(self) -> None:  # (under the lock)
        grants = self.assigner.plan(time.monotonic())
        self._send(grants)

    def _send(self, grants: dict) -> None:  # (under the lock)
        for server, batches in grants.items():
            runner = self._runners.get(server)
            if runner is not None and runner.outbox is not None:
                runner.outbox.grant(batches)

    def _fold(self, server: Any, runner: "LaneRunner") -> None:  # (under the lock)
        """Add the lane's figures of this iteration to its server's totals."""
        lane = self.assigner.lanes.get(server) or runner.lane
        if lane is not None and not runner.folded:
            runner.folded = True
            server.hedges_issued += lane.hedges_issued
            server.hedges_won += lane.hedges_won
            server.hedges_wasted += lane.hedges_wasted


    # --- the end ---------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop everything: cancel the calls still open (reported abandoned), join the converter,
        give back the leases of batches received and not converted. Idempotent; nothing in a
        forked child (the calls and threads are the parent's)."""
        if forks.forked(self._owner_pid):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.stopping.set()
            runners = list(self._runners.items())
            # servers whose call broke and did not come back before the end: down (the prober tries them)
            broken = [(server, runner.broken_by) for server, runner in runners if runner.broken_by is not None]
            at = self.assigner.base
            raw = [entry for b, entry in self._raw.items() if b != self._converting]
            self._raw.clear()
            self._ready.clear()
            for server, runner in runners:
                self._fold(server, runner)
            self.last_figures = self.assigner.figures()
            self._wake_all()
        for _, runner in runners:
            runner.stop()
        if not self.owner.single:
            for server, error in broken:
                self.owner.lane_down(server, error, self.epoch, at)
        if self._converter is not threading.current_thread():
            self._converter.join(2.0)
        for wire_batch, _, _, record, _ in raw:
            if wire_batch.segment:
                release_dropped(wire_batch, record)
        with self._lock:
            self._ready.clear()  # (a batch the converter finished meanwhile)

    def figures(self) -> dict[Any, dict[str, Any]]:
        """The assigner's per-server figures of this iteration (``Assigner.figures``); in a forked
        child, those it had when the feed closed (the lock may be held by a thread of the parent's
        that does not exist here)."""
        if forks.forked(self._owner_pid):
            return dict(self.last_figures)
        with self._lock:
            return self.assigner.figures()


def _transport(raw: Any, nbytes: int) -> tuple[str, int]:
    """How a batch came and its bytes for ``loader.stats()["bytes_received"]``: shared memory (its
    tensors' bytes in the slot), the socket data plane or inline (the bytes received)."""
    if raw.segment:
        return "shm", sum(fields.nbytes(t) for t in raw.tensors)
    return ("socket" if raw.payload is not None else "inline"), nbytes


def _work(raw: Any) -> float:
    """A batch's worker seconds on its server (read + decode + pipeline + cache + write)."""
    t = raw.timings
    if t is None:
        return 0.0
    return t.read_seconds + t.decode_seconds + t.pipeline_seconds + t.cache_seconds + t.write_seconds
