"""One iteration of a loader: batches from one or several servers' ``Batches`` calls, in order.

::

    per server: Batches call --lane thread--> raw reorder buffer (batch index -> WireBatch)
                                                    |
                   one converter thread, in batch order, max_ready ahead (the double buffer:
                   unpack, device copy, gpu_transform, decode_on_client, collate_fn)
                                                    |
                                   consumer: ``Feed.batches()`` yields b, b + 1, ... once each

* **Lanes.** Each server of the iteration has a lane thread (``_LaneRunner``) that opens its
  Batches call (``ServerConnection.open_batches``), checks the server's id (``batchd-server-id``:
  the dataset is described again only when it changed), and puts each batch it receives in the
  reorder buffer, or drops it when another server's copy came first (its lease released on the
  call). The ``Assigner`` (``batchd.client.assign``) decides, under the feed's one lock, which
  server is granted which batch index: as each server has room in its window, sized to its rate.
* **The converter** takes the next batch in order once it arrived and there is room among the
  ``max_ready`` converted batches, converts it outside the lock (``ServerConnection.convert``)
  and hands it to the consumer. While it waits, it runs the assigner's lateness check (hedges,
  stalled servers) at the deadlines the check gives, and marks down a server that sent nothing
  for ``timeout`` seconds while others did.
* **Failures.** A call that breaks (``ConnectionError``) is opened again within the owner's
  reconnect window (``reconnect_timeout`` with one server, ``failover_timeout`` with several);
  meanwhile its batches stay granted to it (hedges may take them). A server that does not come
  back, or comes back serving other data (the server refuses the call's expected size or
  fingerprints: ``ServerRefused``, or its new id's description differs), is given up: with one
  server the iteration raises, with several its batches go to the others. With no server left,
  the owner probes for ``reconnect_timeout`` seconds, then the iteration raises ConnectionError.
  Any other error (a sample that cannot be read, a worker that died) ends the iteration with it,
  after the batches before it that arrived.
* **The end.** Once the converter took the last batch, every call is half-closed (the server
  ends it); calls with grants still outstanding (a stalled server's) are cancelled. Closing the
  feed early (a ``break``) cancels the calls (each reported abandoned with the leases received
  on it) and releases the leases of batches received and never converted.

The owner (``SingleServerLoader``, ``MultiServerLoader``) provides ``options``, ``_transfer``,
``loader_stats``, ``budget``, ``assignment`` and the failure policy (``Owner``).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Protocol

from batchd import errors
from batchd.client import fields, forks
from batchd.client.assign import Assigner
from batchd.client.call import BatchesCall, ServerRefused
from batchd.client.connection import deliver
from batchd.errors import DatasetChangedError, DatasetNotFoundError

log = logging.getLogger("batchd.client.loader")

_POLL_S = 0.25  # the longest a waiting thread sleeps before it checks the others (seconds)
MAX_READY = 1  # converted batches waiting for the consumer (1: double buffering)
_END_GRACE_S = 10.0  # a half-closed call the server has not ended by then is cancelled
_SILENT_EVERY_S = 1.0  # how often the converter looks for servers silent for `timeout`


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


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


_END = object()


class Feed:
    """Batches ``start .. total - 1`` of ``epoch`` (its remainder from global position
    ``start_position``) from ``servers`` (each with ``conn``, ``address``, ``pace``), in order.
    ``batches()`` is the consumer's iterator; ``close()`` ends everything (idempotent)."""

    def __init__(self, owner: Owner, servers: list[Any], epoch: int, start: int, total: int,
                 start_position: int = 0):
        self.owner = owner
        self.options = owner.options
        self.epoch, self.start, self.total, self.start_position = epoch, start, total, start_position
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        policy = self.options.hedge if not owner.single else None
        self.assigner = Assigner(start, total, floor=self.options.prefetch, policy=policy,
                                 budget=owner.budget if policy is not None else None, mode=owner.assignment,
                                 count=owner.loader_stats.count)
        # batch -> (WireBatch, server, its connection, call record, receive seconds)
        self._raw: dict[int, tuple[Any, Any, Any, Any, float]] = {}
        self._ready: collections.deque = collections.deque()  # Received, _Failed or _END, in order
        self._runners: dict[Any, _LaneRunner] = {}  # server -> its lane thread
        self._fatal: BaseException | None = None
        self._all_down_since: float | None = None
        self.stopping = threading.Event()
        self._closed = False
        self._owner_pid = forks.owner()
        forks.keep(self)
        self._silent_at = 0.0
        self.last_figures: dict = {}  # the assigner's figures when the feed closed
        self._converting: int | None = None  # the batch the converter is converting (still in _raw)
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
            self._cond.notify_all()

    def _add(self, server: Any) -> None:  # (under the lock)
        self.assigner.add_lane(server, server.pace)
        runner = self._runners[server] = _LaneRunner(self, server)
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
            self._cond.notify_all()
        log.info("%s left the address: its %d batches in flight go to the others", server.address, len(lost))
        runner.stop()

    def mark_all_down(self) -> None:
        """No server was up to begin with: the converter waits for one (``Owner.wait_for_any``)."""
        with self._lock:
            if not self._runners and self._all_down_since is None:
                self._all_down_since = time.monotonic()
                self._cond.notify_all()

    @property
    def all_down_since(self) -> float | None:
        return self._all_down_since

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

    def opened(self, runner: "_LaneRunner") -> None:
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

    def arrive(self, runner: "_LaneRunner", raw: Any, received: float, nbytes: int, record: Any) -> None:
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
                        if b == self.assigner.base:
                            self._cond.notify_all()
                    self._plan()
        if not keep and raw.segment:
            _release(raw, record)

    def lane_failed(self, runner: "_LaneRunner", error: BaseException) -> BaseException | None:
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
            self._cond.notify_all()
        return fatal

    def fail(self, error: BaseException) -> None:
        with self._lock:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:  # (under the lock)
        if self._fatal is None:
            self._fatal = error
        self._cond.notify_all()

    def _plan(self) -> None:  # (under the lock)
        grants = self.assigner.plan(time.monotonic())
        self._send(grants)

    def _send(self, grants: dict) -> None:  # (under the lock)
        for server, batches in grants.items():
            runner = self._runners.get(server)
            if runner is not None and runner.outbox is not None:
                runner.outbox.grant(batches)

    def _fold(self, server: Any, runner: "_LaneRunner") -> None:  # (under the lock)
        """Add the lane's figures of this iteration to its server's totals."""
        lane = self.assigner.lanes.get(server) or runner.lane
        if lane is not None and not runner.folded:
            runner.folded = True
            server.hedges_issued += lane.hedges_issued
            server.hedges_won += lane.hedges_won
            server.hedges_wasted += lane.hedges_wasted

    # --- the converter -------------------------------------------------------------------------------

    def _convert_loop(self) -> None:
        try:
            while True:
                got = self._next_ready()
                if got is None:
                    return
                b, (raw, server, conn, record, received) = got
                try:
                    item = conn.convert(raw, self.stopping, record)
                except ConnectionError as e:
                    if not raw.segment:
                        raise
                    log.info("batch %d is gone from %s's shared memory (%s); asking for it again", b,
                             server.address, e)
                    with self._lock:
                        self._converting = None
                        self._raw.pop(b, None)
                        self.assigner.requeue(b)
                        self._plan()
                    continue
                item.times.receive = received
                with self._lock:
                    self._converting = None
                    self._raw.pop(b, None)
                    self.assigner.take(b)
                    server.batches += 1
                    self._ready.append(item)
                    self._plan()
                    self._cond.notify_all()
                del item, raw
        except BaseException as e:  # never raise in the thread: hand it to the consumer
            with self._lock:
                self._converting = None
                self._ready.append(_Failed(e))
                self._cond.notify_all()

    def _next_ready(self) -> tuple[int, tuple] | None:
        """The next batch in order and its entry, once it arrived and the consumer has room (it
        stays in the reorder buffer, ``_converting``, until converted); None at the end (``_END`` or an error
        queued for the consumer) or when the feed closes."""
        with self._lock:
            while True:
                if self.stopping.is_set():
                    return None
                now = time.monotonic()
                deadline, silent = self._watch(now)
                if silent:  # (marking a server down takes the lock)
                    self._lock.release()
                    try:
                        for runner, error in silent:
                            runner.give_up(error)
                    finally:
                        self._lock.acquire()
                    continue
                a = self.assigner
                if a.done:
                    self._ready.append(_END)
                    self._cond.notify_all()
                    self._finish()
                    return None
                if a.has(a.base) and len(self._ready) < MAX_READY:
                    self._converting = a.base
                    return a.base, self._raw[a.base]
                if self._fatal is not None and not a.has(a.base):
                    self._ready.append(_Failed(self._fatal))
                    self._cond.notify_all()
                    return None
                if not self._runners and not self.owner.single and self._all_down_since is not None:
                    self._lock.release()
                    try:
                        error = self.owner.wait_for_any(self, self.epoch, a.base)
                    finally:
                        self._lock.acquire()
                    if error is not None:
                        self._fail(error)
                    continue
                wait = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - now) + 1e-3)
                self._cond.wait(wait)

    def requeue_shared(self, server: Any) -> None:
        """``server``'s call broke: the batches it sent over shared memory that wait here may be
        gone with its session (a restart); they are asked for again."""
        dropped = []
        with self._lock:
            for b in self.assigner.arrived_from(server):
                entry = self._raw.get(b)
                if b == self._converting or entry is None or not entry[0].segment:
                    continue
                dropped.append(self._raw.pop(b))
                self.assigner.requeue(b)
            if dropped:
                self._plan()
        for raw, _, _, record, _ in dropped:
            _release(raw, record)

    def _watch(self, now: float) -> tuple[float | None, list]:  # (under the lock)
        """Lateness (hedges, stalled servers): the next deadline to look again; and the servers
        silent for ``timeout`` while others sent batches, with the error to mark them down with."""
        a = self.assigner
        grants, deadline = a.check(now)
        if grants:
            self._send(grants)
        silent = []
        if now - self._silent_at >= _SILENT_EVERY_S and len(self._runners) > 1:
            self._silent_at = now
            for lane in a.silent(now, self.options.timeout):
                runner = self._runners.get(lane.key)
                if runner is not None:
                    error = errors.TimeoutError(f"no batch from {lane.key.address} for {self.options.timeout:g} s "
                                                "while the other servers sent theirs")
                    silent.append((runner, error))
        return deadline, silent

    def _finish(self) -> None:  # (under the lock)
        """Every batch was taken: half-close the calls (cancel those still holding grants)."""
        for server, runner in self._runners.items():
            lane = self.assigner.lanes.get(server)
            runner.finish(cancel=lane is not None and bool(lane.outstanding))
            self._fold(server, runner)

    # --- the consumer ------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The batches in order, each once; ``close()`` when done (also on an early exit)."""
        o = self.options
        b = self.start
        what = f"dataset {o.dataset!r}, epoch {self.epoch}"
        try:
            while b < self.total:
                item = self._take(b, what)
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                batch = deliver(item, self.owner._transfer)
                item = None
                b += 1
                yield batch
                batch = None  # (not kept by this frame once the loop has it)
        finally:
            self.close()

    def _take(self, b: int, what: str) -> Any:
        timeout = self.options.timeout
        deadline = time.monotonic() + timeout
        with self._lock:
            self.assigner.asked(deadline - timeout)
            while not self._ready:
                now = time.monotonic()
                if now >= deadline:
                    names = ", ".join(s.address for s in self._runners) or ", ".join(self.owner.addresses)
                    raise errors.TimeoutError(f"no batch from {names} for {timeout:g} s ({what}, batch {b})")
                if not self._converter.is_alive() and not self._ready:
                    raise RuntimeError(f"the converter thread ended without a result ({what}, batch {b})")
                self._cond.wait(min(_POLL_S, deadline - now))
            item = self._ready.popleft()
            self.assigner.handed(time.monotonic())
            self._plan()  # (the loop's pace may let more be granted)
            self._cond.notify_all()  # room for the converter
            return item

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
            self._cond.notify_all()
        for _, runner in runners:
            runner.stop()
        if not self.owner.single:
            for server, error in broken:
                self.owner.lane_down(server, error, self.epoch, at)
        if self._converter is not threading.current_thread():
            self._converter.join(2.0)
        for wire_batch, _, _, record, _ in raw:
            if wire_batch.segment:
                _release(wire_batch, record)
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


def _release(raw: Any, record: Any) -> None:
    """Give back the lease of a shared-memory batch received on ``record``'s call and dropped unread."""
    if record.shm is not None:
        record.shm.release_unused(raw.lease)


def _work(raw: Any) -> float:
    """A batch's worker seconds on its server (read + decode + pipeline + cache + write)."""
    t = raw.timings
    if t is None:
        return 0.0
    return t.read_seconds + t.decode_seconds + t.pipeline_seconds + t.cache_seconds + t.write_seconds


class _LaneRunner:
    """One server's lane thread in one feed (module docstring)."""

    def __init__(self, feed: Feed, server: Any):
        self.feed = feed
        self.server = server
        self.conn = server.conn  # (the connection of its calls: a probe may give the server a new one)
        self.lane = feed.assigner.lanes.get(server)
        self.outbox = None
        self.call: BatchesCall | None = None
        self.record = None
        self.failing_since: float | None = None
        self.broken_by: BaseException | None = None  # its call broke and no new one is up yet
        self.folded = False
        self._stopping = threading.Event()
        self._finished = False
        self._timer: threading.Timer | None = None  # cancels a half-closed call the server does not end
        self._lock = threading.Lock()  # call, outbox (lane thread and stop/finish)
        self._thread = threading.Thread(target=self._run, name="batchd-lane", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def server_outstanding(self, assigner: Assigner) -> list[int]:
        lane = assigner.lanes.get(self.server)
        return list(lane.outstanding) if lane is not None else []

    # --- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._calls()
        finally:
            timer = self._timer
            if timer is not None:
                timer.cancel()

    def _calls(self) -> None:
        feed, server = self.feed, self.server
        conn = self.conn
        while not self._stopping.is_set() and not feed.stopping.is_set():
            try:
                call = self._open()
                if call is None:
                    return
                feed.opened(self)  # (grants first: a server may send its metadata with its first batch)
                server_id = call.server_id()
                conn.check_server(server_id, feed.options.connect_timeout)
                resumed = self.failing_since is not None
                for raw, received, nbytes in call.messages():
                    if resumed:  # (a batch came on the new call: not before, a draining server accepts and ends it)
                        resumed, self.broken_by = False, None
                        log.info("resumed the stream from %s at epoch %d, batch %d", server.address, feed.epoch,
                                 raw.batch_index)
                        feed.owner.loader_stats.count("reconnects")
                    feed.arrive(self, raw, received, nbytes, self.record)
                    raw = None
                self._end_call(abandoned=False)
                return
            except ServerRefused as e:
                self._end_call(abandoned=True)
                self._give_up(_refused(conn, e, feed.options.connect_timeout))
                return
            except ConnectionError as e:
                self._end_call(abandoned=True)
                if self._stopping.is_set() or feed.stopping.is_set():
                    return
                if not self._reconnect(e):
                    return
            except (DatasetChangedError, DatasetNotFoundError) as e:
                self._end_call(abandoned=True)
                self._give_up(e)
                return
            except BaseException as e:  # the server's error (SampleError, WorkerError, ...): the iteration's
                self._end_call(abandoned=True)
                if not (self._stopping.is_set() or feed.stopping.is_set()):
                    feed.fail(e)
                return

    def _open(self) -> BatchesCall | None:
        feed = self.feed
        call, record = self.conn.open_batches(feed.epoch, feed.start_position)
        with self._lock:
            if self._stopping.is_set() or feed.stopping.is_set():
                call.cancel()
                self.conn.end_call(call, record, abandoned=True)
                return None
            self.call, self.outbox, self.record = call, call.outbox, record
        return call

    def _end_call(self, abandoned: bool) -> None:
        with self._lock:
            call, record = self.call, self.record
            self.call = self.outbox = None
        if call is not None:
            if abandoned:
                call.cancel()
            self.conn.end_call(call, record, abandoned=abandoned)

    def _reconnect(self, error: BaseException) -> bool:
        """Wait for the server to come back within the owner's window: True to open a new call;
        False once given up (``lane_failed``)."""
        feed, server = self.feed, self.server
        with feed._lock:
            feed.assigner.close_lane(server)
            b = min(self.server_outstanding(feed.assigner), default=feed.assigner.base)
        feed.requeue_shared(server)
        self.broken_by = error
        now = time.monotonic()
        if self.failing_since is None:
            self.failing_since = now
            log.warning("lost the stream from %s at epoch %d, batch %d (%s); reconnecting for up to %g s",
                        server.address, feed.epoch, b, error, feed.owner.reconnect_window())
        else:  # a new call failed too: not at once again
            self._stopping.wait(min(0.5, max(0.0, self.failing_since + feed.owner.reconnect_window() - now)))
        deadline = self.failing_since + feed.owner.reconnect_window()
        self.conn.new_session()  # a restarted server has new shared memory
        while not (self._stopping.is_set() or feed.stopping.is_set()):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                self._give_up(error)
                return False
            if self.conn.wait_ready(min(remaining, 1.0)):
                return True
        return False

    def _give_up(self, error: BaseException) -> None:
        self.feed.lane_failed(self, error)

    # --- from other threads ----------------------------------------------------------------------------

    def give_up(self, error: BaseException) -> None:
        """Mark this server down now (it stayed silent): its call is cancelled, its batches go."""
        self._stopping.set()
        self.feed.lane_failed(self, error)
        self._cancel()

    def finish(self, cancel: bool) -> None:
        """The iteration got every batch: half-close the call (cancel it if ``cancel``). A call the
        server has not ended within ``_END_GRACE_S`` is cancelled."""
        with self._lock:
            self._finished = True
            call = self.call
        if call is None:
            self._stopping.set()
            return
        if cancel:
            self._stopping.set()
            call.cancel()
            return
        call.outbox.close()
        self._timer = threading.Timer(_END_GRACE_S, self._cancel)
        self._timer.daemon = True
        self._timer.start()

    def stop(self) -> None:
        """Cancel the call (reported abandoned by the lane thread) and wait briefly for the thread;
        a call half-closed at the iteration's end (``finish``) is left to end on its own."""
        with self._lock:
            finished = self._finished
        if finished:
            return
        self._stopping.set()
        self._cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _cancel(self) -> None:
        with self._lock:
            call = self.call
        if call is not None:
            self._stopping.set()
            call.cancel()


def _refused(conn: Any, e: ServerRefused, timeout: float) -> BaseException:
    """The DatasetChangedError behind a refused call: the dataset described again and compared
    (``check_unchanged`` raises it, naming what changed); the server's words if that shows nothing."""
    try:
        conn.check_unchanged(timeout)
    except (DatasetChangedError, DatasetNotFoundError, ConnectionError, TimeoutError) as changed:
        return changed
    return DatasetChangedError(conn.options.dataset, conn.address, [str(e)])
