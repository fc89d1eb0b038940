"""Data-connection socket calls that never fall back from TLS to the plain socket (server and
client; issue 37).

``ssl.SSLSocket.shutdown`` and ``close`` drop the socket's TLS object (``_sslobj = None``)
*before* they reach the kernel, and ``SSLSocket.send`` / ``recv_into`` with no TLS object are
the plain socket's: a ``send`` in another thread that falls in that window writes the rest of a
payload in clear on a connection that is still open (reproduced: 3 of 300 aborted connections
carried payload bytes outside TLS records; tests/serve/test_tls_abort.py widens the window and
sees it on every abort). So:

* ``shutdown`` shuts a socket down at the kernel through a duplicate of its descriptor, never
  through the ``SSLSocket``: once it returns, no byte can leave or enter the connection, whatever
  another thread does to the TLS object afterwards (``close`` may then drop it safely);
* ``send`` and ``recv_into`` of a TLS socket go through ``SSLSocket.write`` / ``read``, the
  calls that raise (ValueError, or AttributeError in a race) instead of falling back once the
  TLS object is gone; both are turned into ``ConnectionAbortedError`` here. Timeouts and
  ``SSLWant*`` errors behave as ``send`` / ``recv_into``'s (they call the same TLS object), and
  a TLS read answers 0 at a peer's close without ``close_notify``, as ``recv_into`` does.
"""

from __future__ import annotations

import os
import socket
import ssl


def shutdown(sock: socket.socket) -> None:
    """Shut ``sock`` down both ways at the kernel (a blocked send or receive on it returns at
    once), through a duplicate of its descriptor: an ``SSLSocket`` keeps its TLS object. Never
    raises; nothing for a closed socket. The caller must not close ``sock`` meanwhile (the
    descriptor could be another socket's by then): hold the lock its ``close`` takes."""
    try:
        fd = sock.fileno()
        if fd < 0:
            return
        dup = socket.socket(fileno=os.dup(fd))
    except OSError:
        return
    try:
        dup.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass  # not connected (any more): nothing can cross it either
    finally:
        dup.close()  # (the duplicate only: ``sock`` stays open until its owner closes it)


def send(sock: socket.socket, data) -> int:
    """``sock.send(data)``; over TLS ``SSLSocket.write``, which encrypts or raises. Raises
    ConnectionAbortedError if the TLS object is gone (the socket was shut down or closed)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.send(data)
    try:
        return sock.write(data)
    except (ValueError, AttributeError):
        raise ConnectionAbortedError("the TLS connection is closed: no byte leaves it unencrypted") from None


def recv_into(sock: socket.socket, view: memoryview) -> int:
    """``sock.recv_into(view)``; over TLS ``SSLSocket.read``, which decrypts or raises. Raises
    ConnectionAbortedError if the TLS object is gone (the socket was shut down or closed)."""
    if not isinstance(sock, ssl.SSLSocket):
        return sock.recv_into(view)
    try:
        return sock.read(len(view), view)
    except (ValueError, AttributeError):
        raise ConnectionAbortedError("the TLS connection is closed: no byte is read from it unencrypted") from None
