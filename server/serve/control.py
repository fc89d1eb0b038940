"""The client's side of one Batches call: its ``BatchesControl`` messages, read on a thread of their own.

A bidirectional call's request iterator blocks until the client sends, half-closes or goes away,
so the servicer's generator (which sends the batches and must poll ``context.is_active()``) never
reads it: ``CallControl`` starts a thread per call that does.

* The first message must carry ``open`` (INVALID_ARGUMENT otherwise); the servicer waits for it
  (``wait_open``), opens the stream, and hands it over (``attach``). The thread applies nothing
  before that; the rest of the first message (grants in the same message) is applied then.
* Each later message is applied to the stream as it arrives (``apply``): grants, revokes, leases
  released, progress. A message that is not a valid ``BatchesControl``, or a grant the stream
  refuses (``Stream.new_grants``: ValueError, ResourceExhaustedError) ends reading: ``error``
  holds the exception and the stream is interrupted, so the servicer ends the call with it at once.
* A later message with ``open`` switches the call to that request (the next epoch): the current
  stream's grants are revoked and it is ended as finished (``Stream.switch``), the request waits
  in ``next_open`` for the servicer (``take_next_open``), which opens its stream (``open_seq`` one
  more) and attaches it; the rest of that message is applied to the new stream.
* Grants, revokes, releases and progress may also come as control frames on the call's data
  connection (``apply_frame``, from that connection's reader thread: ``batchd.datawire``),
  applied as these messages are (a frame's releases whatever ``open`` it names: leases belong
  to the session); a frame may also switch the call to its next pass (a later ``open``, whose
  ``open_seq`` must be the next: ``_open_frame``, as a message's ``open`` does), so that a pass
  costs no gRPC message either; ``done`` in a frame, an ``open`` that is not the next, a frame
  that does not parse, or a refused grant ends the call with that error as well. A
  frame's grant after ``done`` is ignored (the call is ending): a frame's grant is applied wholly
  before ``done`` is marked, or not at all (one lock orders the two). A frame names the ``open``
  it belongs to (``BatchesControl.open_seq``): one of an earlier ``open`` is ignored, one of a
  later ``open`` waits until the switch to it.
* A message with ``done`` (the client's last: it ends the call on purpose) marks the stream
  ``half_closed`` and ``done`` at once: the call ends once every grant was sent, counted
  finished. A grant after it is refused (ValueError, as above).
* The request iterator ending without ``done`` marks the stream ``half_closed`` too (what was
  granted is still sent), but not ``done``, so the stream counts as cancelled: gRPC ends a
  server's request iterator when the client half-closes and, at times, when it cancels before the
  cancellation shows (``is_active()`` still True), so the iterator's end alone cannot say which.
  The call going away (the iterator raises) interrupts it (``gone``).

The thread never outlives the call: gRPC ends the request iterator when the call ends, and
``detach`` stops it from applying anything more. Counters (``count(key, n)``): control_messages,
batches_granted, batches_revoked, leases_released_on_calls, control_frames (those that came on
the data connection).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterator

import grpc

from batchd.server.serve.stream import Stream
from batchd.server.serve.transport import Transport, progress
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

_ATTACH_POLL_S = 0.25


class CallControl:
    """Reads one Batches call's requests on a daemon thread (see the module doc).

    requests: the call's request iterator (items: ``pb.BatchesControl``, or anything else for a
    message that did not parse). is_active: whether the call is still on (``context.is_active``).
    transport: releases leases and credits progress. max_grants: the server's bound on a call's
    grants not yet sent. count(key, n): the server's counters.
    """

    def __init__(self, requests: Iterator, *, is_active: Callable[[], bool], transport: Transport, max_grants: int,
                 count: Callable[[str, int], None], name: str = "batchd-batches"):
        self._requests = requests
        self._is_active = is_active
        self._transport = transport
        self._max_grants = max_grants
        self._count = count
        self._lock = threading.Lock()
        self._attach_changed = threading.Condition(self._lock)  # a stream was attached (a frame may wait for it)
        # ``done`` and a control frame's grant, in one order: the reader marks done (and half-closes)
        # under it, a frame checks done and applies its grant under it (check-then-act)
        self._done_order = threading.Lock()
        self._opened = threading.Event()  # open arrived, or reading ended before it
        self._attached = threading.Event()  # the servicer handed over the stream (or gave up)
        self.open: pb.StreamBatchesRequest | None = None
        self.next_open: pb.StreamBatchesRequest | None = None  # a later `open`, for the servicer to switch to
        self._first: pb.BatchesControl | None = None
        self._stream: Stream | None = None
        self._seq = 0  # the open_seq of the stream attached last
        self.error: BaseException | None = None  # why reading stopped early (the call must end with it)
        self.gone = False  # the call went away (cancelled, deadline, connection lost)
        self._done = False  # the client said ``done``
        self._thread = threading.Thread(target=self._read, name=name, daemon=True)
        self._thread.start()

    # --- the servicer's side ---------------------------------------------------------------------

    def wait_open(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the first message; True once reading got that far
        (``open`` is set, or ``error``/``gone`` say why not)."""
        return self._opened.wait(timeout)

    def attach(self, stream: Stream) -> None:
        """The stream is open: apply the first message's grants and everything after it to ``stream``
        (after a switch: the rest of the message that switched, and everything after it)."""
        with self._lock:
            self._stream = stream
            self._seq = stream.open_seq
            self._attach_changed.notify_all()
        self._attached.set()

    def take_next_open(self) -> pb.StreamBatchesRequest | None:
        """The request the client switched the call to (a later ``open``), once; None if none is
        waiting (the call ends)."""
        with self._lock:
            request, self.next_open = self.next_open, None
            return request

    def detach(self) -> None:
        """The call is ending: apply nothing more (and stop waiting for ``attach``)."""
        with self._lock:
            self._stream = None
            self._attach_changed.notify_all()
        self._attached.set()

    # --- the reading thread ------------------------------------------------------------------------

    def _read(self) -> None:
        half_closed = done = False
        try:
            for msg in self._requests:
                self._count("control_messages", 1)
                if not isinstance(msg, pb.BatchesControl):
                    raise ValueError("Batches: a BatchesControl message is not a valid protobuf message")
                if self.open is None:
                    if not msg.HasField("open"):
                        raise ValueError("Batches: the first BatchesControl must carry `open` (what to stream)")
                    self.open, self._first = msg.open, msg
                    self._opened.set()
                    while not self._attached.wait(_ATTACH_POLL_S):  # the servicer opens the stream
                        if not self._is_active():
                            raise grpc.RpcError("the call ended")
                    msg.ClearField("open")
                elif msg.HasField("open"):
                    if done:
                        raise ValueError("Batches: an `open` after `done` (the client said it grants nothing more)")
                    self._switch(msg.open)
                    msg.ClearField("open")
                elif done and msg.grant:
                    raise ValueError("Batches: a grant after `done` (the client said it grants nothing more)")
                if not self.apply(msg):
                    return
                if msg.done and not done:
                    with self._done_order:
                        done = self._done = True
                        self._half_close()
            half_closed = True
        except grpc.RpcError:  # the request iterator raises once the call is over
            self.gone = True
        except Exception as e:
            self.error = e
        finally:
            self._opened.set()
            with self._lock:
                stream = self._stream
            if stream is not None:
                stream.interrupt(half_closed=half_closed and self.error is None)

    def _switch(self, request: pb.StreamBatchesRequest) -> None:
        """A later ``open``: end the current stream (its grants revoked, counted finished), hand
        ``request`` to the servicer, and wait until it attached the new stream."""
        with self._lock:
            stream, self._stream = self._stream, None
            self.next_open = request
            self._attached.clear()
        if stream is not None:
            stream.switch()
        while not self._attached.wait(_ATTACH_POLL_S):  # the servicer opens the new stream
            if not self._is_active():
                raise grpc.RpcError("the call ended")
        with self._lock:
            if self._stream is None:  # the servicer ended the call instead (it could not open it)
                raise grpc.RpcError("the call ended")

    # --- the data connection's reader thread ---------------------------------------------------

    def apply_frame(self, data: bytes) -> bool:
        """Apply one control frame's message (``batchd.datawire``: grant, revoke, release, progress,
        a later open), first waiting for ``attach`` (a frame may come before the servicer handed
        the stream over). False once the call is ending or the frame ended it (``fail``)."""
        while not self._attached.wait(_ATTACH_POLL_S):
            if not self._is_active():
                return False
        try:
            try:
                msg = pb.BatchesControl.FromString(data)
            except Exception:  # (protobuf's DecodeError)
                raise ValueError("Batches: a control frame on the data connection is not a valid BatchesControl") \
                    from None
            if msg.done:
                raise ValueError("Batches: a control frame on the data connection may carry grant, revoke, "
                                 "release, progress and a later open only")
            self._count("control_frames", 1)
            if msg.release:  # (leases belong to the session, not to a pass: whatever its open_seq)
                with self._lock:
                    stream = self._stream
                if stream is not None and not stream.request.session:
                    raise ValueError("Batches: a control frame on the data connection may carry release only on "
                                     "a shared-memory call (this call holds no leases)")
                self._release(msg.release, stream)
                if not (msg.grant or msg.revoke or msg.HasField("progress") or msg.HasField("open")):
                    return True
                del msg.release[:]
            # a frame of a later `open` waits for the switch to it, one that opens it for the one before
            after = msg.open_seq - 1 if msg.HasField("open") else msg.open_seq
            with self._lock:
                while True:
                    seq = self._seq if self._stream is not None else -1
                    if after <= seq:
                        break
                    if not self._is_active() or self.gone or self.error is not None:
                        return False
                    self._attach_changed.wait(_ATTACH_POLL_S)
            if msg.HasField("open"):
                return self._open_frame(msg, seq)
            if msg.open_seq < seq:
                return True  # (of an earlier `open`: its batches are no longer wanted)
            with self._done_order:
                if self._done and msg.grant:
                    return True  # (the call is ending: the client granted before it said done)
                return self.apply(msg)
        except grpc.RpcError:  # (the call ended while a frame's `open` switched it)
            return False
        except Exception as e:
            self.fail(e)
            return False

    def _open_frame(self, msg: pb.BatchesControl, seq: int) -> bool:
        """A frame's later ``open`` (``msg.open_seq``: the pass after ``seq``, the one attached):
        switch the call to it as the call's own messages do, then apply the rest of the frame to
        the new stream. Ignored once the client said ``done`` (one lock orders the two, held
        across the switch). Raises ValueError for an ``open_seq`` other than the next."""
        if msg.open_seq != seq + 1:
            raise ValueError(f"Batches: a control frame's open names open_seq {msg.open_seq}; the next is {seq + 1}")
        with self._done_order:
            if self._done:
                return True  # (the call is ending: the client opened before it said done)
            self._switch(msg.open)
            msg.ClearField("open")
            return self.apply(msg)

    def fail(self, error: BaseException) -> None:
        """End the call with ``error`` (a bad frame on the data connection), as a bad message does."""
        with self._lock:
            if self.error is None:
                self.error = error
            stream = self._stream
        if stream is not None:
            stream.interrupt()

    def _half_close(self) -> None:
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.interrupt(half_closed=True, done=True)

    def _release(self, leases, stream: Any = None) -> None:
        """Release ``leases`` of the attached (or given) stream's shared-memory session."""
        if stream is None:
            with self._lock:
                stream = self._stream
        if stream is not None and stream.request.session:
            self._count("leases_released_on_calls", self._transport.release_leases(stream.request.session,
                                                                                   list(leases)))

    def apply(self, msg: pb.BatchesControl) -> bool:
        """Apply one message to the attached stream: grants first, then revokes, releases, progress.
        False if no stream is attached any more (the call is ending). Raises ValueError or
        ResourceExhaustedError for a grant the stream refuses (nothing of that message granted)."""
        with self._lock:
            stream = self._stream
        if stream is None:
            return False
        if msg.grant:
            self._count("batches_granted", stream.grant(list(msg.grant), max_grants=self._max_grants))
        if msg.revoke:
            self._count("batches_revoked", stream.revoke(list(msg.revoke)))
        if msg.release:
            self._release(msg.release, stream)
        if msg.HasField("progress"):
            progress(stream, msg.progress)
        return True
