"""The data plane's pending connections: one thread accepts them and reads every one's TLS
handshake and one-time token, none with a thread of its own (issue 37; the plane itself is
server/serve/dataplane.py).

A thread per handshake, capped, let 64 idle connections (about 14 new ones a second) keep every
trainer's data connection out. Here a pending connection costs a socket and a table entry: one
``selectors`` loop (epoll on Linux) accepts, then drives each connection's non-blocking TLS
handshake (``do_handshake`` on ``SSLWantReadError`` / ``SSLWantWriteError``) and reads its
``TOKEN_BYTES`` token, and hands the connection with its token to the plane (``on_token``).
Clients send their token at once, so the limits (``Limits``) are short:

* ``first_byte_s``: the first byte (a TLS ClientHello, or the token's first byte) must come
  within this many seconds of the accept;
* ``handshake_s``: TLS and token within this many seconds of the accept;
* ``max_pending``: connections pending at once; a new one beyond evicts the *oldest* pending one
  (a client that sends its token at once is done long before it is the oldest, so a flood of
  idle connections evicts idle connections, not trainers);
* ``max_per_source``: pending connections from one source address; a new one beyond evicts that
  source's oldest. Accepts are taken ``ACCEPT_BATCH`` at a time, after the readable connections
  of the same wake-up were read, so one source's flood cannot evict a trainer of that source
  between its connect and its token (``ACCEPT_BATCH`` is well below ``max_per_source``);
  a trainer whose connection was evicted anyway dials again (its token is still pending). (A
  source is one address: an attacker with many, IPv6 ones say, meets ``max_pending`` and its
  eviction of the oldest, which is what bounds the table.)

A connection dropped (evicted, late, closed, a failed handshake, an error of any kind while it
is read) is closed without a byte written and reported (``refused``). No error of one
connection, nor a failed accept (``EMFILE``: the oldest pending connection is evicted to make
room; with none pending, or another error, accepts pause for ``PAUSE_S``), ends the loop.
``close`` wakes it at once; it closes every pending connection and the listener, and returns
once the thread ended.

Cost: about 50 us of CPU (the kernel's part included) per connection accepted and dropped: a
plane alone under 1,000 new idle connections a second used 0.05 of a core (this machine, 2
cores; Table 19, ``bench/tables/table_dataplane.py``, has a whole server under such floods).
"""

from __future__ import annotations

import collections
import dataclasses
import errno
import logging
import selectors
import socket
import ssl
import threading
import time
from typing import Callable

from batchd import datawire

log = logging.getLogger(__name__)

ACCEPT_BATCH = 16  # connections accepted per wake-up (after the ready ones were read)
PAUSE_S = 0.25  # accepting pauses this long after a failed accept (EMFILE, ENOBUFS...)
TICK_S = 0.05  # while connections are pending, deadlines are looked at this often
FIRST, TLS, TOKEN = range(3)  # a pending connection's state: its first byte, the TLS handshake, the token
_WAITING = object()  # (``Handshakes._io``: the operation cannot go on now)


@dataclasses.dataclass(frozen=True, slots=True)
class Limits:
    """The pending connections' limits (module docstring); seconds and counts, all > 0."""

    first_byte_s: float = 2.0
    handshake_s: float = 5.0
    max_pending: int = 1024
    max_per_source: int = 64


class _Pending:
    """One accepted connection until its token is read."""

    __slots__ = ("sock", "fd", "peer", "source", "accepted_at", "state", "token", "got", "events")

    def __init__(self, sock: socket.socket, peer: str, source: str, accepted_at: float, state: int):
        self.sock, self.peer, self.source, self.accepted_at, self.state = sock, peer, source, accepted_at, state
        self.fd = sock.fileno()  # (the key in the tables and the selector, also once wrapped in TLS)
        self.token = bytearray(datawire.TOKEN_BYTES)
        self.got = 0  # token bytes read
        self.events = selectors.EVENT_READ

    @property
    def started(self) -> bool:
        """Whether its first byte came: a TLS connection is wrapped only then; a plain one's token began."""
        return isinstance(self.sock, ssl.SSLSocket) or self.got > 0


class Handshakes:
    """The thread that accepts on ``listener`` and reads each connection's TLS handshake (with
    ``ssl_context``; None: plain TCP) and token within ``limits``.

    on_token(sock, peer, token, accepted_at): a connection presented ``token`` (blocking mode
    not set: the callee sets its own); it returns None once it owns ``sock``, or the reason it
    refuses it (``sock`` is then closed here). refused(peer, reason): a connection was dropped
    (counted and logged by the plane). Counters: ``evicted`` (for a newer one), ``timed_out``
    (no first byte, or no token in time), ``tokens_read`` (handed to ``on_token``).
    """

    def __init__(self, listener: socket.socket, ssl_context: ssl.SSLContext | None, limits: Limits,
                 on_token: Callable[[socket.socket, str, bytes, float], str | None],
                 refused: Callable[[str, str], None]):
        self.limits = limits
        self._listener = listener
        self._ssl = ssl_context
        self._on_token = on_token
        self._refused = refused
        self._pending: dict[int, _Pending] = {}  # fd -> connection, in the order accepted (oldest first)
        self._sources: dict[str, collections.OrderedDict[int, _Pending]] = {}
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._closing = False
        self._paused_until = 0.0  # accepts pause until then (time.monotonic())
        self._next_expiry = 0.0  # deadlines are looked at again then
        self._listening = False
        self.evicted = 0
        self.timed_out = 0
        self.tokens_read = 0
        listener.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._listen(True)
        self._thread = threading.Thread(target=self._run, name="batchd-data-accept", daemon=True)
        try:
            self._thread.start()
        except BaseException:
            for sock in (self._wake_r, self._wake_w):
                sock.close()
            self._selector.close()
            raise

    @property
    def pending(self) -> int:
        """Connections pending now (a figure read from other threads: approximate)."""
        return len(self._pending)

    def close(self) -> None:
        """Stop: the loop wakes at once, closes every pending connection and the listener, and ends
        (joined here). Idempotent."""
        self._closing = True
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass  # (already woken, or closed)
        if self._thread is not threading.current_thread():
            self._thread.join()

    # --- the loop ------------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._closing:
                try:
                    self._step()
                except Exception:  # a bug of ours: never let it end the loop (nor spin)
                    log.exception("data plane: error in the accept loop (going on)")
                    time.sleep(TICK_S)
        finally:
            for entry in list(self._pending.values()):
                self._drop(entry, "the data plane is closing", report=False)
            for sock in (self._listener, self._wake_r, self._wake_w):
                try:
                    sock.close()
                except OSError:
                    pass
            self._selector.close()

    def _step(self) -> None:
        now = time.monotonic()
        if not self._listening and now >= self._paused_until:
            self._listen(True)
        timeout = TICK_S if self._pending else None
        if not self._listening:
            timeout = min(timeout or PAUSE_S, max(0.0, self._paused_until - now))
        ready = self._selector.select(timeout)
        accept = False
        for key, _mask in ready:  # the ready connections first, the listener last (module docstring)
            if key.fileobj is self._listener:
                accept = True
            elif key.fileobj is self._wake_r:
                try:
                    self._wake_r.recv(64)
                except OSError:
                    pass
            else:
                self._advance(key.data)
        if accept and not self._closing:
            self._accept()
        self._expire(time.monotonic())

    def _listen(self, on: bool) -> None:
        if on == self._listening:
            return
        if on:
            self._selector.register(self._listener, selectors.EVENT_READ, None)
        else:
            self._selector.unregister(self._listener)
        self._listening = on

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:  # reset before it was accepted
                continue
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE) and self._pending:
                    # out of descriptors: the oldest pending connection makes room for the new one
                    self.evicted += 1
                    self._drop(next(iter(self._pending.values())), "evicted: out of file descriptors")
                    continue
                # (ENOBUFS, ENOMEM, out of descriptors with none pending): pause, never spin
                self._listen(False)
                self._paused_until = time.monotonic() + PAUSE_S
                log.warning("data plane: accept failed (%s); accepting again in %g s", e.strerror or e, PAUSE_S)
                return
            try:
                self._admit(sock, addr)
            except Exception as e:  # one connection's trouble is that connection's
                self._refused(_peer(addr), f"{type(e).__name__}: {e}")
                sock.close()

    def _admit(self, sock: socket.socket, addr) -> None:
        sock.setblocking(False)
        source = addr[0] if isinstance(addr, tuple) else str(addr)
        peer = _peer(addr)
        mine = self._sources.setdefault(source, collections.OrderedDict())
        if len(mine) >= self.limits.max_per_source:
            self.evicted += 1
            self._drop(next(iter(mine.values())), f"evicted: more than {self.limits.max_per_source} pending "
                                                  f"connections from {source}")
            mine = self._sources.setdefault(source, collections.OrderedDict())
        if len(self._pending) >= self.limits.max_pending:
            self.evicted += 1
            self._drop(next(iter(self._pending.values())), f"evicted: more than {self.limits.max_pending} pending "
                                                           f"connections")
            mine = self._sources.setdefault(source, collections.OrderedDict())
        entry = _Pending(sock, peer, source, time.monotonic(), FIRST if self._ssl is not None else TOKEN)
        self._selector.register(entry.fd, selectors.EVENT_READ, entry)
        self._pending[entry.fd] = entry
        mine[entry.fd] = entry

    def _advance(self, entry: _Pending) -> None:
        """Take ``entry`` as far as it can go now: its first byte, TLS handshake, token."""
        try:
            if entry.state == FIRST:  # TLS: wrap only once a byte came (an idle connection costs no TLS state)
                first = self._io(entry, lambda: entry.sock.recv(1, socket.MSG_PEEK), "no first byte")
                if first is _WAITING:
                    return
                if not first:
                    self._drop(entry, "closed before its first byte")
                    return
                # (the same descriptor: its registration stays)
                entry.sock = self._ssl.wrap_socket(entry.sock, server_side=True, do_handshake_on_connect=False)
                entry.state = TLS
            if entry.state == TLS:
                if self._io(entry, entry.sock.do_handshake, "TLS handshake failed") is _WAITING:
                    return
                entry.state = TOKEN
            while entry.got < len(entry.token):  # exactly the token: control frames may follow it (plain TCP)
                view = memoryview(entry.token)[entry.got:]
                n = self._io(entry, lambda: entry.sock.recv_into(view, len(view)), "no token")
                if n is _WAITING:
                    return
                if not n:
                    self._drop(entry, f"closed after {entry.got} bytes of its token")
                    return
                entry.got += n
        except Exception as e:  # one connection's trouble is that connection's
            self._drop(entry, f"{type(e).__name__}: {e}")
            return
        self._forget(entry)
        self.tokens_read += 1
        try:
            reason = self._on_token(entry.sock, entry.peer, bytes(entry.token), entry.accepted_at)
        except Exception as e:
            reason = f"{type(e).__name__}: {e}"
        if reason is not None:  # (counted before the close: a client that saw it closed sees it counted)
            self._refused(entry.peer, reason)
            _close(entry.sock)

    def _io(self, entry: _Pending, op: Callable[[], object], failed: str) -> object:
        """``op()``'s result; ``_WAITING`` when it cannot go on now: the connection waits for its
        socket (``SSLWant*``, ``EAGAIN``), or was dropped (an error: ``failed`` says what failed)."""
        try:
            return op()
        except (BlockingIOError, InterruptedError, ssl.SSLWantReadError):
            self._want(entry, selectors.EVENT_READ)
        except ssl.SSLWantWriteError:
            self._want(entry, selectors.EVENT_WRITE)
        except (ssl.SSLError, OSError) as e:
            self._drop(entry, f"{failed} ({type(e).__name__}: {e})")
        return _WAITING

    def _want(self, entry: _Pending, events: int) -> None:
        if entry.events != events:
            self._selector.modify(entry.fd, events, entry)
            entry.events = events

    def _expire(self, now: float) -> None:
        """Drop the connections past their deadline, at most every ``TICK_S`` (oldest first: the
        scan ends at the first one younger than the first-byte limit, since every younger one is
        within both limits)."""
        if now < self._next_expiry:
            return
        self._next_expiry = now + TICK_S
        limits, late = self.limits, []
        for entry in self._pending.values():
            age = now - entry.accepted_at
            if age < limits.first_byte_s:
                break
            if age >= limits.handshake_s:
                late.append((entry, f"no token within {limits.handshake_s:g} s"))
            elif not entry.started:
                late.append((entry, f"no byte within {limits.first_byte_s:g} s"))
        for entry, reason in late:
            self.timed_out += 1
            self._drop(entry, reason)

    def _forget(self, entry: _Pending) -> None:
        """Out of the tables and the selector (the socket stays open)."""
        self._pending.pop(entry.fd, None)
        mine = self._sources.get(entry.source)
        if mine is not None:
            mine.pop(entry.fd, None)
            if not mine:
                del self._sources[entry.source]
        try:
            self._selector.unregister(entry.fd)
        except (KeyError, ValueError):
            pass

    def _drop(self, entry: _Pending, reason: str, report: bool = True) -> None:
        self._forget(entry)
        if report:  # (counted before the close: a client that saw it closed sees it counted)
            self._refused(entry.peer, reason)
        _close(entry.sock)


def _peer(addr) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) else str(addr)


def _close(sock: socket.socket) -> None:
    try:
        sock.close()  # no byte written: a refused client learns nothing but the close
    except OSError:
        pass
