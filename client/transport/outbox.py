"""The request iterator of one ``Batches`` call (client/transport/call.py opens and reads the call).

``Outbox`` is the call's request iterator (a plain object, testable without a network). The first
message opens the call (``BatchesControl.open``, a ``StreamBatchesRequest``); after it, each
message carries what was queued since the last one: revokes (sent at once), grants (at once,
except on a call whose batches are released: once it released one, a grant waits up to
``release_delay`` seconds for the release of the batch the loop lets go as it takes the next, so
that both share one message instead of two), lease releases (sent with the next grant, or within
``release_delay`` seconds while any is queued: no unary ReleaseLeases per batch) and the training
loop's progress (at most every ``progress_every`` seconds while it changes, and once more in the
last message). ``close()``
half-closes the call once what is queued went out, its last message marked ``done`` (the server
counts the call finished, not cancelled); ``abort()`` ends the iterator at once. gRPC's
own thread runs the iterator; it waits on a condition with a timeout of ``_POLL_S`` (so it notices
an abort, and reports progress) and never spins.

Once the call's data connection is open and its server reads control frames there (plain TCP:
``batchd.datawire``), ``direct(send)`` sends grants and revokes that way instead: each in the
thread that grants, under the outbox's lock, with what was queued of them first, and with the
progress when it is due; the iterator then carries only releases and the last message (and
waits on its queue up to ``_DIRECT_POLL_S``: nothing but an abort, which wakes it, is left to
look for). A grant that way costs one
``send``; on the call it wakes gRPC's request thread and its channel thread, which then take
the GIL from the training loop (Table 18, issue 28). A send that fails puts the message back
on the call, the progress it carried included (the connection broke: the call breaks with it
and is resumed).

``release(lease)`` may be called from anywhere, a ``weakref.finalize`` callback included (the
outbox's lock is re-entrant, and it only appends). Once the outbox is closed it returns False and
the caller sends the release another way (``ReleaseLeases``); release and abort take the same lock,
so a release is either sent on the call or handed back. The releases the outbox sent last are
remembered (``recent_releases``): when a call breaks, nobody knows which of them the server read,
so the caller sends them again by ``ReleaseLeases`` (a lease released twice is ignored).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterator

from batchd import datawire
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader.loader")

_POLL_S = 0.25  # the request iterator's longest wait on its queue
_DIRECT_POLL_S = 5.0  # ... once grants and progress go on the data connection (``Outbox.direct``)
_RECENT_RELEASES = 256  # releases remembered to send again when a call breaks
_GRANT, _REVOKE, _RELEASE, _CLOSE = range(4)


class Outbox:
    """The request iterator of one Batches call (module docstring). Thread-safe.

    open_request: the ``StreamBatchesRequest`` of the first message. progress: a callable
    returning a ``StreamProgress`` to report (or None when nothing changed; ``force=True``: the
    final one). sent(leases): called after a message carrying releases was handed to gRPC (the
    shared-memory session forgets them). unsent(leases): releases queued that this call will
    never send (it was aborted): the caller sends them another way. release_delay,
    progress_every: seconds.
    """

    def __init__(self, open_request: pb.StreamBatchesRequest, *, progress: Callable[..., Any] | None = None,
                 sent: Callable[[list[int]], None] | None = None, unsent: Callable[[list[int]], None] | None = None,
                 release_delay: float = 0.005, progress_every: float = 0.5):
        self._open = open_request
        self._progress = progress
        self._sent = sent
        self._unsent = unsent
        self.release_delay = release_delay
        self.progress_every = progress_every
        # What is queued, under one re-entrant lock: a finalizer may release a lease in a thread that
        # holds it already (its collection ran there); release and abort never miss each other.
        # (A SimpleQueue read by the call's thread and drained by another was seen to leave a timed
        # get() of that thread blocked for good, with a release in it.)
        self._cond = threading.Condition(threading.RLock())
        self._items: collections.deque = collections.deque()
        self._closed = False  # no more releases accepted (half-closing or aborted)
        self._aborted = False
        self._last_progress = time.monotonic()
        self._pairs = False  # a release was queued: grants wait a little for the next one
        self._direct: Callable[[bytes], None] | None = None  # sends a control frame on the data connection
        self._unsent_progress: pb.StreamProgress | None = None  # in a frame that could not be sent: on the call
        self.frames = 0  # control frames sent on the data connection
        self.recent_releases: collections.deque[int] = collections.deque(maxlen=_RECENT_RELEASES)
        self.messages = 0  # messages handed to gRPC (the open included)

    # --- from any thread ---------------------------------------------------------------------------

    def _put(self, kind: int, value: Any) -> None:
        with self._cond:
            if self._direct is not None and not self._aborted and self._send_direct(kind, value):
                return
            self._items.append((kind, value))
            self._cond.notify()

    def grant(self, batches: list[int]) -> None:
        if batches:
            self._put(_GRANT, batches)

    def revoke(self, batches: list[int]) -> None:
        if batches:
            self._put(_REVOKE, batches)

    def direct(self, send: Callable[[bytes], None]) -> None:
        """From now on send grants and revokes (with the progress when due) as control frames by
        ``send`` (the call's data connection), those queued first (module docstring)."""
        with self._cond:
            if self._aborted or self._closed:
                return
            self._direct = send
            queued = [(kind, value) for kind, value in self._items if kind in (_GRANT, _REVOKE)]
            self._items = collections.deque(item for item in self._items if item[0] not in (_GRANT, _REVOKE))
            for n, (kind, value) in enumerate(queued):
                if not self._send_direct(kind, value):
                    self._items.extendleft(reversed(queued[n:]))
                    self._cond.notify()
                    break

    def _send_direct(self, kind: int, value: list[int]) -> bool:  # (under the lock)
        message = pb.BatchesControl(grant=value) if kind == _GRANT else pb.BatchesControl(revoke=value)
        progress = self._due_progress(force=False)
        if progress is not None:
            message.progress.CopyFrom(progress)
        try:
            self._direct(datawire.pack_control(message.SerializeToString()))
        except (OSError, ValueError) as e:
            log.debug("a control frame could not be sent on the data connection (%s): on the call instead", e)
            self._direct = None
            self._unsent_progress = progress  # (counted reported: the call's next message carries it)
            return False
        self.frames += 1
        return True

    def release(self, lease: int) -> bool:
        """Queue a freed lease for the next message. Reentrant. False once closed (the caller
        releases it another way)."""
        with self._cond:
            if self._closed:
                return False
            self._items.append((_RELEASE, lease))
            self._cond.notify()
            return True

    def close(self) -> None:
        """Half-close once what is queued is sent (with the final progress), in a message marked ``done``."""
        with self._cond:
            self._closed = True
            self._items.append((_CLOSE, None))
            self._cond.notify()

    def abort(self) -> None:
        """End now (the call is cancelled or broke); releases queued and never sent go to ``unsent``."""
        with self._cond:
            self._closed = self._aborted = True
            left = [value for kind, value in self._items if kind == _RELEASE]
            self._items.clear()
            self._cond.notify_all()
        self._hand_back(left)

    def _hand_back(self, releases: list[int]) -> None:
        if releases and self._unsent is not None:
            self._unsent(releases)

    @property
    def closed(self) -> bool:
        return self._closed

    # --- gRPC's thread -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[pb.BatchesControl]:
        self.messages += 1
        yield pb.BatchesControl(open=self._open)
        while not self._aborted:
            grants, revokes, releases, closing = self._collect()
            if self._aborted:
                self._hand_back(releases)  # (abort took what was still queued)
                return
            progress = self._due_progress(force=closing) if closing or self._direct is None else None
            if progress is None and self._unsent_progress is not None:
                progress = self._unsent_progress
            self._unsent_progress = None
            if grants or revokes or releases or progress is not None or closing:
                message = pb.BatchesControl(grant=grants, revoke=revokes, release=releases, done=closing)
                if progress is not None:
                    message.progress.CopyFrom(progress)
                self.messages += 1
                if releases:  # (before the yield: gRPC may never resume this generator after its last message)
                    self.recent_releases.extend(releases)
                    if self._sent is not None:
                        self._sent(releases)
                yield message
            if closing:
                return

    def _collect(self) -> tuple[list[int], list[int], list[int], bool]:
        """What to send next: waits up to ``_POLL_S`` for anything; releases alone, and grants
        alone once the call has released a lease, wait up to ``release_delay`` more for company."""
        grants: list[int] = []
        revokes: list[int] = []
        releases: list[int] = []
        closing = False
        with self._cond:
            if not self._items and not self._aborted:
                self._cond.wait(_POLL_S if self._direct is None else _DIRECT_POLL_S)
            deadline = None
            while True:
                while self._items:
                    kind, value = self._items.popleft()
                    if kind == _GRANT:
                        grants.extend(value)
                    elif kind == _REVOKE:
                        revokes.extend(value)
                    elif kind == _RELEASE:
                        releases.append(value)
                        self._pairs = True
                    elif kind == _CLOSE:
                        closing = True
                if revokes or closing or self._aborted or (grants and (releases or not self._pairs)):
                    break
                if not releases and not grants:
                    break
                now = time.monotonic()
                deadline = now + self.release_delay if deadline is None else deadline
                if now >= deadline:
                    break
                self._cond.wait(deadline - now)
        return grants, revokes, releases, closing

    def _due_progress(self, force: bool) -> pb.StreamProgress | None:
        if self._progress is None:
            return None
        now = time.monotonic()
        if not force and now - self._last_progress < self.progress_every:
            return None
        progress = self._progress(force=force)
        if progress is not None:
            self._last_progress = now
        return progress
