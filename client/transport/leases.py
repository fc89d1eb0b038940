"""What a client tells a server it let go of, and how far it read: one reporter thread per server.

Leases of shared-memory batches whose tensors were freed are queued by ``weakref.finalize``
callbacks (which may run inside a gRPC call or under a lock, so they only queue). While a
``Batches`` call is open on the session (``carry``), they ride on that call's request stream
(``batchd.client.transport.outbox.Outbox``: with the next grant, or within a few ms), and so does the
training loop's progress: no unary call per batch. What cannot ride on a call goes through
``ReleaseLeases`` (loader.proto), sent by ``Reporter``'s thread:

* freed leases while no call is open on their session (after the loop), or that a call that
  ended could not send (``freed_all``). A lease freed between two calls on its session (an
  epoch boundary: the last batches of an epoch are freed after its call ended) waits up to
  ``hold`` seconds for the next call to carry it before it goes by ReleaseLeases: one unary call
  less per epoch on both sides;
* an abandoned call: when the client stops reading a call before its end (a ``break``, a closed
  or collected iterator, a failover, a broken call), it names the call's ``stream_tag`` and every
  lease it received on it; the server releases the others, which gRPC had buffered;
* progress of calls that do not carry it (``CallRecord.carried`` False): batches and samples the
  training loop took per call, at most every ``interval`` seconds while they change, and once
  more when the call ends.

A request that fails with a transient status is retried with exponential backoff (tenacity) for
up to ``retry_for`` seconds instead of being dropped; after that the leases go back when the
session ends (the server returns every slot of a session whose call ended).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import grpc
import tenacity

from batchd.client import forks
from batchd.client.loader.timings import WaitMeter
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}


def new_tag_prefix() -> str:
    """A random prefix for the stream tags of one connection (tags are unique across clients)."""
    return uuid.uuid4().hex[:12]


@dataclass(eq=False)
class CallRecord:
    """One StreamBatches call as the client saw it: its tag, the leases received on it, and what
    the training loop took from it. ``add`` runs in the receiver thread, ``took`` in the
    consumer's, ``close`` in whichever stops the call; all thread-safe."""

    tag: str
    session: str = ""  # the shared-memory session of the call, "" inline
    carried: bool = False  # its progress rides on the call itself (a Batches call), not ReleaseLeases
    shm: Any = None  # the SharedMemorySession of the call (None inline): its leases belong there
    batches_taken: int = 0
    samples_taken: int = 0
    abandoned: bool = False
    # the training loop's recent wait for this call's batches, and the loader's profile verdict
    # (RemoteDataLoader, batchd.client.loader.timings): reported with the progress
    waits: WaitMeter = field(default_factory=WaitMeter)
    verdict: str = ""
    _received: list[int] = field(default_factory=list)
    _closed: bool = False
    _reported: tuple[int, int] = (0, 0)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, lease: int) -> bool:
        """Note a lease received on the call; False once the call was closed (the lease is then
        not the client's: the server releases it, so it must not be used)."""
        with self._lock:
            if self._closed:
                return False
            self._received.append(lease)
            return True

    def took(self, samples: int) -> None:
        """The training loop took one batch of ``samples`` samples from this call."""
        with self._lock:
            self.batches_taken += 1
            self.samples_taken += samples

    def loop_waited(self, wait: float, step: float, verdict: str) -> None:
        """The training loop waited ``wait`` seconds for one of this call's batches, after a step
        of ``step`` seconds; ``verdict``: the loader's profile verdict now."""
        with self._lock:
            self.waits.add(wait, step)
            self.verdict = verdict

    def close(self, abandoned: bool) -> list[int]:
        """No more leases are accepted; returns every lease received (held or released)."""
        with self._lock:
            self._closed, self.abandoned = True, abandoned
            return list(self._received)

    def progress(self, force: bool = False) -> pb.StreamProgress | None:
        """The progress to report, or None if it did not change since the last report."""
        with self._lock:
            now = (self.batches_taken, self.samples_taken)
            if now == self._reported and not force:
                return None
            self._reported = now
            wait_ratio, verdict = self.waits.ratio, self.verdict
        return pb.StreamProgress(stream_tag=self.tag, batches_taken=now[0], samples_taken=now[1],
                                 wait_ratio=wait_ratio, verdict=verdict)


class Reporter:
    """The thread that sends ReleaseLeases for one channel (see the module docstring).

    interval: seconds between progress reports while it changes. retry_for: seconds a failing
    request is retried before it is dropped (logged). hold: seconds a lease freed while no call is
    open on its session waits for one to carry it (0: ReleaseLeases at once). ``close(then)`` ends the thread once every
    shared-memory session it serves has no lease outstanding, then calls ``then`` (closes the
    channel).
    """

    def __init__(self, channel: grpc.Channel, address: str, *, interval: float = 0.5, retry_for: float = 30.0,
                 hold: float = 0.05):
        self.address = address
        self.interval = interval
        self.hold = hold
        self._held: list[tuple[float, str, int]] = []  # (deadline, session, lease): freed, no call to carry it (yet)
        self._rpc = channel.unary_unary(
            "/batchd.v1.BatchLoader/ReleaseLeases",
            request_serializer=pb.ReleaseLeasesRequest.SerializeToString,
            response_deserializer=pb.ReleaseLeasesResponse.FromString,
        )
        self._retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, grpc.RpcError) and e.code() in _TRANSIENT),
            wait=tenacity.wait_exponential(multiplier=0.1, max=2.0),
            # a session whose call ended has no leases left on the server: nothing to retry for
            stop=tenacity.stop_after_delay(retry_for) | (lambda state: self._session_gone()),
            reraise=True)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._calls: dict[str, CallRecord] = {}  # open calls, by tag
        self._sessions: dict[str, Any] = {}  # session id -> SharedMemorySession (forget, sweep, end_if_done)
        self._carriers: dict[str, Any] = {}  # session id -> the Outbox of the call open on it
        self._closing = False
        self._then: Callable[[], None] | None = None
        self._sending = ""  # the session of the request being sent
        self._owner = forks.owner()  # no thread here in a forked child: nothing is queued there
        self._thread = threading.Thread(target=self._loop, name="batchd-report", daemon=True)
        self._thread.start()

    # --- called from other threads --------------------------------------------------------------

    def freed(self, session: str, lease: int) -> None:
        """A batch's tensors were freed: the release rides on the call open on ``session``, else
        goes by ReleaseLeases. Reentrant (a dict read and SimpleQueue puts): safe in a finalizer.
        Nothing in a forked child (the lease is the parent's)."""
        if forks.forked(self._owner):
            return
        carrier = self._carriers.get(session)
        if carrier is not None and carrier.release(lease):
            return
        self._queue.put(("freed", session, lease, True))

    def freed_all(self, session: str, leases: list[int]) -> None:
        """Release ``leases`` by ReleaseLeases (a call that ended could not send them, or may have
        lost them). Releasing one twice is harmless: the server ignores an unknown lease."""
        if not forks.forked(self._owner):
            for lease in leases:
                self._queue.put(("freed", session, lease, False))

    def carry(self, session: str, outbox: Any) -> None:
        """Releases of ``session`` ride on ``outbox`` (an open Batches call's) from now on (held
        ones too: the thread is woken for them)."""
        self._carriers[session] = outbox
        if self._held:
            self.wake()

    def uncarry(self, session: str, outbox: Any) -> None:
        """``outbox``'s call ended: releases of ``session`` go by ReleaseLeases again."""
        if self._carriers.get(session) is outbox:
            del self._carriers[session]

    def wake(self) -> None:
        """Run a round now (e.g. a session is closing)."""
        self._queue.put(("wake",))

    def add_session(self, session: Any) -> None:
        with self._lock:
            self._sessions[session.session] = session

    def open_call(self, record: CallRecord) -> None:
        with self._lock:
            self._calls[record.tag] = record

    def end_call(self, record: CallRecord, abandoned: bool) -> None:
        """The client stopped reading the call: report its last progress, and, if ``abandoned``
        (stopped before its end), the leases received on it."""
        received = record.close(abandoned)
        self._queue.put(("ended", record, received))

    def close(self, then: Callable[[], None] | None = None, wait: float = 0.0) -> None:
        """Finish: the thread ends once nothing is outstanding, then calls ``then``. ``wait``:
        seconds to wait for that here. Idempotent."""
        with self._lock:
            self._closing = True
            if then is not None:
                self._then = then
            sessions = list(self._sessions.values())
        for s in sessions:
            s.close()
        self.wake()
        if wait > 0 and self._thread is not threading.current_thread():
            self._thread.join(wait)

    # --- the thread --------------------------------------------------------------------------------

    def _loop(self) -> None:
        while True:
            items = []
            held = self._held
            timeout = self.interval if not held else max(0.0, min(self.interval, held[0][0] - time.monotonic()))
            try:
                items.append(self._queue.get(timeout=timeout))
                while True:
                    items.append(self._queue.get_nowait())
            except queue.Empty:
                pass
            try:
                self._report(items)
            except Exception:  # never die silently: the next round reports again
                log.exception("reporting to %s failed", self.address)
            with self._lock:
                sessions = list(self._sessions.values())
            if not items:  # an idle round: segments unlinked since the last release go now
                for s in sessions:
                    s.sweep()
            done = [s for s in sessions if s.end_if_done()]  # (cancels a call: not under the lock)
            with self._lock:
                for s in done:
                    self._sessions.pop(s.session, None)
                finished = self._closing and not self._sessions
            if finished and self._queue.empty() and not self._held:
                break
        then, self._then = self._then, None
        if then is not None:
            then()

    def _report(self, items: list[tuple]) -> None:
        requests: list[pb.ReleaseLeasesRequest] = []
        freed: dict[str, list[int]] = {}
        ended: list[CallRecord] = []
        for item in items:
            if item[0] == "freed":
                if item[3] and self.hold > 0:
                    self._held.append((time.monotonic() + self.hold, item[1], item[2]))
                else:
                    freed.setdefault(item[1], []).append(item[2])
            elif item[0] == "ended":
                record, received = item[1], item[2]
                ended.append(record)
                if record.abandoned and record.session:
                    requests.append(pb.ReleaseLeasesRequest(session=record.session, abandoned_stream=record.tag,
                                                            received_leases=received))
        self._place_held(freed)
        requests.extend(pb.ReleaseLeasesRequest(session=s, leases=leases) for s, leases in freed.items())
        with self._lock:
            for record in ended:
                self._calls.pop(record.tag, None)
            open_calls = list(self._calls.values())
        progress: dict[str, list[pb.StreamProgress]] = {}
        for record in open_calls + ended:
            if record.carried:
                continue  # its progress went on the call
            p = record.progress(force=record in ended and record.batches_taken > 0)
            if p is not None:
                progress.setdefault(record.session, []).append(p)
        for session, entries in progress.items():
            request = next((r for r in requests if r.session == session), None)
            if request is None:
                requests.append(request := pb.ReleaseLeasesRequest(session=session))
            request.progress.extend(entries)
        for request in requests:
            self._send(request)
        with self._lock:
            sessions = dict(self._sessions)
        for session, leases in freed.items():
            if session in sessions:
                sessions[session].forget(leases)

    def _place_held(self, freed: dict[str, list[int]]) -> None:
        """Held leases ride on a call now open on their session; those past their deadline (or all,
        once closing) go into ``freed`` (sent by ReleaseLeases)."""
        if not self._held:
            return
        now = time.monotonic()
        with self._lock:
            closing = self._closing
        kept = []
        for deadline, session, lease in self._held:
            carrier = self._carriers.get(session)
            if carrier is not None and carrier.release(lease):
                continue
            if closing or deadline <= now:
                freed.setdefault(session, []).append(lease)
            else:
                kept.append((deadline, session, lease))
        self._held = kept

    def _session_gone(self) -> bool:
        """Whether the session of the request being sent ended (its call is over: the server
        took its leases back)."""
        with self._lock:
            session = self._sessions.get(self._sending)
        return session is not None and session.gone

    def _send(self, request: pb.ReleaseLeasesRequest) -> None:
        """Send ``request``; one that gives slots back is retried (progress alone is not: the
        next change is reported in full anyway, as totals)."""
        self._sending = request.session
        try:
            if request.leases or request.abandoned_stream:
                self._retrying(self._rpc, request, timeout=10)
            else:
                self._rpc(request, timeout=10)
        except grpc.RpcError as e:
            count = len(request.leases) + len(request.received_leases)
            level = logging.WARNING if count and not self._session_gone() else logging.DEBUG
            log.log(level, "could not tell %s about %d released leases (%s); they go back when the session ends",
                    self.address, count, e.code().name)
        except ValueError:  # the channel is closed: so are its sessions
            pass
