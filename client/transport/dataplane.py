"""The data plane, client side: the connection that brings one ``Batches`` call's batch bytes
(``TRANSPORT_SOCKET``; docs/design/network-path.md, the format in ``batchd.datawire``).

``DataSocket.receive`` reads the 24-byte header and the payload with ``socket.recv_into``
straight into a buffer of a ``BufferPool`` (client/transport/buffers.py): the kernel copies each
byte once, into that buffer, and the wait releases the GIL (with TLS, the decryption runs here
too, also off the GIL). ``receive_next`` reads an in-band frame (the call's Batch messages on
the connection too) whole. ``DataLink`` is what one server's ``Batches`` calls share to do this.

Never hang: every read waits at most ``SLICE_S`` before looking at ``stopping``, and a silent
connection is a broken one. Every failure is a ConnectionError naming the server: a broken data
connection is a broken call, resumed as one.

Control frames (the call's grants and revokes, ``batchd.datawire``) are written from the thread
that grants, so only on a plain TCP connection (``controls``): one ``SSLSocket`` must not be read
and written by two threads.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import ssl
import threading
import time
from typing import Any, Callable

from batchd import datawire, errors, sockets, wire
from batchd.client import forks
from batchd.client.transport import addresses, buffers, fields, redial
from batchd.client.transport.channel import TLS

log = logging.getLogger("batchd.client.loader")
SLICE_S = 0.25  # a blocked read looks at ``stopping`` this often
ENDED_GRACE_S = 10.0  # seconds without a byte, once the call is over, before a frame's wait gives up


def data_host(address: str) -> str | None:
    """The host of a ``HOST:PORT``, ``[IPv6]:PORT`` or ``dns:///HOST:PORT`` address (brackets
    removed), where the server's data port is dialed; None for a ``unix:`` address or a form
    without one host."""
    parts = addresses._split_host_port(address)
    return None if parts is None else parts[0].strip("[]")


def client_tls_context(tls: TLS) -> ssl.SSLContext:
    """A TLS context as the gRPC channel's: ``tls.ca`` (None: the system's roots) verifies the
    server, ``tls.cert`` / ``tls.key`` is presented if given. TLS 1.2 at least. Raises
    ValueError naming a file that cannot be read."""
    try:
        ctx = ssl.create_default_context(cafile=str(tls.ca) if tls.ca is not None else None)
        if tls.cert is not None:
            ctx.load_cert_chain(str(tls.cert), str(tls.key))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"cannot load the TLS files for the data connection: {e}") from None
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


class BaseSocket:
    """What both forms of a call's data connection (``DataSocket``; ``relayed_socket.RelayedSocket``,
    held by the relay) share: their state, ``close``, and the errors they raise.

    address: the server's gRPC address (named in errors). timeout: seconds without a byte after
    which a receive fails. max_message: bytes an in-band Batch message may have (the loader's
    maximum, at most ``datawire.MAX_MESSAGE``). controls: control frames may be written here
    (plain TCP only: module docstring). first_byte: whether the server sent any byte yet (a
    connection closed or reset before it was refused: ``batchd.client.transport.redial``).
    last_received: bytes of the last batch received (header included).
    """

    def __init__(self, sock: socket.socket, address: str, timeout: float, max_message: int, tls: bool):
        self._sock, self.address, self.timeout = sock, address, timeout
        self.max_message = min(max_message, datawire.MAX_MESSAGE)
        self.controls = not tls
        self.first_byte = False
        self.last_received = 0
        self._lock = threading.Lock()
        self._closed = False
        self._owner = forks.owner()

    def close(self) -> None:
        """Close the connection, from any thread (a ``receive`` in another thread fails at once).
        Idempotent; nothing in a forked child (its socket is the parent's). The socket is shut down
        at the kernel first, never through its TLS object (``batchd.sockets``: ``SSLSocket.shutdown``
        from another thread let a racing read take the raw TLS records as batch bytes)."""
        if forks.forked(self._owner):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets.shutdown(self._sock)  # (under the lock: nothing closes the descriptor meanwhile)
        self._sock.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _check_controls(self) -> None:
        """Raises OSError unless control frames may be written now."""
        if self._closed or not self.controls:
            raise OSError("the data connection is closed" if self._closed else "no control frames over TLS")

    def _closed_error(self) -> ConnectionAbortedError:
        return ConnectionAbortedError(f"the data connection to {self.address} was closed")

    def _stopped(self, stopping: threading.Event | None) -> ConnectionAbortedError | None:
        """The error of a read to abandon (``stopping`` set, or the connection closed), or None."""
        if stopping is not None and stopping.is_set():
            return ConnectionAbortedError(f"stopped reading from {self.address}")
        return self._closed_error() if self._closed else None

    def _framed(self, batch: wire.WireBatch, buf, length: int, pool: buffers.BufferPool) -> wire.WireBatch:
        """``batch``, an in-band frame's, with its fields as views of ``buf``'s first ``length``
        bytes (``buffers.tensors``). Raises ConnectionError for a malformed field: this connection
        sent it (the buffer then went back to ``pool``)."""
        try:
            return dataclasses.replace(batch, payload=buffers.tensors(batch, buf, length, pool.give_back))
        except ValueError as e:
            raise errors.ConnectionError(f"the data connection of the batchd server at {self.address} sent "
                                         f"batch {batch.batch_index} malformed: {e}") from None


class DataSocket(BaseSocket):
    """The client end of one call's data connection (``BaseSocket``), received in this process.
    ``receive`` runs in one thread (the call's receiver); ``close`` from any."""

    def __init__(self, sock: socket.socket, address: str, timeout: float, max_message: int = datawire.MAX_MESSAGE):
        self.tls = isinstance(sock, ssl.SSLSocket)
        super().__init__(sock, address, timeout, max_message, self.tls)
        self._header = bytearray(datawire.HEADER.size)

    @classmethod
    def connect(cls, address: str, port: int, token: bytes, *, tls: TLS | None = None,
                connect_timeout: float = 10.0, timeout: float = 60.0,
                max_message: int = datawire.MAX_MESSAGE) -> "DataSocket":
        """Dial ``port`` on ``address``'s host, TLS if ``tls``, and present ``token``, all within
        ``connect_timeout`` seconds. Raises ConnectionError naming the server if it cannot be
        reached or the TLS handshake fails (ValueError if a TLS file cannot be read)."""
        host = data_host(address)
        if host is None:
            raise errors.ConnectionError(f"{address} has no host to open a data connection to")
        ctx = client_tls_context(tls) if tls is not None else None
        where = f"the data port {port} of the batchd server at {address}"
        try:
            raw = socket.create_connection((host, port), timeout=connect_timeout)
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a control frame leaves at once (no Nagle)
        except OSError as e:
            raise errors.ConnectionError(f"cannot connect to {where}: {e.strerror or e}") from None
        sock = raw
        try:
            if ctx is not None:
                sock = ctx.wrap_socket(raw, server_hostname=tls.server_name or host)
            sock.sendall(token)
        except (OSError, ssl.SSLError) as e:
            sock.close()
            raw.close()
            raise errors.ConnectionError(f"cannot open a data connection to {where}: {e}") from None
        sock.settimeout(SLICE_S)
        return cls(sock, address, timeout, max_message)

    def receive(self, batch: wire.WireBatch, pool: buffers.BufferPool,
                stopping: threading.Event | None = None) -> dict[str, fields.Field]:
        """The payload of ``batch`` (the call's next message), received into a buffer of ``pool``:
        the batch's fields as views of it (the buffer goes back to ``pool`` when they are freed).

        Raises ConnectionError naming the server for a header that is not ``batch``'s (magic,
        batch index, length), a closed or silent connection; ValueError for a malformed tensor
        in ``batch``; ConnectionAbortedError once ``stopping`` is set.
        """
        length = buffers.payload_length(batch)
        self._read_into(memoryview(self._header), stopping)
        magic, index, sent = datawire.unpack_header(self._header)
        if magic != datawire.MAGIC or index != batch.batch_index or sent != length:
            raise errors.ConnectionError(
                f"the data connection of the batchd server at {self.address} sent a header for batch {index} of "
                f"{sent} bytes (magic {bytes(magic)!r}) where batch {batch.batch_index} of {length} bytes "
                f"(magic {datawire.MAGIC!r}) was due")
        payload = buffers.tensors(batch, self._payload(batch, length, pool, stopping), length, pool.give_back)
        self.last_received = datawire.HEADER.size + length
        return payload

    def receive_next(self, pool: buffers.BufferPool, stopping: threading.Event | None = None,
                     ended: Callable[[], bool] | None = None, lent: bool = False) -> tuple[wire.WireBatch, int] | None:
        """The next batch of a call whose Batch messages come on this connection
        (``datawire.MESSAGE_MAGIC``), its payload received into a buffer of ``pool``
        (``WireBatch.payload``), and the bytes read for it; None once the server closed the
        connection between two batches (the call's status says how it ended). ``lent``: a
        shared-memory call's connection, whose frames carry no payload (``datawire``).

        Waits for the next header as long as the call lasts, then (``ended()``) until the shorter
        of ``ENDED_GRACE_S`` and ``timeout`` passes without a byte: a server whose host vanished
        sends no close. Raises ConnectionError naming the server for a malformed frame (its
        header, message or payload length), a connection that closed, broke or went silent for
        ``timeout`` seconds inside one; ConnectionAbortedError once ``stopping`` is set or the
        connection closed.
        """
        if not self._read_into(memoryview(self._header), stopping, ended):
            return None
        magic, size, index, length = datawire.unpack_frame(self._header)
        if magic != datawire.MESSAGE_MAGIC or size > self.max_message:
            raise errors.ConnectionError(
                f"the data connection of the batchd server at {self.address} sent a header with magic "
                f"{bytes(magic)!r} and a message of {size} bytes where a frame (magic {datawire.MESSAGE_MAGIC!r}, "
                f"a message of at most {self.max_message} bytes) was due")
        message = bytearray(size)
        self._read_into(memoryview(message), stopping)
        batch = framed_batch(bytes(message), index, length, self.address, lent)  # (its tensors end at ``length``)
        if not lent:
            batch = self._framed(batch, self._payload(batch, length, pool, stopping), length, pool)
        self.last_received = datawire.HEADER.size + size + length
        return batch, self.last_received

    def _payload(self, batch: wire.WireBatch, length: int, pool: buffers.BufferPool,
                 stopping: threading.Event | None):
        """A buffer of ``pool`` with ``batch``'s ``length`` payload bytes read into it (``take``)."""
        buf = take(pool, length, self.address, f"batch {batch.batch_index}")
        try:
            self._read_into(memoryview(buf.numpy())[:length], stopping)
        except BaseException:
            pool.give_back(buf)
            raise
        return buf

    def send_control(self, frame: bytes) -> None:
        """Write whole control frames (``batchd.datawire.pack_control``); one writer at a time (the
        call's ``Outbox`` holds its lock). Raises OSError (TimeoutError after ``SLICE_S`` seconds
        without room) if it cannot; the connection is then closed (part of a frame may have gone:
        the server must not read on from there), so the call breaks and is resumed."""
        self._check_controls()
        try:
            self._sock.sendall(frame)
        except OSError:
            self.close()
            raise

    def _read_into(self, view: memoryview, stopping: threading.Event | None,
                   ended: Callable[[], bool] | None = None) -> bool:
        """Fill ``view``; True. With ``ended`` (a frame's header), waits for the first byte as
        ``receive_next`` says, and returns False if the connection closes before it."""
        got, total = 0, len(view)
        last = time.monotonic()
        while got < total:
            try:
                n = sockets.recv_into(self._sock, view[got:])  # (TLS: decrypted, or an error)
            except (TimeoutError, BlockingIOError, ssl.SSLWantReadError):
                if (stopped := self._stopped(stopping)) is not None:
                    raise stopped from None
                limit = self.timeout
                if ended is not None and not got:
                    if not ended():
                        last = time.monotonic()  # between batches while the call lasts: no limit
                        continue
                    limit = min(limit, ENDED_GRACE_S)
                if time.monotonic() - last > limit:
                    raise errors.ConnectionError(f"the data connection of the batchd server at {self.address} brought "
                                                 f"no byte for {limit:g} s"
                                                 f"{' after its call ended' if limit < self.timeout else ''}") from None
                continue
            except (OSError, ssl.SSLError) as e:
                if self._closed:
                    raise self._closed_error() from None
                raise errors.ConnectionError(f"the data connection of the batchd server at {self.address} broke: "
                                             f"{e.strerror if isinstance(e, OSError) and e.strerror else e}") from None
            if not n:
                if self._closed:
                    raise self._closed_error()
                if ended is not None and not got:
                    return False  # the server closed it between two batches
                raise errors.ConnectionError(f"the batchd server at {self.address} closed its data connection "
                                             f"({got} of {total} bytes read)")
            got += n
            self.first_byte = True
            last = time.monotonic()
        return True


class DataLink:
    """How one server's Batches calls open and read their data connections (a ``ServerConnection``
    has one).

    address: the server's gRPC address (its host is dialed). tls: the loader's TLS settings (None:
    plain). pool: the buffers payloads are received into (pinned when the loader copies to CUDA).
    connect_timeout, timeout: seconds (``DataSocket.connect``, ``DataSocket.receive``).
    max_message: bytes an in-band Batch message may have (the loader's ``max_message_bytes``).
    relay: the process that holds the connections and receives into ``pool``'s buffers
    (client/transport/relay.py), or None: this process receives. optional: the loader chose the
    data plane itself (``transport="auto"``): a data port it cannot use (unreachable: a firewall,
    a Service that forwards only the gRPC port; or refusing every dial,
    ``batchd.client.transport.redial``) sends the server's calls inline from then on
    (``_unusable``). ``lent``: the link of shared-memory calls, whose connections bring
    Batch messages only (their bytes stay in shared memory, ``datawire``): unreachable, their
    messages come on the calls from then on (said at info: nothing is copied either way).
    """

    def __init__(self, address: str, tls: TLS | None, pool: buffers.BufferPool, *, connect_timeout: float,
                 timeout: float, optional: bool = True, relay: Any = None, max_message: int = datawire.MAX_MESSAGE,
                 lent: bool = False):
        self.address, self.tls, self.pool, self.lent, self.optional = address, tls, pool, lent, optional
        self.connect_timeout, self.timeout, self.max_message = connect_timeout, timeout, max_message
        self.relay = relay  # a batchd.client.transport.relay.Relay holds the connections (pool: its RelayBuffers), or None
        self.reachable = True

    @property
    def possible(self) -> bool:
        """Whether this address has a host to dial (not a ``unix:`` socket)."""
        return data_host(self.address) is not None

    def connect(self, metadata: Any, ended: Callable[[], bool] = lambda: False) -> redial.RedialingSocket | None:
        """The data connection a call's initial ``metadata`` offers (``batchd.datawire.offered``),
        dialed again while the server sends nothing on it and the call lasts (``ended()``: it is
        over); None when it offers none (the server answers inline). Raises ConnectionError
        (``redial.FellBack`` where the loader falls back to inline)."""
        offer = datawire.offered(metadata)
        if offer is None:
            return None
        port, token = offer
        return redial.RedialingSocket(lambda: self._dial(port, token), ended, lambda e: self._unusable(e, port),
                                      where=f"the data port {port} of the batchd server at {self.address}",
                                      window=min(redial.WINDOW_S, self.connect_timeout))

    def _dial(self, port: int, token: bytes) -> DataSocket:
        if self.relay is not None:
            return self.relay.open(self.address, data_host(self.address), port, token, tls=self.tls,
                                   connect_timeout=self.connect_timeout, timeout=self.timeout,
                                   max_message=self.max_message)
        return DataSocket.connect(self.address, port, token, tls=self.tls, connect_timeout=self.connect_timeout,
                                  timeout=self.timeout, max_message=self.max_message)

    def _unusable(self, e: ConnectionError, port: int) -> ConnectionError:
        """The error of a data port that could not be used (``e``, after the redials): with
        ``optional``, the first time, a warning and ``FellBack`` (calls go inline from now on;
        the loader counts it: ``stats()["data_plane_fallbacks"]``); else ``e``, a broken call."""
        if not (self.optional and self.reachable):
            return e
        self.reachable = False
        if self.lent:
            log.info("%s; the Batch messages of shared-memory batches from %s come on the gRPC calls from now on",
                     e, self.address)
            return redial.FellBack(f"{e}; falling back to Batch messages on the call")
        log.warning("%s; batches from %s come inside the gRPC messages from now on (open the server's data "
                    "port %d to this client, or set transport='inline')", e, self.address, port)
        return redial.FellBack(f"{e}; falling back to batches inside the gRPC messages")

    def receive(self, ds: redial.RedialingSocket, batch: wire.WireBatch) -> wire.WireBatch:
        """``batch`` (its call's next message) with its ``payload``: the fields received on ``ds``."""
        return dataclasses.replace(batch, payload=ds.read(lambda sock: sock.receive(batch, self.pool)))

    def receive_next(self, ds: redial.RedialingSocket,
                     ended: Callable[[], bool]) -> tuple[wire.WireBatch, int] | None:
        """The next batch of a call whose messages come on ``ds`` (``DataSocket.receive_next``; a
        relayed socket never serves a lent call, so only a DataSocket is told ``lent``)."""
        if self.lent:
            return ds.read(lambda sock: sock.receive_next(self.pool, ended=ended, lent=True))
        return ds.read(lambda sock: sock.receive_next(self.pool, ended=ended))


def take(pool: buffers.BufferPool, nbytes: int, address: str, what: str):
    """A buffer of ``pool`` for ``nbytes`` bytes of ``what`` from the server at ``address``.
    Raises ConnectionError if none can be had (a length past memory, or past what a file may
    hold): a data connection's error, which breaks its call (resumed), never the iteration."""
    try:
        return pool.take(nbytes)
    except (MemoryError, OverflowError, OSError, RuntimeError, ValueError) as e:
        raise errors.ConnectionError(f"cannot take a buffer of {nbytes} bytes for {what} from the batchd server at "
                                     f"{address}: {type(e).__name__}: {e}") from None


def framed_batch(message: bytes, index: int, length: int, address: str, lent: bool = False) -> wire.WireBatch:
    """The ``Batch`` of an in-band frame whose header named batch ``index`` and ``length`` payload
    bytes (``lent``: a shared-memory call's frame, which has none). Raises ConnectionError naming
    the server at ``address`` if it does not parse or does not match the header."""
    try:
        batch = wire.decode_batch(message)
        expected = 0 if lent else buffers.payload_length(batch)
    except ValueError as e:
        raise errors.ConnectionError(f"the data connection of the batchd server at {address} sent a Batch message "
                                     f"that does not parse: {e}") from None
    if batch.batch_index != index or expected != length:
        raise errors.ConnectionError(
            f"the data connection of the batchd server at {address} sent a header for batch {index} of {length} "
            f"bytes before the message of batch {batch.batch_index} of {expected} bytes")
    return batch
