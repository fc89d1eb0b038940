"""The request iterator of a server's one ``Batches`` call (client/transport/call.py opens and reads it).

``Outbox`` is a plain object, testable without a network. Its first message opens the call
(``BatchesControl.open``, a ``StreamBatchesRequest``); ``reopen`` switches the call to the next
pass's request (a later ``open``: ``seq`` one more; the server revokes the previous one's grants).
Grants and revokes name the ``seq`` of the pass they belong to, and those of an earlier one are
dropped here, so a pass that ends late can never touch the next one's batches. After the open,
each message carries what was queued since the last one: revokes (at once), grants (at once,
except on a call that has released leases: a grant then waits up to ``release_delay`` seconds for
the release of the batch the loop lets go as it takes the next, so that both share one message),
lease releases (``take_releases``: freed tensors queue them without a lock; they go with the next
message, or within ``release_delay`` while any is queued, or within ``_LEASE_POLL_S`` once no
grant comes: no unary ReleaseLeases per batch) and the training loop's progress (at most every
``progress_every`` seconds while it changes; a pass's last one goes before the next ``open``).
``close()`` half-closes once what is queued went out, its last message marked ``done`` (the
server counts the call finished); ``abort()`` ends the iterator at once. gRPC's own thread runs
the iterator; it waits on a condition with a timeout and never spins.

Once the call's data connection is open and its server reads control frames there (plain TCP:
``batchd.datawire``), ``direct(send)`` sends grants and revokes that way instead, each in the
thread that grants, with the pass's ``open_seq`` (the server holds a frame of a later ``open``
until it switched, and ignores one of an earlier): a grant then costs one ``send``, not a wake-up
of gRPC's request thread and its channel thread (Table 18, issue 28). A send that fails puts the
message back on the call, the progress it carried included. Where the server reads releases there
too (``batchd-data-releases``; a shared-memory call whose messages come on its data connection),
the leases freed so far ride on each grant's frame, and those freed while no grant comes go alone
in a frame within ``_LEASE_POLL_S``: such a call sends no gRPC message per batch at all. Where
it reads later ``open``s there too (``batchd-data-opens``), ``reopen`` sends the pass's last
progress and the next ``open`` as frames from the caller's thread: nor one per pass.

Thread-safety: every method may be called from any thread; freed tensors' finalizers never call
the outbox (they queue leases on the caller's ``take_releases`` source, without a lock).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable, Iterator

from batchd import datawire
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader")

_POLL_S = 0.5  # the request iterator's longest wait on its queue (it reports progress this often at most)
_LEASE_POLL_S = 0.05  # ... while leases are outstanding (freed ones queue without waking it)
_GRANT, _REVOKE, _OPEN, _CLOSE = range(4)


class Outbox:
    """The request iterator of one Batches call (module docstring). Thread-safe.

    open_request: the ``StreamBatchesRequest`` of the first message. progress: the first pass's
    ``Progress`` (its ``progress(force)`` gives a ``StreamProgress`` to report, or None when
    nothing changed). take_releases(): the leases freed since the last call (a list; none
    without a shared-memory session); pending(): whether leases may still be freed (the
    iterator then looks for them every ``_LEASE_POLL_S``). sent(leases): called once a message
    carrying releases was handed to gRPC; unsent(leases): leases taken that will not go on the
    call (to be released another way). release_delay, progress_every: seconds.
    """

    def __init__(self, open_request: pb.StreamBatchesRequest, *, progress: Any = None,
                 take_releases: Callable[[], list[int]] | None = None, pending: Callable[[], bool] | None = None,
                 sent: Callable[[list[int]], None] | None = None,
                 unsent: Callable[[list[int]], None] | None = None, release_delay: float = 0.005,
                 progress_every: float = 0.5):
        self._take_releases = take_releases or (lambda: [])
        self._pending = pending or (lambda: False)
        self._sent = sent or (lambda leases: None)
        self._unsent = unsent or (lambda leases: None)
        self.release_delay = release_delay
        self.progress_every = progress_every
        self._cond = threading.Condition(threading.Lock())
        self._open = open_request
        self._items: collections.deque = collections.deque()  # (kind, seq or request, batches or progress)
        self.seq = 0  # the open_seq of the pass grants name now (Batch.open_seq)
        self._progress = progress  # the current pass's Progress (its progress rides on its messages)
        self._closed = False  # half-closing or aborted: nothing more is queued
        self._aborted = False
        self._last_progress = time.monotonic()
        self._pairs = False  # a release went out: grants wait a little for the next one
        self._direct: Callable[[bytes], None] | None = None  # sends a control frame on the data connection
        self._direct_releases = False  # ... releases included (the server reads them there)
        self._direct_opens = False  # ... and later opens
        self._unsent_progress: pb.StreamProgress | None = None  # in a frame that could not be sent: on the call
        self.frames = 0  # control frames sent on the data connection

    # --- from any thread ---------------------------------------------------------------------------

    def grant(self, batches: list[int], seq: int) -> None:
        """Grant ``batches`` of pass ``seq`` (dropped if the call moved on to another pass)."""
        self._put(_GRANT, seq, batches)

    def revoke(self, batches: list[int], seq: int) -> None:
        """Revoke grants of pass ``seq`` (dropped if the call moved on: the switch revoked them)."""
        self._put(_REVOKE, seq, batches)

    def _put(self, kind: int, seq: int, batches: list[int]) -> None:
        with self._cond:
            if not batches or seq != self.seq or self._closed:
                return
            if self._direct is not None and self._send_direct(kind, batches):
                return
            self._items.append((kind, seq, batches))
            self._cond.notify()

    def reopen(self, request: pb.StreamBatchesRequest, progress: Any = None) -> int:
        """Switch the call to ``request`` (the next pass): returns its ``seq``. The current pass's
        last progress goes first; both in control frames from this thread where the server reads
        opens there, else on the call. Raises RuntimeError once the call is closing."""
        with self._cond:
            if self._closed:
                raise RuntimeError("the call is closing")
            self.seq += 1
            if not (self._direct is not None and self._direct_opens and self._open_direct(request, progress)):
                self._items.append((_OPEN, request, progress))
                self._cond.notify()
            return self.seq

    def _open_direct(self, request: pb.StreamBatchesRequest, progress: Any) -> bool:  # (under the lock)
        """``reopen`` in frames, one write: the last progress of the pass before (its ``open_seq``),
        then the ``open`` (``self.seq``). False: both go on the call."""
        last = self._due_progress(force=True)
        before = [] if last is None else [pb.BatchesControl(progress=last, open_seq=self.seq - 1)]
        if not self._frame(*before, pb.BatchesControl(open=request, open_seq=self.seq)):
            self._unsent_progress = last
            return False
        self._progress, self._last_progress = progress, time.monotonic()
        return True

    def direct(self, send: Callable[[bytes], None], releases: bool = False, opens: bool = False) -> None:
        """From now on send grants and revokes (with the progress when due) as control frames by
        ``send`` (the call's data connection), those queued first (module docstring);
        ``releases``: the server reads releases there too, so freed leases ride on those frames,
        and go alone in one when no grant comes; ``opens``: and later ``open``s (``reopen``)."""
        with self._cond:
            if self._aborted or self._closed:
                return
            self._direct, self._direct_releases, self._direct_opens = send, releases, opens
            queued = [item for item in self._items if item[0] in (_GRANT, _REVOKE)]
            self._items = collections.deque(item for item in self._items if item[0] not in (_GRANT, _REVOKE))
            for n, (kind, seq, batches) in enumerate(queued):
                if seq == self.seq and not self._send_direct(kind, batches):
                    self._items.extend(queued[n:])
                    self._cond.notify()
                    break

    def _send_direct(self, kind: int, batches: list[int]) -> bool:  # (under the lock)
        """A grant or revoke in a control frame (with the freed leases where the server reads them
        there): False if it could not go (its leases back to the caller's queue)."""
        releases = self._take_releases() if self._direct_releases else []
        message = pb.BatchesControl(grant=batches) if kind == _GRANT else pb.BatchesControl(revoke=batches)
        if self._control(message, releases):
            return True
        if releases:
            self._unsent(releases)
        return False

    def _direct_only(self, releases: list[int]) -> bool:
        """With grants going as frames, what is due without a grant (``releases``, where the server
        reads them in frames; the progress, when due) in a control frame: True if it went, or
        nothing was due; False: it goes on the call (the progress with it)."""
        with self._cond:
            if self._direct is None or (releases and not self._direct_releases):
                return False
            return self._control(pb.BatchesControl(), releases)

    def _control(self, message: pb.BatchesControl, releases: list[int]) -> bool:  # (under the lock)
        """``message`` of the current pass in a control frame, with ``releases`` (``sent`` once it
        went) and the progress when due: True if it went, or nothing was to go; False: the data
        connection is given up for frames, and the progress goes on the call's next message."""
        message.open_seq = self.seq
        message.release.extend(releases)
        progress = self._due_progress(force=False)
        if progress is not None:
            message.progress.CopyFrom(progress)
        elif not (message.grant or message.revoke or releases):
            return True
        if not self._frame(message):
            self._unsent_progress = progress  # (counted reported: the call's next message carries it)
            return False
        if releases:
            self._sent(releases)
        return True

    def _frame(self, *messages: pb.BatchesControl) -> bool:
        """Send ``messages`` as control frames in one write: True if they went; else the data
        connection is given up for frames (what they carried goes on the call). Under the lock."""
        try:
            self._direct(b"".join(datawire.pack_control(m.SerializeToString()) for m in messages))
        except (OSError, ValueError) as e:
            log.debug("a control frame could not be sent on the data connection (%s): on the call instead", e)
            self._direct = None
            return False
        self.frames += len(messages)
        return True

    def close(self) -> None:
        """Half-close once what is queued is sent (with the final progress), in a message marked ``done``."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._items.append((_CLOSE, None, None))
            self._cond.notify()

    def abort(self) -> None:
        """End now (the call is cancelled or broke)."""
        with self._cond:
            self._closed = self._aborted = True
            self._items.clear()
            self._cond.notify_all()

    def send_releases(self) -> None:
        """Send the leases freed so far now: in a control frame from this thread where the server
        reads them there (``_direct_only``: no wake-up of the request thread); else they go back
        to their queue and the request thread sends them on the call at once."""
        releases = self._take_releases()
        if not releases or self._direct_only(releases):
            return
        self._unsent(releases)
        with self._cond:
            self._cond.notify()

    # --- gRPC's thread -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[pb.BatchesControl]:
        yield self._out(pb.BatchesControl(open=self._open), [])
        while not self._aborted:
            grants, revokes, releases, opening, closing = self._collect()
            if self._aborted:
                if releases:
                    self._unsent(releases)  # (taken, never sent: released another way)
                return
            if not (grants or revokes or closing) and opening is None and self._direct_only(releases):
                continue
            progress = None
            if opening is not None or closing or self._direct is None:
                progress = self._due_progress(force=opening is not None or closing)
            if progress is None:
                progress = self._unsent_progress  # (a frame's that could not be sent)
            self._unsent_progress = None
            if grants or revokes or releases or progress is not None or closing:
                message = pb.BatchesControl(grant=grants, revoke=revokes, release=releases, done=closing)
                if progress is not None:
                    message.progress.CopyFrom(progress)
                yield self._out(message, releases)
            if opening is not None:
                request, self._progress = opening
                self._last_progress = time.monotonic()
                yield self._out(pb.BatchesControl(open=request), [])
            if closing:
                return

    def _out(self, message: pb.BatchesControl, releases: list[int]) -> pb.BatchesControl:
        if releases:
            self._pairs = True
            self._sent(releases)  # (before the yield: gRPC may never resume this generator)
        return message

    def _collect(self) -> tuple[list[int], list[int], list[int], tuple | None, bool]:
        """What to send next, up to the next ``open`` (grants, revokes, releases, that open, and
        whether the call closes: never with an open, as ``close`` queues last): waits for
        anything; grants wait up to ``release_delay`` more for a release to share their message
        (once releases went: ``_pairs``)."""
        grants: list[int] = []
        revokes: list[int] = []
        opening = None
        closing = False
        with self._cond:
            if not self._items and not self._aborted:
                self._cond.wait(_LEASE_POLL_S if self._pending() else _POLL_S)
            deadline = time.monotonic() + self.release_delay
            while True:
                while self._items and opening is None:
                    kind, seq, value = self._items.popleft()
                    if kind == _OPEN:
                        opening = (seq, value)  # (request, progress)
                    elif kind == _CLOSE:
                        closing = True
                    elif seq == self.seq:  # (an earlier pass's: the switch revoked it anyway)
                        (grants if kind == _GRANT else revokes).extend(value)
                releases = self._take_releases()
                if (revokes or closing or opening is not None or self._aborted or releases
                        or not (grants and self._pairs)):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._cond.wait(remaining)
        return grants, revokes, releases, opening, closing

    def _due_progress(self, force: bool) -> pb.StreamProgress | None:
        if self._progress is None:
            return None
        now = time.monotonic()
        if not force and now - self._last_progress < self.progress_every:
            return None
        progress = self._progress.progress(force=force)
        if progress is not None:
            self._last_progress = now
        return progress
