"""The receive relay, trainer side: data connections held by a process of their own, which
writes each payload into a buffer the trainer has mapped (``relay=`` of ``RemoteDataLoader``;
docs/network.md, docs/design/network-path.md).

Over the socket data plane the kernel copies each payload from the socket into the trainer's
buffer: off the GIL, but on the trainer's CPU (about 0.1-0.2 s per GB). The relay moves that
copy to a process of its own, so the trainer pays what shared memory costs it: a message to ask
for a batch, one to hear it arrived, and tensors that are views of a buffer it maps once.

* ``Relay`` is the process (client/transport/relay_child.py, standard library only, started with
  ``subprocess``: never a fork of the trainer, whose gRPC threads and CUDA context it must not
  inherit), one per trainer process (``shared()``), started on the first data connection. It
  ends when the trainer closes it (at exit) or dies (EOF on its control socket).
* ``RelayBuffers`` makes the receive buffers (``BufferPool``'s ``allocate``): memfd-backed
  shared memory, mapped here as a uint8 tensor; a buffer's fd goes to the relay once per
  connection, which maps it once, so a buffer reused batch after batch costs no page faults.
* ``RelayedSocket`` is one connection, with ``DataSocket``'s interface (client/transport/dataplane.py):
  ``receive`` sends ``READ`` with the buffer and waits for ``DONE``; ``receive_next`` (the
  call's messages in band) sends ``N`` with a buffer the size of the last frame and gets the
  message after the payload (``M``; ``S`` then ``P`` when it does not fit; ``F`` at the
  connection's end). The header's checks and the ``timeout`` run in the relay, and its errors
  come back with their text. ``send_control``
  sends ``C`` + a control frame (the call's grants and revokes), which the relay writes on the
  data connection (plain TCP only, as ``DataSocket``).

Failure: a relay that dies (killed, out of memory) breaks the connections it held: each
``receive`` raises ConnectionError naming the relay, which the loader resumes as any broken call
(the batches granted again: nothing lost or repeated; tests/client/test_relay.py kills it with
SIGKILL mid-epoch), and the next connection starts a new relay (logged; ``Relay.started``
counts). A buffer the relay may still be writing (a receive abandoned mid-read) is never reused.
"""

from __future__ import annotations

import array
import atexit
import dataclasses
import itertools
import json
import logging
import mmap
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

import numpy as np
import torch

from batchd import datawire, errors, wire
from batchd.client.transport import buffers
from batchd.client.transport import dataplane
from batchd.client.transport import fields
from batchd.client import forks
from batchd.client.transport.channel import TLS
from batchd.client.transport.relay_child import DONE, FRAME, MAX_MESSAGE, REQUEST

log = logging.getLogger("batchd.client.loader.loader")
CHILD = pathlib.Path(__file__).with_name("relay_child.py")
SLICE_S = 0.25  # a blocked wait looks at ``stopping`` and at the relay this often
AVAILABLE = sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class _Gone(errors.ConnectionError):
    """The relay closed this connection without an answer: it died, so it writes no more."""


def _with_fd(sock: socket.socket, data: bytes, fd: int) -> None:
    sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))])


class RelayBuffers:
    """``allocate`` for a ``BufferPool`` whose buffers the relay writes: each a uint8 [nbytes]
    tensor over a memfd mapping, with an id and the fd to pass (``lookup``). Thread-safe."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._by_address: dict[int, tuple[int, int, int]] = {}  # data_ptr -> (id, fd, size)

    def __call__(self, nbytes: int) -> torch.Tensor:
        fd = os.memfd_create("batchd-relay", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
        except OSError:
            os.close(fd)
            raise
        buf = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))  # keeps the mapping alive
        address = buf.data_ptr()
        with self._lock:
            self._by_address[address] = (next(self._ids), fd, nbytes)
        weakref.finalize(buf, self._drop, address, fd)
        return buf

    def lookup(self, buf: torch.Tensor) -> tuple[int, int, int]:
        """(id, fd, size) of a buffer this made. KeyError for another."""
        with self._lock:
            return self._by_address[buf.data_ptr()]

    def _drop(self, address: int, fd: int) -> None:
        with self._lock:
            self._by_address.pop(address, None)
        os.close(fd)


class Relay:
    """The relay process of this trainer process (``shared()``). Thread-safe.

    started: processes started (the first, then one per replacement). pid: the current one's
    (None before the first connection).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._control: socket.socket | None = None
        self.buffers = RelayBuffers()
        self.started = 0
        self._owner = forks.owner()

    @property
    def pid(self) -> int | None:
        proc = self._proc
        return None if proc is None else proc.pid

    def alive(self) -> bool:
        proc = self._proc
        return proc is not None and proc.poll() is None

    def _start(self) -> socket.socket:
        """(under _lock) The control socket of a running relay: this one, or a new one."""
        if self._proc is not None and self._proc.poll() is None and self._control is not None:
            return self._control
        if self._proc is not None:
            log.warning("the receive relay (pid %d) exited with code %s; starting another", self._proc.pid,
                        self._proc.returncode)
            self._control.close()
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        spec = {"header": datawire.HEADER.format, "magic": datawire.MAGIC.decode("latin-1"), "slice_s": SLICE_S,
                "message_magic": datawire.MESSAGE_MAGIC.decode("latin-1"), "max_message": datawire.MAX_MESSAGE,
                "control_fd": theirs.fileno()}
        try:
            self._proc = subprocess.Popen([sys.executable, "-I", str(CHILD), json.dumps(spec)],
                                          pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL)
        except OSError as e:
            mine.close()
            raise errors.ConnectionError(f"cannot start the receive relay ({sys.executable} {CHILD}): {e}") from None
        finally:
            theirs.close()
        self._control = mine
        self.started += 1
        log.debug("receive relay started (pid %d)", self._proc.pid)
        return mine

    def open(self, address: str, host: str, port: int, token: bytes, *, tls: TLS | None,
             connect_timeout: float, timeout: float) -> "RelayedSocket":
        """A data connection to ``port`` on ``host`` (``address``'s, named in errors), dialed by
        the relay, TLS if ``tls``, ``token`` presented, within ``connect_timeout`` seconds.
        Raises ConnectionError (the server cannot be reached, the handshake failed, the relay
        could not be started or died)."""
        spec = {"address": address, "host": host, "port": port, "token": token.hex(),
                "connect_timeout": connect_timeout, "timeout": timeout, "tls": None if tls is None else {
                    "ca": None if tls.ca is None else str(tls.ca), "cert": None if tls.cert is None else str(tls.cert),
                    "key": None if tls.key is None else str(tls.key), "server_name": tls.server_name}}
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:  # the relay alive and the connection handed to it: one decision
                control = self._start()
                pid = self._proc.pid
                try:
                    _with_fd(control, json.dumps(spec).encode(), theirs.fileno())
                except OSError:
                    raise errors.ConnectionError(f"the receive relay (pid {pid}) is gone; opening a data connection to "
                                                 f"{address} again starts another") from None
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        sock = RelayedSocket(mine, address, timeout, self, pid, tls is not None)
        try:
            reply = sock.wait(None, connect_timeout + 5.0, f"opening a data connection to {address}")
        except BaseException:
            sock.close()
            raise
        if reply[:1] != b"O":
            sock.close()
            raise errors.ConnectionError(reply[1:].decode("utf-8", "replace"))
        return sock

    def close(self) -> None:
        """End the relay (its connections close). Nothing in a forked child."""
        if forks.forked(self._owner):
            return
        with self._lock:
            proc, control, self._proc, self._control = self._proc, self._control, None, None
        if control is not None:
            control.close()  # EOF: the relay exits
        if proc is not None:
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class RelayedSocket(dataplane.Closable):
    """One data connection held by the relay, with ``DataSocket``'s interface: ``receive`` runs
    in one thread (the call's receiver), ``close`` from any (closing the pair: the relay then
    closes the server's connection)."""

    def __init__(self, pair: socket.socket, address: str, timeout: float, relay: Relay, pid: int, tls: bool):
        pair.settimeout(SLICE_S)
        self._sock, self.address, self.timeout, self._relay, self.pid = pair, address, timeout, relay, pid
        self.tls = tls
        self.controls = not tls
        self.bytes_received = 0
        self.last_received = 0
        self._sent: set[int] = set()  # buffer ids whose fd the relay has for this connection
        self._frame_bytes = 0  # the last in-band frame's payload and message: the next one's buffer
        self._lock = threading.Lock()
        self._closed = False
        self._owner = forks.owner()

    def receive(self, batch: wire.WireBatch, pool: buffers.BufferPool,
                stopping: threading.Event | None = None) -> dict[str, fields.Field]:
        """As ``DataSocket.receive``: the payload of ``batch`` in a buffer of ``pool`` (made by the
        relay's ``RelayBuffers``), the batch's fields as views of it. Raises ConnectionError
        (the relay's check of the header, a closed or silent connection, the relay gone),
        ConnectionAbortedError once ``stopping`` is set or the socket closed, ValueError for a
        malformed tensor."""
        length = buffers.payload_length(batch)
        buf = pool.take(length)
        try:
            self._request(b"R", buf, batch.batch_index, length, f"batch {batch.batch_index}")
            reply = self.wait(stopping, None, f"receiving batch {batch.batch_index} from {self.address}")
        except _Gone:
            pool.give_back(buf)  # the relay is finished with it
            raise
        except BaseException:
            pool.discard(buf)  # the relay may still write it: never reused
            raise
        if reply[:1] != b"D":
            pool.give_back(buf)  # the relay sent its error and wrote no more
            raise errors.ConnectionError(reply[1:].decode("utf-8", "replace"))
        DONE.unpack(reply)
        self.last_received = datawire.HEADER.size + length
        self.bytes_received += length
        return buffers.tensors(batch, buf, length, pool.give_back)

    def receive_next(self, pool: buffers.BufferPool, stopping: threading.Event | None = None,
                     ended: Callable[[], bool] | None = None) -> tuple[wire.WireBatch, int] | None:
        """As ``DataSocket.receive_next``: the next in-band frame (message and payload), read by the
        relay into a buffer of ``pool`` sized as the last frame (``N``; a larger one after an
        ``S`` answer: ``P``), the message after the payload. None once the server closed the
        connection between batches (``F``). Raises as ``receive``; waits for the frame as long as
        the call lasts (``ended()``), then ``dataplane.ENDED_GRACE_S`` seconds more."""
        doing = f"receiving the next batch from {self.address}"
        buf = pool.take(self._frame_bytes)
        try:
            self._request(b"N", buf, 0, 0, "the next batch")
            reply = self.wait(stopping, None, doing, ended)
            if reply[:1] == b"S":
                _, mlen, _, length = FRAME.unpack(reply)
                pool.give_back(buf)  # (not written: the relay keeps the frame's message until P)
                buf = pool.take(length + mlen)
                self._request(b"P", buf, 0, 0, "the next batch")
                reply = self.wait(stopping, None, doing)
        except _Gone:
            pool.give_back(buf)
            raise
        except BaseException:
            pool.discard(buf)
            raise
        if reply[:1] != b"M":
            pool.give_back(buf)
            if reply[:1] == b"F":
                return None
            raise errors.ConnectionError(reply[1:].decode("utf-8", "replace"))
        _, mlen, index, length = FRAME.unpack(reply)
        try:
            batch = dataplane.framed_batch(bytes(buf.numpy()[length:length + mlen]), index, length, self.address)
        except BaseException:
            pool.give_back(buf)
            raise
        self._frame_bytes = length + mlen
        self.last_received = datawire.HEADER.size + mlen + length
        self.bytes_received += mlen + length
        return (dataclasses.replace(batch, payload=buffers.tensors(batch, buf, length, pool.give_back)),
                self.last_received)

    def _request(self, op: bytes, buf, index: int, length: int, what: str) -> None:
        """Send op ``op`` (``REQUEST``) naming buffer ``buf`` (its fd the first time on this connection)."""
        buf_id, fd, size = self._relay.buffers.lookup(buf)
        request = REQUEST.pack(op, buf_id, index, length, size)
        try:
            if buf_id in self._sent:
                self._sock.send(request)
            else:
                _with_fd(self._sock, request, fd)
                self._sent.add(buf_id)
        except OSError:
            raise self._broken(what) from None

    def send_control(self, frame: bytes) -> None:
        """Have the relay write one control frame on the data connection (one message on the pair:
        atomic beside a ``receive`` in another thread). Raises OSError if it cannot, ValueError
        for a frame longer than the relay reads (the caller sends that one on the call)."""
        if self._closed or not self.controls:
            raise OSError("the data connection is closed" if self._closed else "no control frames over TLS")
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
                if stopping is not None and stopping.is_set():
                    self.close()
                    raise ConnectionAbortedError(f"stopped reading from {self.address}") from None
                if self._closed:
                    raise ConnectionAbortedError(f"the data connection to {self.address} was closed") from None
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
                raise ConnectionAbortedError(f"the data connection to {self.address} was closed")
            raise _Gone(f"the receive relay (pid {self.pid}) ended {doing}; the next connection starts another")

    def _broken(self, what: str) -> ConnectionError:
        if self._closed:
            return ConnectionAbortedError(f"the data connection to {self.address} was closed")
        return _Gone(f"the receive relay (pid {self.pid}) is gone (receiving {what} from {self.address}); the next "
                     f"connection starts another")


_shared: Relay | None = None
_shared_lock = threading.Lock()


def shared() -> Relay:
    """This process's relay (a forked child gets one of its own), closed at exit."""
    global _shared
    with _shared_lock:
        if _shared is None or forks.forked(_shared._owner):
            _shared = Relay()
            atexit.register(_shared.close)
        return _shared
