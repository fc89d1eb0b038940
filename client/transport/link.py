"""One server of a loader, for the loader's life: ``ServerLink``, its connection, its one call, its thread.

A link holds a ``ServerConnection`` (channel, description, shared-memory session, data plane)
and one ``Batches`` call that serves every pass of the loader: the first pass opens it, each
later one switches it (``serve``: a later ``open``). Its thread (``batchd-server``) does
everything that blocks for this server:

* connects: a server that did not answer at construction, or went down, is tried again with a
  fresh connection (``connection.probe``) at growing intervals up to ``probe_interval``;
* opens the call for the pass it serves, reads the server's metadata (its id: a restarted
  server's dataset is described again, ``check_server``; its capacity: ``batchd-workers``,
  ``batchd-max-leases``; no metadata within ``connect_timeout``: the call is cancelled) and tells
  the pass it is up (``links_up``);
* reads the call: each batch goes to the pass of its ``open`` (``Batch.open_seq``); one of an
  earlier pass is dropped (its lease released);
* when the call breaks (a restart, a lost connection, ``restart`` from the pass), tells the pass
  (``link_down``: its batches go to the others at once) and reconnects: on the same channel if it
  is ready within ``RECONNECT_S`` (the dataset described again; the broken call reported,
  ``ReleaseLeases.abandoned_stream``, so the server releases what it sent that never came), else
  with fresh connections; a server that serves another dataset is left out (``link_failed``); a
  server's error for a pass goes to that pass (``fail``);
* after ``close``: ends the call (``done``, or cancelled mid-pass), then releases what the
  caller still holds (``_drain``) and closes the connection.

A shared-memory batch's lease goes back when its tensors are freed (``weakref.finalize``) or it is
dropped unread, in any thread (a garbage collection, a lock held): ``freed`` queues it without a
lock; the call's next message carries it (``batchd.client.transport.outbox``), after the call
``_drain`` sends it by ReleaseLeases. Leases of a session that ended (a restart) are dropped.

The pass (``iteration.epoch.Epoch``) is a sink: ``links_up``, ``link_down``, ``link_failed``,
``arrived``, ``fail``, ``progress``, ``where``, ``epoch``, ``start_position``.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from typing import Any

from batchd.client import forks
from batchd.client.transport.call import BatchesCall, ServerRefused, WeightsNotHeld
from batchd.client.transport.connection import ServerConnection, probe
from batchd.client.transport.datasets import DatasetInfo
from batchd.client.transport.redial import FellBack
from batchd.errors import DatasetChangedError, DatasetNotFoundError

log = logging.getLogger("batchd.client.loader")

PROBE_CONNECT_S = 2.0  # connect timeout of a fresh connection to a server that was down (seconds)
RECONNECT_S = 1.0  # how long a broken call's channel may take to be ready again before a fresh one
DRAIN_POLL_S = 0.25  # after the call: how often freed leases are looked for and idle mappings swept (seconds)


class ServerLink:
    """One server of a loader (module docstring).

    address: ``HOST:PORT`` or ``unix:PATH``. options: the loader's ``LoaderOptions``; transfer:
    its ``CudaTransfer`` (None for CPU batches); reference: the loader's ``DatasetInfo`` (what a
    server that was down must serve to be used again; None: this link's first description is
    the reference). conn: a connection made already (None: the thread connects). count(name):
    the loader's counters (``reconnects``). warned: what the loader said once (shared by its links).
    """

    def __init__(self, address: str, options: Any, transfer: Any = None, *, reference: DatasetInfo | None = None,
                 conn: ServerConnection | None = None, count: Any = None, warned: set | None = None):
        self.address = address
        self.options = options
        self.transfer = transfer
        self.reference = reference
        self._count = count or (lambda name, n=1: None)
        self._warned = warned if warned is not None else set()
        self.conn = conn
        if conn is not None:
            conn.freed = self.freed  # (its shared-memory session opens on first use: after this)
        self.error = "" if conn is not None else "not connected yet"
        self.up = False  # a call is open and the server answered it
        self.retired = False
        self.workers = 0  # what the server says it can build at once (0: not said yet)
        self.max_leases: int | None = None  # the leases its shared-memory session may hold (None: not shm)
        self.batches = 0  # batches yielded that it sent first, all passes (the pass counts them)
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._pass: Any = None  # the pass it serves
        self._seq: int | None = None  # that pass's open_seq on the call (None: a new call opens it)
        self._call: BatchesCall | None = None
        self._closing = False
        self._broken: tuple[str, str] | None = None  # (session, tag) of a broken call, to report
        self._backoff = 0.0  # seconds before the next fresh connection (doubles up to probe_interval)
        self._described = 0  # DescribeDataset calls of its connections before the current one
        self._tags = itertools.count()
        self._freed: queue.SimpleQueue = queue.SimpleQueue()  # (session, lease) freed, not told to the server
        self._owner = forks.owner()
        self._thread = threading.Thread(target=self._run, name="batchd-server", daemon=True)
        self._thread.start()

    # --- from the iteration (any thread) -----------------------------------------------------------

    def serve(self, pass_: Any) -> int | None:
        """Serve ``pass_`` from now on: on the open call, a later ``open``: returns its open_seq
        (the caller tells the pass: ``links_up``); else None: the thread opens a call for it when
        it can and tells the pass itself."""
        with self._lock:
            if self._closing:
                return None
            self._pass, self._seq = pass_, None
            if (call := self._call) is not None:
                try:
                    request = self.conn.request(pass_.epoch, start_position=pass_.start_position,
                                                transport=call.transport, tag=call.tag)
                    self._seq = call.outbox.reopen(request, pass_.progress(self))
                except RuntimeError:  # (the call is ending: a new one opens for this pass)
                    pass
            self._wake.notify_all()
            return self._seq if self.up else None

    def grant(self, batches: list[int], seq: int) -> None:
        if (call := self._call) is not None:
            call.outbox.grant(batches, seq)

    def revoke(self, batches: list[int], seq: int) -> None:
        if (call := self._call) is not None:
            call.outbox.revoke(batches, seq)

    def let_go(self, pass_: Any) -> None:
        """``pass_`` is over: batches of its ``open`` still coming are dropped (its leases released)."""
        with self._lock:
            if self._pass is pass_:
                self._pass = None

    def restart(self, why: str) -> None:
        """Cancel the call (the server is silent too long): the thread handles it as a broken call."""
        if (call := self._call) is not None:
            log.warning("batchd server %s: %s; its call is cancelled and it is tried again", self.address, why)
            call.cancel()

    def freed(self, session: str, lease: int) -> None:
        """A lease's batch was freed or dropped (any thread; finalizers too: no lock)."""
        if not forks.forked(self._owner):
            self._freed.put((session, lease))

    def leases_held(self) -> int:
        """Leases of its shared-memory session the server counts held: received, not released yet."""
        shm = conn.shm if (conn := self.conn) is not None else None
        return 0 if shm is None else shm.outstanding

    def send_freed(self) -> None:
        """Send the freed leases now, if any (the consumer is about to wait: the server may be at its cap)."""
        if not self._freed.empty() and (call := self._call) is not None:
            call.outbox.send_releases()

    def close(self, cancel: bool = False) -> None:
        """End the call: ``done`` (the server counts it finished), or cancel it (``cancel``: the
        loader closed in the middle of a pass: counted cancelled, and reported with the leases
        still held here, so the server releases those it sent that never came); then the thread
        releases what the caller still holds and ends (module docstring). Idempotent; nothing in
        a forked child."""
        if forks.forked(self._owner):
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
            call = self._call
            self._wake.notify_all()
        if call is None:
            return
        if cancel:
            call.cancel()
        else:
            call.outbox.close()

    def ending(self) -> BatchesCall | None:
        """The call being ended by ``close`` (None once over): the loader cancels it after a grace."""
        return self._call

    @property
    def describes(self) -> int:
        """DescribeDataset calls this link made (one per server process, unless its data changed)."""
        return self._described + (conn.describes if (conn := self.conn) is not None else 0)

    def sweep(self) -> None:
        """Unmap idle mappings of segments the server unlinked (``SharedMemorySession.sweep``)."""
        if (conn := self.conn) is not None and (shm := conn.shm) is not None:
            shm.sweep()

    # --- the thread --------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                if self.conn is None and not self._connect():
                    self._backoff = min(self.options.probe_interval, max(0.25, 2 * self._backoff))
                    self._sleep(self._backoff)
                    continue
                if not self._wait_for_pass():
                    break
                self._serve_call()
        finally:
            self._drain()

    def _wait_for_pass(self) -> bool:
        """Wait for a pass to serve: False once closing."""
        with self._lock:
            self._wake.wait_for(lambda: self._closing or (self._pass is not None and not self._pass.closed))
            return not self._closing

    def _sleep(self, seconds: float) -> None:
        with self._lock:
            if not self._closing:
                self._wake.wait(seconds)

    def _connect(self) -> bool:
        """A fresh connection (``connection.probe``: a new channel, the dataset described and
        checked against the loader's): True once up. A server serving another dataset is left
        out (the pass hears ``link_failed`` once)."""
        try:
            fresh = probe(self.address, self.options, self.transfer, self.freed, self._warned, self.reference,
                          min(self.options.connect_timeout, PROBE_CONNECT_S))
        except Exception as e:
            left_out = not isinstance(e, (ConnectionError, TimeoutError))  # (up, but cannot serve the loader)
            if left_out and self.error != str(e):
                log.warning("batchd server %s is left out: %s", self.address, e)
                if (sink := self._pass) is not None and isinstance(e, DatasetChangedError):
                    sink.link_failed(self, e)
            self.error = str(e)
            return False
        with self._lock:
            if self._closing:
                fresh.close()
                return False
            self.conn, self.error = fresh, ""
        log.info("batchd server %s is up; it gets batches as it has credit", self.address)
        return True

    def _serve_call(self) -> None:
        """Open a call for the pass it serves and read it until it ends or breaks; handle how it ended."""
        conn = self.conn
        try:
            call = self._open(conn)
            if call is None:
                return
            for raw, received, nbytes in call.messages():
                if not self._closing:
                    self.error = ""  # (it sends: whatever went wrong before is over)
                with self._lock:
                    sink = self._pass if raw.open_seq == self._seq else None
                if sink is not None:
                    sink.arrived(self, raw, received, nbytes, conn.shm if raw.segment else None)
                elif raw.segment and conn.shm is not None:  # (an earlier pass's: its lease goes back)
                    conn.shm.release_unused(raw.lease)
                raw = None
            self._ended(None)
        except (ServerRefused, DatasetChangedError, DatasetNotFoundError) as e:
            self._ended(e)
            refused = isinstance(e, ServerRefused)  # (what changed: the dataset described again)
            self._left_out(conn.refusal(e, self.options.connect_timeout) if refused else e)
        except ConnectionError as e:
            self._ended(e)
            if not self._closing:
                self._reconnect(conn, e)
        except BaseException as e:  # the server's error for the pass (SampleError, WorkerError, ...)
            self._ended(e, down=False)
            if (sink := self._pass) is not None:
                sink.fail(e)

    def _open(self, conn: ServerConnection) -> BatchesCall | None:
        """The call for the pass the link serves, up: its metadata read (capacity, server id
        checked), the pass told (``links_up``). None once closing. Raises the call's errors;
        ConnectionError if the server sends no metadata within ``connect_timeout`` (the call is
        cancelled)."""
        tag = f"{conn.tag}-{next(self._tags)}"
        while True:
            pass_ = self._pass
            if self._closing or pass_ is None:
                return None
            request = conn.request(pass_.epoch, start_position=pass_.start_position, tag=tag)
            call = conn.open_call(request, pass_.progress(self), lambda: self._mine(conn.shm),
                                  pending=lambda: not self._freed.empty())  # (gRPC's request thread)
            call.tag, call.transport = tag, request.transport
            with self._lock:
                if not self._closing and self._pass is pass_:  # (else serve() moved on meanwhile: again)
                    self._call, self._seq = call, 0
                    break
            call.cancel()
        watchdog = threading.Timer(self.options.connect_timeout, call.cancel)  # (only while opening)
        watchdog.daemon = True
        watchdog.start()
        try:
            server_id, self.workers, self.max_leases = call.server()
        finally:
            watchdog.cancel()
        conn.check_server(server_id, self.options.connect_timeout)
        if self._release_broken(conn) is not None:
            self._count("reconnects")
            log.info("resumed the stream from %s at %s", self.address, pass_.where())
        with self._lock:
            self.up, self._backoff = True, 0.0
            sink, seq = self._pass, self._seq
        if sink is not None and seq is not None:
            sink.links_up([(self, seq)])
        return call

    def _ended(self, error: BaseException | None, down: bool = True) -> None:
        """The call is over (``error`` None: it ended OK, after ``close``) or broke (or was
        cancelled by ``close``); the pass hears ``link_down`` unless the error was the pass's own
        (``down`` False)."""
        with self._lock:
            call, self._call = self._call, None
            was_up, self.up = self.up, False
            sink = self._pass
        if call is None:
            return
        call.cancel()  # (its outbox stops; nothing if the call is over)
        shm = self.conn.shm  # (the thread's connection: it is dropped only after this)
        if error is not None and was_up:
            self._broken = (shm.session if shm is not None else "", call.tag)
        if error is not None and down and sink is not None and not self._closing:
            sink.link_down(self, error)

    def _reconnect(self, conn: ServerConnection, error: BaseException) -> None:
        """The call broke: the same channel if it is ready again within ``RECONNECT_S`` (a new
        shared-memory session if the server restarted), else fresh connections, the first after
        ``_backoff`` seconds, then at longer intervals up to ``probe_interval``."""
        self.error = str(error)
        fell_back = isinstance(error, FellBack)  # (warned once by the DataLink: the next call goes inline)
        self._count("data_plane_fallbacks", int(fell_back))
        (log.info if fell_back else log.warning)("lost the call to %s (%s); reconnecting", self.address, error)
        if isinstance(error, WeightsNotHeld):  # (it dropped the sampler's weights)
            conn.weights_sent = False  # (sent again before the next call)
        if conn.wait_ready(RECONNECT_S):
            if conn.shm is not None and conn.shm.gone:  # (a restart ends the session)
                conn.new_session()
            try:
                if self._pass is None or self._pass.closed:  # (else the next call's server id is checked)
                    conn.check_unchanged(self.options.connect_timeout)  # (a restart over other data: left out now)
                return
            except (DatasetChangedError, DatasetNotFoundError) as e:
                self._left_out(e)
                return
            except (ConnectionError, TimeoutError):
                pass  # (not answering after all: a fresh connection below)
        self._drop_connection()

    def _left_out(self, error: BaseException) -> None:
        """The server serves another dataset now: down until a fresh connection finds the loader's."""
        self.error = str(error)
        self._drop_connection(failed=error)
        self._sleep(self.options.probe_interval)

    def _drop_connection(self, failed: BaseException | None = None) -> None:
        """Close the connection (the thread makes a fresh one), its descriptions counted; ``failed``:
        the pass hears ``link_failed`` first (the link already without a connection)."""
        with self._lock:
            sink, conn, self.conn = self._pass, self.conn, None
            self._described += conn.describes if conn is not None else 0
        if failed is not None and sink is not None:
            sink.link_failed(self, failed)
        if conn is not None:
            conn.close()

    def _mine(self, shm: Any, freed: tuple = ()) -> list[int]:
        """The leases of ``shm``'s session among ``freed`` and those waiting (those of another session
        are dropped: it ended)."""
        freed = list(freed)
        while True:
            try:
                freed.append(self._freed.get_nowait())
            except queue.Empty:
                break
        return [lease for session, lease in freed if shm is not None and session == shm.session]

    def _release_broken(self, conn: ServerConnection) -> tuple[str, str] | None:
        """Report the call that broke, (session, tag), if any: a server that lives on (the same
        session) releases what it sent on it that never came; a restarted one kept nothing."""
        broken, self._broken = self._broken, None
        if broken is not None and (shm := conn.shm) is not None and shm.session == broken[0] and not shm.gone:
            conn.release(broken[0], abandoned=broken[1], received=shm.held())
        return broken

    def _drain(self) -> None:
        """After the last call: report a call ``close`` cancelled, release what the caller frees by
        ReleaseLeases (``conn.release``, retried) as it comes until the session holds nothing (or
        ended), sweeping idle mappings meanwhile, then close the connection."""
        if (conn := self.conn) is None or forks.forked(self._owner):
            return
        self._release_broken(conn)
        shm = conn.shm
        while shm is not None and shm.outstanding and not shm.gone:
            try:
                first = self._freed.get(timeout=DRAIN_POLL_S)
            except queue.Empty:
                shm.sweep()
                continue
            mine = self._mine(shm, (first,))
            if mine and not conn.release(shm.session, mine):
                break
            shm.forget(mine)
        conn.close()
