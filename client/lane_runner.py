"""One server's side of a feed: ``LaneRunner``, the thread that runs its ``Batches`` calls.

A feed (``batchd.client.feed``) starts one runner per server of the iteration. Its thread opens
the server's Batches call (``ServerConnection.open_batches``, ``batchd.client.transport.call``; over the
socket data plane the call reads each batch's bytes from its data connection,
``batchd.client.transport.dataplane``), tells the feed once it is up (``Feed.opened``: the grants it held
are sent again), checks the server's id (``batchd-server-id``: the dataset is described again
only when it changed) and hands the feed each batch it receives (``Feed.arrive``). The grants
and revokes the feed decides go out on the call's ``outbox``.

**On loan** (``Feed.direct``: one server, batches converted by the consumer itself). Once the call is
up and checked, the lane thread lends its messages to the consumer (``Loan``) and waits: the
consumer, needing a batch that has not come, reads the next message itself and hands it to the
feed, so a batch wakes one thread (the consumer, from gRPC) instead of two (the lane thread,
then the consumer); while the loop trains, messages wait in gRPC's buffer. The lane thread takes
the call back when a read ends it or raises (it handles that as below: reconnect, give up,
fail), when the iteration finished (it reads the call to its end) or stopped, and it is the
watchdog: a read that outlasts ``timeout`` has its call cancelled and the consumer raises
``TimeoutError``, as a wait for a batch does.

Its call's life: a call that breaks (``ConnectionError``) is opened again within the owner's
reconnect window (``_reconnect``; meanwhile its batches stay granted to it and the shared-memory
ones waiting in the feed are asked for again, ``Feed.requeue_shared``); a server that does not
come back, or serves other data (``ServerRefused``, ``DatasetChangedError``), is given up
(``Feed.lane_failed``); any other error ends the iteration (``Feed.fail``). From other threads:
``give_up`` (the converter found it silent), ``finish`` (every batch taken: half-close, a grace
for the server to end the call, then cancel) and ``stop`` (cancel, join briefly). Its ``_lock``
guards its ``call``, ``outbox`` and ``record`` between its thread and the others.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Iterator

from batchd import errors
from batchd.client.transport.call import BatchesCall, ServerRefused
from batchd.errors import DatasetChangedError, DatasetNotFoundError

if TYPE_CHECKING:
    from batchd.client.assign import Assigner
    from batchd.client.feed import Feed

log = logging.getLogger("batchd.client.loader.loader")

_END_GRACE_S = 10.0  # a half-closed call the server has not ended by then is cancelled
_POLL_S = 0.25  # while its call is on loan, the lane thread looks at it this often (seconds)


class LaneRunner:
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
        self._resumed = False  # the call is a new one after a break: the first batch on it says so
        self.loan: Loan | None = None  # its messages, lent to the consumer (under the feed's lock)

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
                self._resumed = self.failing_since is not None
                messages = call.messages()
                if feed.direct and not self._lend(messages):
                    self._end_call(abandoned=True)  # (stopped: the call was cancelled)
                    return
                for raw, received, nbytes in messages:  # (all of them; what is left after a loan)
                    self.arrived(raw, received, nbytes)
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

    def arrived(self, raw: Any, received: float, nbytes: int) -> None:
        """A batch came on the call (read by this thread, or by the consumer on loan)."""
        if self._resumed:  # (a batch came on the new call: not before, a draining server accepts and ends it)
            self._resumed, self.broken_by = False, None
            log.info("resumed the stream from %s at epoch %d, batch %d", self.server.address, self.feed.epoch,
                     raw.batch_index)
            self.feed.owner.loader_stats.count("reconnects")
        self.feed.arrive(self, raw, received, nbytes, self.record)

    def taking_back(self) -> bool:
        """Whether this thread takes its call back from the consumer once no read is running."""
        return self._stopping.is_set() or self.feed.stopping.is_set() or self._finished

    def _lend(self, messages: Iterator) -> bool:
        """Lend the call's ``messages`` to the consumer (module docstring, *On loan*) until they
        ended, the iteration finished or stopped, or a read outlasted ``timeout`` (then the call
        is cancelled and the consumer raises TimeoutError). Raises what a read raised; returns
        False once stopped, True with the messages left for this thread to read (none once they
        ended; the rest of a finished iteration's)."""
        feed, loan = self.feed, Loan(messages)
        timeout = feed.options.timeout
        with feed._lock:
            self.loan = loan
            feed._cond.notify_all()
            try:
                while loan.outcome is None:
                    if self.taking_back():
                        if not loan.reading:
                            return self._finished and not self._stopping.is_set()
                    elif loan.reading and time.monotonic() - loan.since > timeout and not loan.timed_out:
                        loan.timed_out = True  # (the consumer raises TimeoutError once its read ends)
                        self._stopping.set()
                        feed._lock.release()
                        try:
                            self._cancel()
                        finally:
                            feed._lock.acquire()
                        continue
                    wait = _POLL_S
                    if loan.reading and not loan.timed_out:  # (to the read's deadline, not a poll past it)
                        wait = min(wait, max(0.0, loan.since + timeout - time.monotonic()) + 1e-3)
                    feed._loaned.wait(wait)
            finally:
                self.loan = None
        if loan.outcome is not _ENDED:
            raise loan.outcome
        return True

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


_ENDED = object()


class Loan:
    """A call's messages lent to the consumer (``LaneRunner._lend``); its fields are under the
    feed's lock. outcome: None while lent, ``_ENDED`` once they ended, or what a read raised."""

    __slots__ = ("messages", "reading", "since", "outcome", "timed_out")

    def __init__(self, messages: Iterator):
        self.messages = messages
        self.reading = False  # the consumer reads it now (outside the lock)
        self.since = 0.0  # when that read began (monotonic s)
        self.outcome: Any = None
        self.timed_out = False  # that read outlasted ``timeout``: the call was cancelled

    def read(self, feed: Any, runner: "LaneRunner", what: str, b: int) -> None:
        """The consumer (under the feed's lock, released while it reads) reads one message and
        hands it to the feed; an end or an error of the call is the lane thread's to handle
        (``outcome``). Raises TimeoutError (naming ``what`` and batch ``b``, which it waited for)
        if the read outlasted ``timeout`` (the lane thread cancelled the call)."""
        self.reading, self.since = True, time.monotonic()
        outcome = None
        feed._lock.release()
        try:
            try:
                raw, received, nbytes = next(self.messages)
            except StopIteration:
                outcome = _ENDED
            except Exception as e:  # (the call's error: the lane thread reconnects, gives up or fails)
                outcome = e
            else:
                runner.arrived(raw, received, nbytes)
                raw = None
        finally:
            feed._lock.acquire()
            self.reading = False
            if outcome is not None or runner.taking_back():  # (else its thread sleeps on: no wake-up per batch)
                feed._loaned.notify_all()
        if outcome is not None:
            self.outcome = outcome
        if self.timed_out:
            raise errors.TimeoutError(f"no batch from {runner.server.address} for {feed.options.timeout:g} s "
                                      f"({what}, batch {b})")


def _refused(conn: Any, e: ServerRefused, timeout: float) -> BaseException:
    """The DatasetChangedError behind a refused call: the dataset described again and compared
    (``check_unchanged`` raises it, naming what changed); the server's words if that shows nothing."""
    try:
        conn.check_unchanged(timeout)
    except (DatasetChangedError, DatasetNotFoundError, ConnectionError, TimeoutError) as changed:
        return changed
    return DatasetChangedError(conn.options.dataset, conn.address, [str(e)])
