"""A data connection, server side: writing one batch's bytes on it (``DataConnection.send``),
and a Batches call's side of the data plane (``CallSender``: its token, then its connection).

``DataConnection.send`` writes one batch: the 24-byte header (and, for a call whose client asked
for its messages in band, the serialized ``Batch`` message: ``datawire.MESSAGE_MAGIC``), then its
tensors at the payload offsets ``batchd.datawire.payload_layout`` chose, zeros between them:
large tensors straight from the mapped slot (``send``: the kernel copies them into the socket
buffer, off the GIL), the header, message, small tensors and padding gathered into one
``send``, the whole batch under
``TCP_CORK``; with TLS through ``SSLSocket.write`` (encryption here, off the GIL too), which
raises once the TLS object is gone instead of sending in clear (``batchd.sockets``). Not
``os.sendfile`` from the slot's ``/dev/shm`` file: TCP's sendfile hands the file's pages to the
socket by reference, so a slot reused once the send returned changed bytes not yet read by the
client (over loopback every batch: tests/serve/test_dataplane_server.py), and it measured dearer
than ``send`` here (0.15-0.17 against 0.09-0.11 s of CPU per GB, loopback, 9.6 MB batches).

``DataConnection.read_control`` reads the client's control frames (grants, revokes, progress; the
format in ``batchd.datawire``) on a thread of its own, beside the call's sends: plain TCP only
(two threads on one ``SSLSocket`` is not allowed), so the server offers it only without TLS.

Never hang: the socket's operations time out in slices (``dataplane.SLICE_S``); a send that
cannot progress asks ``cancelled()`` (the call's ``not context.is_active()``) each slice and
raises ConnectionAbortedError once it says so, however long a client that stopped reading holds
it (a paused training loop: its call is alive, so the send waits). The plane closing
(``DataConnection.abort``: a shutdown at the kernel) makes a blocked send return with an error
at once.
"""

from __future__ import annotations

import socket
import ssl
import threading
from typing import TYPE_CHECKING, Any, Callable, Sequence

from batchd import datawire, sockets
from batchd.server.shm import Segment

if TYPE_CHECKING:
    from batchd.server.serve.dataplane import DataPlane

GATHER_MAX = 64 * 1024  # tensors smaller than this are gathered with the header into one send
CHUNK = 4 << 20  # bytes per send call: a stalled send is retried from a known place


def _never() -> bool:
    return False


class DataConnection:
    """One authenticated data connection, owned by the call whose token it presented.

    ``send`` runs in the call's thread only; ``abort`` (the plane closing) and ``close`` may
    come from any thread.
    """

    def __init__(self, sock: socket.socket, peer: str, plane: "DataPlane"):
        self._sock = sock
        self.peer = peer
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._plane = plane
        self._lock = threading.Lock()
        self._closed = False
        self.bytes_sent = 0

    def send(self, batch_index: int, slot: Segment, pieces: Sequence[datawire.Piece], length: int,
             cancelled: Callable[[], bool] = _never, message: bytes | None = None) -> int:
        """Write batch ``batch_index``: its header, its serialized ``Batch`` ``message`` if given
        (in band: ``datawire.MESSAGE_MAGIC``), then ``length`` payload bytes, each piece's
        ``nbytes`` from ``slot`` at ``source`` put at ``offset`` (``datawire.payload_layout``).
        When it returns, the bytes are in the kernel's socket buffer (copied): the slot may be
        reused at once. Returns the bytes written.

        Raises ConnectionError (BrokenPipeError, ConnectionResetError...) if the client went
        away or the plane was closed, ConnectionAbortedError once ``cancelled()`` is true while
        the send waits for the client to read, ValueError if the pieces do not fit ``length``.
        """
        out = bytearray(datawire.pack_header(batch_index, length, None if message is None else len(message)))
        if message is not None:
            out += message
        total = len(out) + length
        at = 0
        cork = bool(pieces)  # (a message alone, a lent batch's, is one send: nothing to hold back)
        if cork:
            self._cork(True)
        try:
            for piece in pieces:
                if piece.offset < at:
                    raise ValueError(f"piece at {piece.offset} overlaps the one before (ending at {at})")
                out += bytes(piece.offset - at)  # padding: zeros, never the rest of the slot
                at = piece.offset + piece.nbytes
                data = slot.buf[piece.source : piece.source + piece.nbytes]
                if piece.nbytes < GATHER_MAX:
                    out += data
                    continue
                self._send_bytes(out, cancelled)
                out = bytearray()
                self._send_bytes(data, cancelled)
            if at != length:
                raise ValueError(f"pieces end at byte {at}, not at the payload length {length}")
            self._send_bytes(out, cancelled)
        except OSError as e:
            if self._closed and not isinstance(e, ConnectionError):
                raise ConnectionAbortedError(f"data connection to {self.peer} closed") from None
            raise
        finally:
            if cork:
                self._cork(False)
        self.bytes_sent += total
        self._plane._sent(total)
        return total

    def read_control(self, control: Any) -> None:
        """Read control frames until the connection closes (the call ended, the client went away)
        and hand each message to ``control.apply_frame`` (``CallControl``), which returns False
        once the call is ending. A frame with a wrong magic or a length past
        ``datawire.MAX_CONTROL`` goes to ``control.fail`` (the call ends with it), and so does the
        client's end closing first (ConnectionError: grants sent on it may be lost, so the call
        ends UNAVAILABLE and the client resumes it). Runs on a
        thread of its own; waits for frames as long as the connection lives (a training loop may
        pause), looking at ``close`` every timeout slice."""
        buf, size = bytearray(), datawire.CONTROL.size
        chunk = bytearray(64 * 1024)
        while True:
            n = self._recv(chunk)
            if not n:
                break
            buf += memoryview(chunk)[:n]
            at = 0
            while len(buf) - at >= size:  # every whole frame received (one recv may bring several)
                magic, length = datawire.CONTROL.unpack_from(buf, at)
                if magic != datawire.CONTROL_MAGIC or length > datawire.MAX_CONTROL:
                    control.fail(ValueError(f"Batches: the data connection from {self.peer} sent a control frame "
                                            f"with magic {bytes(magic)!r} and length {length} (expected "
                                            f"{datawire.CONTROL_MAGIC!r}, at most {datawire.MAX_CONTROL} bytes)"))
                    return
                if len(buf) - at - size < length:
                    break
                if not control.apply_frame(bytes(buf[at + size:at + size + length])):
                    return
                at += size + length
            del buf[:at]
        if not self._closed:  # the client's end closed or broke (a dead relay): grants may be lost with it
            control.fail(ConnectionError(f"the data connection from {self.peer} closed"))

    def _recv(self, chunk: bytearray) -> int:
        """Bytes read into ``chunk`` (waiting as long as it takes); 0 once the connection closed or broke."""
        while True:
            try:
                return self._sock.recv_into(chunk)
            except (TimeoutError, BlockingIOError):
                if self._closed:
                    return 0
            except OSError:
                return 0

    def _cork(self, on: bool) -> None:
        """TCP_CORK: the header and small tensors leave in full segments with the large ones."""
        if hasattr(socket, "TCP_CORK") and not self._closed:
            try:
                self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CORK, int(on))
            except OSError:
                pass

    def _check(self, cancelled: Callable[[], bool]) -> None:
        if self._closed:
            raise ConnectionAbortedError(f"data connection to {self.peer} closed")
        if cancelled():
            raise ConnectionAbortedError(f"the call of the data connection to {self.peer} ended")

    def _send_bytes(self, data, cancelled: Callable[[], bool]) -> None:
        view = memoryview(data).cast("B")
        sent, total = 0, len(view)
        while sent < total:
            try:
                n = sockets.send(self._sock, view[sent : sent + CHUNK])  # (TLS: encrypted, or an error)
            except (TimeoutError, BlockingIOError, ssl.SSLWantWriteError):
                n = 0
            if n:
                sent += n
            else:
                self._check(cancelled)

    def abort(self) -> None:
        """Make a send in another thread fail at once (the plane closes); ``close`` follows there.
        The socket is shut down at the kernel, never through its TLS object (``batchd.sockets``:
        ``SSLSocket.shutdown`` from another thread let a racing send go out in clear)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets.shutdown(self._sock)  # (under the lock: ``close`` cannot free the descriptor meanwhile)

    def close(self) -> None:
        """Close the connection (the client sees the end of its data stream): from the call's
        thread, or once no send runs. Idempotent."""
        self.abort()
        self._plane._forget(self)
        with self._lock:
            try:
                self._sock.close()
            except OSError:
                pass


class CallSender:
    """One Batches call's side of the data plane: its one-time token (``metadata``, for the call's
    initial metadata), then the connection that presented it, which every batch's payload goes
    on (``send``), in the order of the call's messages.

    cancelled(): whether the call ended (``not context.is_active()``): a wait for the client's
    connection, or a send to a client that stopped reading, ends then. control: the call's
    ``CallControl``, to read the client's control frames on the connection into (plain TCP
    only: offered in ``metadata`` then), or None. messages: the client asked for its Batch
    messages on the connection (``StreamBatchesRequest.data_messages``): offered in
    ``metadata``, and each ``send`` then carries its message. Raises ConnectionAbortedError if
    the plane is closed.
    """

    def __init__(self, plane: DataPlane, cancelled: Callable[[], bool], control: Any = None, messages: bool = False):
        self.controls = control is not None and not plane.tls
        self.messages = messages
        self.ticket = plane.expect(control if self.controls else None)
        self.port = plane.port
        self._cancelled = cancelled
        self._connection: DataConnection | None = None

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """``batchd-data-port``, ``batchd-data-token`` and, where control frames are read,
        ``batchd-data-control``; where Batch messages go on it, ``batchd-data-messages``
        (``batchd.datawire.metadata``)."""
        return datawire.metadata(self.port, self.ticket.token, control=self.controls, messages=self.messages)

    def send(self, batch_index: int, slot: Segment, pieces: Sequence[datawire.Piece], length: int,
             message: bytes | None = None) -> int:
        """Write one batch's payload, after its ``message`` if given (``DataConnection.send``),
        first waiting for the client's connection (``Ticket.wait``); returns the bytes written
        (header and message included). Raises
        ConnectionError (the client did not connect in time, or went away),
        ConnectionAbortedError (the call ended, the plane closed)."""
        if self._connection is None:
            self._connection = self.ticket.wait(self._cancelled)
        return self._connection.send(batch_index, slot, pieces, length, self._cancelled, message)

    def close(self) -> None:
        """The call ended: withdraw the token, close the connection (the client reads its end)."""
        self.ticket.close()
        if self._connection is not None:
            self._connection.close()
