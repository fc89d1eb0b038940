"""Sending one call's batches: the loop shared by StreamBatches and Batches calls.

A call's loop never blocks for long: it waits for the next batch in slices of ``_POLL_S`` and
stops as soon as ``context.is_active()`` turns false (client gone), the client half-closed and
got every grant, a control message was refused, or the server drains. Each batch is serialized
for its transport (``Transport.encode``: lent in place, copied inline, or its payload's place for
the data connection), and with the socket transport its payload follows on the call's data
connection (``CallSender``); a shared-memory call that asked for it (``data_messages``) sends
its messages alone on that connection. The call's stream is closed at the end, with how it ended
(``Loader.close_stream``'s reason).
"""

from __future__ import annotations

import time

import grpc

from batchd.errors import ResourceExhaustedError, SampleError, ShapeMismatchError, WorkerError
from batchd.server.compute.pool import WAKE_STREAM
from batchd.server.serve.control import CallControl
from batchd.server.serve.data_connection import CallSender
from batchd.server.serve.handlers import abort_with_detail
from batchd.server.serve.lag import LagLog
from batchd.server.serve.stream import Stream
from batchd.server.serve.transport import LEASE_WAIT_S, socket_payload

_POLL_S = 0.25


class _Ending:
    """How a call ended, for ``Loader.close_stream``'s log: "finished" until a step says otherwise."""

    __slots__ = ("reason",)

    def __init__(self) -> None:
        self.reason = "finished"


class BatchSending:
    """Mixed into ``BatchLoaderService`` (server/serve/service.py): needs its ``loader`` and ``redact``."""

    def _serve(self, stream: Stream, context: grpc.ServicerContext, control: CallControl | None = None,
               sender: CallSender | None = None):
        """Send ``stream``'s batches as they come (``Stream.next``) until it is finished, fails, the
        client goes away, or the server drains; then close it.

        With a ``sender`` (the socket transport) each batch's payload follows its message on the
        data connection, written once gRPC has taken the message (the client reads the message,
        then the payload: written the other way round, a payload larger than the sockets' buffers
        would wait for a client that waits for its message). The batch's slot is held until then.
        Where the client asked for its messages on the data connection (``sender.messages``),
        each goes there, in front of its payload, and nothing is yielded on the call.
        A data connection that breaks ends the call UNAVAILABLE (the client resumes elsewhere).
        """
        end = _Ending()
        transport = self.loader.transport
        lag = LagLog(stream, self.loader)
        lent = stream.transport == "shm"  # (with a sender: the message alone goes on the data connection)
        try:
            while not self._call_ended(stream, context, control, end):
                waits = stream.ordered or bool(stream.granted)  # a call with nothing granted waits for its client
                if stream.waiting_since is None and waits:
                    stream.waiting_since = time.monotonic()
                try:
                    batch = stream.next(_POLL_S)
                except (SampleError, ShapeMismatchError, WorkerError, ResourceExhaustedError, ValueError, TypeError) as e:
                    end.reason = f"failed: {type(e).__name__}"
                    stream.failed = True
                    abort_with_detail(context, stream.request.dataset, e, self.redact)
                    return
                if transport.abandoned(stream):
                    if batch is not None:
                        stream.release(batch, sent=False)
                    end.reason = "abandoned by the client"
                    return
                if batch is None:
                    if stream.finished:
                        if not stream.completed:  # the client's requests ended without `done`
                            end.reason = "cancelled by the client"
                        return
                    if not context.is_active():
                        end.reason = "cancelled by the client"
                        return
                    if waits:
                        lag.waiting()
                    else:
                        stream.waiting_since = None
                    continue
                lag.got_batch(batch.batch_index)
                data = self._send(stream, batch, context, hold=sender is not None and not lent)
                if data is None:  # the call ended, or the server began draining, while a lease was awaited
                    if self.loader.draining:
                        continue  # the check above ends the call
                    end.reason = "cancelled by the client"
                    return
                stream.bytes_sent += len(data)
                if sender is None:
                    yield data
                elif not (yield from self._send_payload(stream, batch, data, sender, context, end, lent)):
                    return
        finally:
            self.loader.close_stream(stream, end.reason)

    def _call_ended(self, stream: Stream, context: grpc.ServicerContext, control: CallControl | None,
                    end: _Ending) -> bool:
        """Whether the call ends before its next batch: the server drains (aborts UNAVAILABLE), a
        control message was refused (aborts INVALID_ARGUMENT, or RESOURCE_EXHAUSTED past
        max_grants), the data connection that carried the client's grants closed (aborts
        UNAVAILABLE: the client resumes), or the client went away (True); ``end.reason`` says which."""
        if self.loader.draining:
            end.reason = "ended: the server is shutting down"
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"the server is shutting down; reconnect to resume at batch {stream.next_index}"
                          if stream.ordered else
                          "the server is shutting down; grant the batches not received to another server")
        if control is not None and control.error is not None:
            e = control.error
            if isinstance(e, ConnectionError):  # the client's data connection closed under the call
                end.reason = "ended: the client's data connection closed"
                context.abort(grpc.StatusCode.UNAVAILABLE, f"{e}; reconnect to resume")
            end.reason = f"failed: {type(e).__name__} in a control message"
            stream.failed = True
            code = (grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, ResourceExhaustedError)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, self.redact(str(e)))
        if control is not None and control.gone:
            end.reason = "cancelled by the client"
            return True
        return False

    def _send_payload(self, stream: Stream, batch, data: bytes, sender: CallSender, context: grpc.ServicerContext,
                      end: _Ending, lent: bool = False):
        """Yield the batch's message ``data``, then write its payload on the call's data connection
        (once gRPC has taken the message), or write both there (``sender.messages``: the
        message in band, nothing yielded), and let go of the batch. ``lent``: a shared-memory
        call's batch, lent already (``_send`` let go of it): its message alone goes in band, no
        payload. Returns False if the call ends (``end.reason`` says why); a connection that
        broke while the client is still there ends the call UNAVAILABLE (the client resumes
        elsewhere)."""
        sent = False
        try:
            if not sender.messages:
                yield data
            pieces, length = ((), 0) if lent else socket_payload(batch)
            stream.data_bytes_sent += sender.send(batch.batch_index, batch.slot, pieces, length,
                                                  message=data if sender.messages else None)
            if sender.messages:
                self.loader.count("data_messages", 1)
            sent = True
        except ConnectionAbortedError:
            end.reason = "cancelled by the client"
            return False
        except ConnectionError as e:
            if not context.is_active():
                end.reason = "cancelled by the client"
                return False
            end.reason = "ended: its data connection broke"
            context.abort(grpc.StatusCode.UNAVAILABLE, f"the data connection of this call broke: {e}")
        finally:
            if not lent:
                stream.release(batch, sent=sent)
                if stream.ordered:  # the server grants its next batch: work for the pool
                    self.loader.pool.wake(WAKE_STREAM)
        return True

    def _send(self, stream, batch, context: grpc.ServicerContext, hold: bool = False) -> bytes | None:
        """Serialize ``batch`` for the client (lent, inline or its payload's place: ``Transport.encode``),
        then let go of it (``hold``: the caller does, once the payload is sent, if this returned bytes).

        At the session's lease cap, waits up to ``LEASE_WAIT_S`` for a lease to come back; None if
        the call ended (or the server began draining) meanwhile.
        """
        patient_until = time.monotonic() + LEASE_WAIT_S
        data = None
        stream.send_started = time.perf_counter()  # the batch's send_seconds count from here (Transport)
        try:
            while data is None:
                data = self.loader.transport.encode(stream, batch, patient=time.monotonic() < patient_until)
                if data is None and (not context.is_active() or self.loader.draining):
                    return None
            return data
        finally:
            if data is None or not hold:
                stream.release(batch, sent=data is not None)
                if stream.ordered:  # the server grants its next batch (a Batches call's grants wake the pool)
                    self.loader.pool.wake(WAKE_STREAM)
