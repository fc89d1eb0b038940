"""One data connection held by the receive relay, seen from the trainer: ``RelayedSocket``, with
``DataSocket``'s interface (client/transport/dataplane.py).

The relay process and its buffers are client/transport/relay.py's (``Relay.open`` has the relay
dial a connection and returns this); the messages on the pair (``R``, ``N``, ``P``, ``C`` and
their answers) are specified in client/transport/relay_child.py. The header's checks and the
``timeout`` run in the relay, and its errors come back with their text.

Failure: a relay that dies closes the pair without an answer (``_Gone``: the buffer goes back,
the relay writes no more); a receive abandoned mid-read (``stopping``, a timeout) discards its
buffer, which the relay may still be writing: it is never reused.
"""

from __future__ import annotations

import array
import socket
import threading
import time
from typing import TYPE_CHECKING, Callable

from batchd import datawire, errors, wire
from batchd.client.transport import buffers, dataplane, fields
from batchd.client.transport.relay_child import DONE, FRAME, MAX_MESSAGE, REQUEST

if TYPE_CHECKING:
    from batchd.client.transport.relay import Relay


class _Gone(errors.ConnectionError):
    """The relay closed this connection without an answer: it died, so it writes no more."""


def send_with_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    """Send ``data`` on ``sock`` (an AF_UNIX socket) with the descriptor ``fd`` (SCM_RIGHTS)."""
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


class RelayedSocket(dataplane.BaseSocket):
    """One data connection held by the relay (``dataplane.BaseSocket``), with ``DataSocket``'s
    interface: ``receive`` runs in one thread (the call's receiver), ``close`` from any (closing the
    pair: the relay then closes the server's connection)."""

    def __init__(self, pair: socket.socket, address: str, timeout: float, relay: Relay, pid: int, tls: bool,
                 max_message: int = datawire.MAX_MESSAGE):
        pair.settimeout(dataplane.SLICE_S)  # a blocked wait looks at ``stopping`` and at the relay this often
        super().__init__(pair, address, timeout, max_message, tls)
        self._relay, self.pid = relay, pid
        self._sent: set[int] = set()  # buffer ids whose fd the relay has for this connection
        self._frame_bytes = 0  # the last in-band frame's payload and message: the next one's buffer

    def receive(self, batch: wire.WireBatch, pool: buffers.BufferPool,
                stopping: threading.Event | None = None) -> dict[str, fields.Field]:
        """As ``DataSocket.receive``: the payload of ``batch`` in a buffer of ``pool`` (made by the
        relay's ``RelayBuffers``), the batch's fields as views of it. Raises ConnectionError
        (the relay's check of the header, a closed or silent connection, the relay gone, a
        buffer that cannot be had), ConnectionAbortedError once ``stopping`` is set or the socket
        closed, ValueError for a malformed tensor."""
        length = buffers.payload_length(batch)
        what = f"batch {batch.batch_index}"
        buf = dataplane.take(pool, length, self.address, what)
        reply = self._exchange(b"R", buf, pool, batch.batch_index, length, what, stopping)
        if reply[:1] != b"D":
            pool.give_back(buf)  # the relay sent its error and wrote no more
            raise self.error(reply)
        DONE.unpack(reply)
        self.first_byte = True
        self.last_received = datawire.HEADER.size + length
        return buffers.tensors(batch, buf, length, pool.give_back)

    def receive_next(self, pool: buffers.BufferPool, stopping: threading.Event | None = None,
                     ended: Callable[[], bool] | None = None) -> tuple[wire.WireBatch, int] | None:
        """As ``DataSocket.receive_next``, read by the relay into a buffer of ``pool`` sized as the
        last frame (``N``). The message of a frame that does not fit (``S``) is checked
        (``_message``, ``dataplane.framed_batch``) before a larger buffer is taken (``P``). Raises
        as ``receive`` (ConnectionError for a malformed frame too)."""
        buf = dataplane.take(pool, self._frame_bytes, self.address, "the next batch")
        reply = self._exchange(b"N", buf, pool, 0, 0, "the next batch", stopping, ended)
        if reply[:1] == b"S":
            pool.give_back(buf)  # (not written: the relay keeps the frame's message until P)
            _, mlen, index, length = FRAME.unpack(reply)
            self.first_byte = True
            message = self._message(mlen, stopping, f"receiving the next batch from {self.address}")
            dataplane.framed_batch(message, index, length, self.address)
            buf = dataplane.take(pool, length + mlen, self.address, f"batch {index}")
            reply = self._exchange(b"P", buf, pool, 0, 0, "the next batch", stopping)
        if reply[:1] != b"M":
            pool.give_back(buf)
            if reply[:1] == b"F":
                return None
            raise self.error(reply)
        self.first_byte = True
        _, mlen, index, length = FRAME.unpack(reply)
        try:
            batch = dataplane.framed_batch(bytes(buf.numpy()[length:length + mlen]), index, length, self.address)
        except BaseException:
            pool.give_back(buf)
            raise
        self._frame_bytes = length + mlen
        self.last_received = datawire.HEADER.size + mlen + length
        return self._framed(batch, buf, length, pool), self.last_received

    def _exchange(self, op: bytes, buf, pool: buffers.BufferPool, index: int, length: int, what: str,
                  stopping: threading.Event | None, ended: Callable[[], bool] | None = None) -> bytes:
        """The relay's answer to op ``op`` into ``buf`` (``_request``, ``wait``). If none comes,
        ``buf`` goes back to ``pool`` when the relay is gone (it writes no more), else it is
        discarded: the relay may still write it, so it is never reused."""
        try:
            self._request(op, buf, index, length, what)
            return self.wait(stopping, None, f"receiving {what} from {self.address}", ended)
        except _Gone:
            pool.give_back(buf)
            raise
        except BaseException:
            pool.discard(buf)
            raise

    def _message(self, mlen: int, stopping: threading.Event | None, doing: str) -> bytes:
        """The ``mlen`` bytes of a frame's Batch message, as the relay sends them after ``S``."""
        if mlen > self.max_message:
            raise errors.ConnectionError(f"the data connection of the batchd server at {self.address} sent a Batch "
                                         f"message of {mlen} bytes (at most {self.max_message})")
        message = bytearray()
        while len(message) < mlen:
            chunk = self.wait(stopping, None, doing)
            if chunk[:1] != b"m":
                raise self.error(chunk)
            message += memoryview(chunk)[1:]
        if len(message) != mlen:
            raise errors.ConnectionError(f"the receive relay (pid {self.pid}) sent {len(message)} bytes of a "
                                         f"{mlen}-byte Batch message")
        return bytes(message)

    def error(self, reply: bytes) -> ConnectionError:
        """The ConnectionError of the relay's error answer (``E``, or ``X``: the server sent no byte)."""
        if reply[:1] == b"E":
            self.first_byte = True
        elif reply[:1] != b"X":
            return errors.ConnectionError(f"the receive relay (pid {self.pid}) answered {reply[:16]!r} (not an answer "
                                          f"it gives) for the data connection to {self.address}")
        return errors.ConnectionError(reply[1:].decode("utf-8", "replace"))

    def _request(self, op: bytes, buf, index: int, length: int, what: str) -> None:
        """Send op ``op`` (``REQUEST``) naming buffer ``buf`` (its fd the first time on this connection)."""
        buf_id, fd, size = self._relay.buffers.lookup(buf)
        request = REQUEST.pack(op, buf_id, index, length, size)
        try:
            if buf_id in self._sent:
                self._sock.send(request)
            else:
                send_with_fd(self._sock, request, fd)
                self._sent.add(buf_id)
        except OSError:
            if self._closed:
                raise self._closed_error() from None
            raise _Gone(f"the receive relay (pid {self.pid}) is gone (receiving {what} from "
                        f"{self.address}); the next connection starts another") from None

    def send_control(self, frame: bytes) -> None:
        """Have the relay write control frames, whole, on the data connection (one message on the pair:
        atomic beside a ``receive`` in another thread). Raises OSError if it cannot, ValueError
        for a frame longer than the relay reads (the caller sends that one on the call)."""
        self._check_controls()
        if len(frame) + 1 > MAX_MESSAGE:
            raise ValueError(f"a control frame of {len(frame)} bytes: longer than the relay reads ({MAX_MESSAGE})")
        self._sock.send(b"C" + frame)

    def wait(self, stopping: threading.Event | None, limit: float | None, doing: str,
             ended: Callable[[], bool] | None = None) -> bytes:
        """The relay's next message on this connection. Raises ConnectionAbortedError once
        ``stopping`` is set or the socket closed, ConnectionError if the relay ended or nothing
        came for ``limit`` seconds (None: the relay's own timeout, plus a margin). With ``ended``
        (an in-band frame, which may be long in coming), no limit while the call lasts, then
        ``dataplane.ENDED_GRACE_S`` seconds once ``ended()`` says it is over."""
        margin = limit if limit is not None else self.timeout + 10.0
        deadline = time.monotonic() + margin
        while True:
            try:
                data = self._sock.recv(65536)
            except TimeoutError:
                if ended is not None and not ended():
                    deadline = time.monotonic() + dataplane.ENDED_GRACE_S
                if (stopped := self._stopped(stopping)) is not None:
                    self.close()  # (the relay then stops reading)
                    raise stopped from None
                if time.monotonic() > deadline:
                    self.close()
                    raise errors.ConnectionError(f"the receive relay (pid {self.pid}) did not answer in time "
                                                 f"{doing}") from None
                continue
            except OSError:
                data = b""
            if data:
                return data
            if self._closed:
                raise self._closed_error()
            raise _Gone(f"the receive relay (pid {self.pid}) ended {doing}; the next connection starts another")
