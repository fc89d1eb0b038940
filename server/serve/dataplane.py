"""The data plane, server side: a TCP port whose connections carry batch bytes beside ``Batches``
calls (``TRANSPORT_SOCKET``; docs/design/network-path.md, the format in ``batchd.datawire``).

* ``DataPlane`` listens on a port of its own. One thread (server/serve/handshakes.py) accepts
  and reads every pending connection's TLS handshake (when the plane has a context) and then
  exactly ``TOKEN_BYTES`` bytes, without a thread each: the first byte within
  ``first_byte_timeout_s``, all of it within ``handshake_timeout_s``, at most ``max_handshakes``
  pending (``max_handshakes_per_source`` from one address), the oldest evicted beyond.
* ``DataPlane.expect`` registers a one-time token for one call (``secrets.token_bytes``) and
  returns its ``Ticket``; the call hands the token to its client in the initial metadata (over
  the authenticated gRPC channel). A presented token is compared with every pending one in
  constant time (``hmac.compare_digest``, no early exit), and is gone once claimed. A connection
  whose token is unknown, reused or late (accepted more than ``token_ttl_s`` after ``expect``)
  is closed without a byte written: without the call's token, no batch bytes.
* ``Ticket.wait`` gives the call its ``DataConnection``, which writes the call's batches
  (``data_connection.py``). A ticket made with a ``control`` (plain TCP only) also gets a
  thread, started once its connection is claimed, that reads the client's control frames into it
  (``DataConnection.read_control``) until the connection closes.

Never hang: every socket operation has a timeout slice (``SLICE_S``). ``close`` stops the accept
thread (pending connections closed), shuts every connection down at the kernel (a send blocked
on one returns with an error at once; never through its TLS object: ``batchd.sockets``), and
never raises, so that the server goes on to close its loader.

Counters since start (``stats``): bytes sent (header and padding included), connections
authenticated, connections refused (of which evicted and timed out in their handshake).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import socket
import ssl
import threading
import time
from typing import Any, Callable, Sequence

from batchd import datawire
from batchd.server.config import TlsConfig
from batchd.server.serve.data_connection import DataConnection, _never
from batchd.server.serve.handshakes import Handshakes, Limits
from batchd.server.serve.security import _RateLimitedWarning

log = logging.getLogger(__name__)

SLICE_S = 0.25  # every blocking socket call waits at most this long before looking at cancelled / close
BACKLOG = 1024  # connections the kernel completes before the accept thread takes them (capped by somaxconn)


def listen_host(addresses: Sequence[str]) -> str | None:
    """Where the data plane listens: the host of the first TCP address the gRPC server listens on
    (brackets of an IPv6 literal removed); None when it listens on unix: sockets only (its clients
    are on its host and use shared memory)."""
    for address in addresses:
        if not address.startswith("unix:"):
            return address.rpartition(":")[0].strip("[]")
    return None


def tls_context(tls: TlsConfig) -> ssl.SSLContext:
    """The server-side TLS context of the data plane: the gRPC port's certificate and key, and
    its client CA (client certificates verified if presented; required with
    ``require_client_cert``). TLS 1.2 at least. Raises RuntimeError naming an unreadable file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(str(tls.cert), str(tls.key))
        if tls.client_ca is not None:
            ctx.load_verify_locations(cafile=str(tls.client_ca))
            ctx.verify_mode = ssl.CERT_REQUIRED if tls.require_client_cert else ssl.CERT_OPTIONAL
    except (OSError, ssl.SSLError) as e:
        raise RuntimeError(f"data plane: cannot load the TLS files: {e}") from None
    return ctx


class Ticket:
    """One call's one-time token and, once its client presented it, that client's connection."""

    def __init__(self, plane: "DataPlane", token: bytes, deadline: float, control: Any = None):
        self.token = token
        self.control = control  # the call's CallControl: its connection's control frames go there
        self.deadline = deadline  # time.monotonic() after which a connection presenting it is refused
        self._plane = plane
        self._claimed = threading.Event()
        self._connection: DataConnection | None = None
        self._taken = False
        self._closed = False

    def _give(self, connection: DataConnection) -> bool:
        with self._plane._lock:
            if self._closed:
                return False
            self._connection = connection
        self._claimed.set()
        return True

    def wait(self, cancelled: Callable[[], bool] = _never) -> DataConnection:
        """The connection that presented this ticket's token. Raises ConnectionError if none did
        within the token's time to live (and the handshake's), ConnectionAbortedError if
        ``cancelled()`` turns true or the plane closes meanwhile."""
        limit = self.deadline + self._plane.handshake_timeout_s
        while not self._claimed.wait(SLICE_S):
            if cancelled() or self._closed:
                raise ConnectionAbortedError("the call ended before its client opened its data connection")
            if time.monotonic() > limit:
                self.close()
                raise ConnectionError(f"the client did not open its data connection within "
                                      f"{self._plane.token_ttl_s:g} s of the call's answer")
        with self._plane._lock:
            connection = self._connection
            self._taken = connection is not None and not self._closed
        if not self._taken:
            raise ConnectionAbortedError("the call ended, or the data plane closed, before its client connected")
        return connection

    def close(self) -> None:
        """Withdraw the token; close a connection not taken by ``wait``'s caller. Idempotent."""
        with self._plane._lock:
            self._closed = True
            self._plane._pending.discard(self)
            orphan = self._connection if not self._taken else None
        self._claimed.set()
        if orphan is not None:
            orphan.close()


class DataPlane:
    """The data-plane listener: see the module docstring.

    host, port: where to listen (port 0: a free one; ``port`` is then the bound one).
    ssl_context: ``tls_context(config.tls)``, or None for plain TCP. token_ttl_s: how long a
    token may wait for its connection (from ``expect``). first_byte_timeout_s,
    handshake_timeout_s, max_handshakes, max_handshakes_per_source: the pending connections'
    limits (``handshakes.Limits``: the first byte, TLS and token together, pending at once, and
    from one source address; the oldest pending is evicted beyond). Raises RuntimeError if the
    address cannot be bound or the accept thread cannot start.
    """

    def __init__(self, host: str, port: int = 0, *, ssl_context: ssl.SSLContext | None = None,
                 token_ttl_s: float = 10.0, first_byte_timeout_s: float = 2.0, handshake_timeout_s: float = 5.0,
                 max_handshakes: int = 1024, max_handshakes_per_source: int = 64):
        self.ssl_context = ssl_context
        self.token_ttl_s = token_ttl_s
        self.handshake_timeout_s = handshake_timeout_s
        host = host.strip("[]")
        try:
            infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
            family, _, _, _, sockaddr = infos[0]
            self._listener = socket.socket(family, socket.SOCK_STREAM)
            try:
                self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                self._listener.bind(sockaddr)
                self._listener.listen(BACKLOG)
            except BaseException:
                self._listener.close()
                raise
        except OSError as e:
            raise RuntimeError(f"data plane: cannot listen on {host}:{port}: {e.strerror or e}") from None
        self.host = host
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pending: set[Ticket] = set()
        self._connections: set[DataConnection] = set()
        self._closed = False
        self._warn = _RateLimitedWarning()
        self.bytes_sent = 0
        self.connections_accepted = 0
        self.connections_refused = 0
        limits = Limits(first_byte_s=min(first_byte_timeout_s, handshake_timeout_s), handshake_s=handshake_timeout_s,
                        max_pending=max_handshakes, max_per_source=max_handshakes_per_source)
        try:
            self._handshakes = Handshakes(self._listener, ssl_context, limits, self._token_read, self._refused)
        except BaseException as e:
            self._listener.close()
            raise RuntimeError(f"data plane: cannot start its accept thread: {e}") from None

    @property
    def tls(self) -> bool:
        return self.ssl_context is not None

    def stats(self) -> dict[str, int]:
        """Since the plane started: bytes_sent (headers and padding included), connections
        accepted (authenticated) and refused (any reason: a bad token, a failed handshake, too
        slow, evicted), of those evicted (for a newer pending one) and timed out; now: calls
        waiting for their connection (``pending``) and connections in their handshake."""
        h = self._handshakes
        with self._lock:
            return {"bytes_sent": self.bytes_sent, "connections_accepted": self.connections_accepted,
                    "connections_refused": self.connections_refused, "pending": len(self._pending),
                    "handshakes": h.pending, "handshakes_evicted": h.evicted, "handshakes_timed_out": h.timed_out}

    def expect(self, control: Any = None) -> Ticket:
        """A fresh one-time token for one call (``control``: its ``CallControl``, to read the
        client's control frames into; plain TCP only). Raises ConnectionAbortedError once closed."""
        if control is not None and self.tls:
            raise ValueError("control frames on a TLS data connection: not supported (one SSLSocket, two threads)")
        now = time.monotonic()
        ticket = Ticket(self, secrets.token_bytes(datawire.TOKEN_BYTES), now + self.token_ttl_s, control)
        with self._lock:
            if self._closed:
                raise ConnectionAbortedError("the data plane is closed")
            for old in [t for t in self._pending if t.deadline < now]:
                self._pending.discard(old)  # expired: its waiter gives up by itself
            self._pending.add(ticket)
        return ticket

    def _claim(self, presented: bytes, accepted_at: float) -> Ticket | None:
        """The pending ticket whose token is ``presented`` (it is claimed: gone from the pending),
        None if none is, or it expired before ``accepted_at``. Every pending token is compared."""
        with self._lock:
            found = None
            for ticket in self._pending:
                if hmac.compare_digest(ticket.token, presented) and found is None:
                    found = ticket
            if found is not None:
                self._pending.discard(found)
                if found.deadline < accepted_at:
                    return None
        return found

    def _token_read(self, sock: socket.socket, peer: str, token: bytes, accepted_at: float) -> str | None:
        """(the accept thread) A connection presented ``token``: hand it to its ticket as a
        ``DataConnection`` (None: it owns ``sock`` now), or the reason it is refused (the caller
        closes ``sock``; no byte was written to it)."""
        sock.settimeout(SLICE_S)  # (before the claim: nothing after it may fail and spend the token)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ticket = self._claim(token, accepted_at)
        if ticket is None:
            return "unknown, reused or expired token"
        connection = DataConnection(sock, peer, self)
        with self._lock:
            if self._closed:
                return "the data plane is closing"
            self._connections.add(connection)
            self.connections_accepted += 1
        # from here on the connection is the ticket's (closed there if its call has ended)
        if not ticket._give(connection):
            connection.close()
        elif ticket.control is not None:
            try:
                threading.Thread(target=connection.read_control, args=(ticket.control,), name="batchd-data-control",
                                 daemon=True).start()
            except RuntimeError as e:  # (no thread to be had: the call cannot read its grants there)
                ticket.control.fail(ConnectionError(f"the data connection from {peer} cannot be read: {e}"))
                connection.abort()
        return None

    def _refused(self, peer: str, reason: str) -> None:
        with self._lock:
            self.connections_refused += 1
            closed = self._closed
        if not closed:
            self._warn("refused a data connection from %s: %s", peer, reason)

    def _sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def _forget(self, connection: DataConnection) -> None:
        with self._lock:
            self._connections.discard(connection)

    def close(self) -> None:
        """Stop accepting (pending handshakes are closed), withdraw every token, shut every
        connection down (sends in flight fail at once), join the accept thread. Idempotent;
        never raises (each step is done whatever the others did; their errors are logged)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
            connections = list(self._connections)
        steps = [self._handshakes.close, *(t.close for t in pending), *(c.abort for c in connections)]
        for step in steps:
            try:
                step()
            except Exception:
                log.exception("data plane: error while closing (going on)")
