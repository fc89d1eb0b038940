"""A call's data connection, dialed again while the server has sent nothing on it (issue 37).

A data connection the server closes or resets before its first byte was refused before its
token was read: the server's accept thread evicted it for a newer one (a flood of idle
connections), or gave up on its handshake. The call's one-time token is then still unclaimed,
so the client dials again with the same token (``ATTEMPTS`` dials in all, ``BACKOFF_S`` apart;
a dial that failed after more than ``window`` seconds waited out a timeout and is not
repeated). A token the server did claim is never accepted twice, so a dial after a real break
is refused too, and the call's own status says what happened. The dials stop once the call is
over (``ended()``: a call with nothing to send closes its connection without a byte, legitimately)
and once the connection is closed (``close``).

When every dial was refused, ``unusable(error)`` decides what to raise (``DataLink._unusable``:
``FellBack`` where the loader falls back to inline).

A call reads a ``RedialingSocket`` as it would a ``DataSocket`` or ``RelayedSocket`` (dataplane.py,
relayed_socket.py); both say whether the server sent a byte (``first_byte``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from batchd import errors

ATTEMPTS = 4  # dials of one call's data connection while the server refuses them
BACKOFF_S = (0.05, 0.2, 0.6)  # seconds between them
WINDOW_S = 3.0  # a dial that failed after longer than this is not repeated (it waited out a timeout)


class FellBack(errors.ConnectionError):
    """The server's data port could not be used (not reachable, or every dial refused): the call
    is broken, and the loader's next call to that server asks for its batches inline."""


class RedialingSocket:
    """One call's data connection (module docstring). dial() -> a ``DataSocket`` or
    ``RelayedSocket`` with the call's token presented (raises ConnectionError). ended(): whether
    the call is over. unusable(error) -> the error to raise once the dials are spent. where: the
    data port, named in errors. window: seconds a failed dial may have taken and still be
    repeated (``WINDOW_S``). Raises (at construction) what the last dial raised, through
    ``unusable``. ``read`` runs in one thread; ``close`` from any."""

    def __init__(self, dial: Callable[[], Any], ended: Callable[[], bool],
                 unusable: Callable[[ConnectionError], ConnectionError], *, where: str = "the data port",
                 window: float = WINDOW_S):
        self._dial, self._ended, self._unusable, self._window = dial, ended, unusable, window
        self.where = where
        self._lock = threading.Lock()
        self._closed = False
        self.dials = 0
        self._sock: Any = self._open(None)

    # --- what a call uses of the connection ---------------------------------------------------------

    @property
    def controls(self) -> bool:
        return self._sock.controls

    @property
    def last_received(self) -> int:
        return self._sock.last_received

    def send_control(self, frame: bytes) -> None:
        self._sock.send_control(frame)

    def close(self) -> None:
        """Close the connection; no dial follows. Idempotent."""
        with self._lock:
            self._closed = True
            sock = self._sock
        sock.close()

    # --- dials -----------------------------------------------------------------------------------

    def read(self, read: Callable[[Any], Any]) -> Any:
        """``read(connection)`` (its ``receive`` or ``receive_next``), on a fresh connection while
        the server refuses them (module docstring): once it sent a byte (``first_byte``), no more
        dials."""
        if self._sock.first_byte:
            return read(self._sock)
        while True:
            sock = self._sock
            clean = False  # closed between frames, before the first: refused, or a call with nothing to send
            try:
                result = read(sock)
            except ConnectionAbortedError:  # (stopped, or closed: no dial)
                raise
            except ConnectionError as e:
                if sock.first_byte:
                    raise
                error = e
            else:
                if result is not None or sock.first_byte:
                    return result
                clean = True
                error = errors.ConnectionError(f"{self.where} closed the data connection before its first byte "
                                               f"each time it was dialed (it refused it: too many connections "
                                               f"waiting there, or a handshake it gave up on)")
            sock.close()
            try:
                fresh = self._open(error)
            except ConnectionAbortedError:
                raise
            except ConnectionError:
                if clean and not self._closed and self._ended():
                    return None  # the call is over: its status says how
                raise
            with self._lock:
                self._sock = fresh
                closed = self._closed
            if closed:  # (closed while dialing: ``close`` closed the old socket)
                fresh.close()
                raise ConnectionAbortedError("the data connection was closed")

    def _open(self, error: ConnectionError | None) -> Any:
        """A connection: dialed now (``error`` None) or, after ``error``, again after the backoff
        while dials are left. Raises the error to raise once none is (``unusable``'s, unless the
        call is over or the connection closed), ConnectionAbortedError once closed."""
        while error is None or self._wait():
            if self._closed:
                raise ConnectionAbortedError("the data connection was closed")
            self.dials += 1
            t0 = time.monotonic()
            try:
                return self._dial()
            except ConnectionAbortedError:
                raise
            except ConnectionError as e:
                error = e
                if time.monotonic() - t0 > self._window:  # it waited out a timeout: not again
                    break
        raise error if self._closed or self._ended() else self._unusable(error)

    def _wait(self) -> bool:
        """Wait the backoff before the next dial, looking at ``ended`` and ``close``; False when no
        dial is to follow (``ATTEMPTS`` spent, the call over, closed)."""
        if self.dials >= ATTEMPTS:
            return False
        until = time.monotonic() + BACKOFF_S[min(self.dials, len(BACKOFF_S)) - 1]
        while True:
            if self._closed or self._ended():
                return False
            left = until - time.monotonic()
            if left <= 0:
                return True
            time.sleep(min(left, 0.02))
