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
* ``RelayBuffers`` makes the receive buffers (memfd-backed): a buffer's fd goes to the relay once
  per connection, which maps it once, so a buffer reused batch after batch costs no page faults.
* ``RelayedSocket`` is one connection, with ``DataSocket``'s interface (relayed_socket.py).

Failure: a relay that dies (killed, out of memory) breaks the connections it held: each
``receive`` raises ConnectionError naming the relay, which the loader resumes as any broken call
(the batches granted again: nothing lost or repeated; tests/client/test_relay.py kills it with
SIGKILL mid-epoch), and the next connection starts a new relay (logged; ``Relay.started``
counts).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import json
import logging
import mmap
import os
import pathlib
import queue
import socket
import subprocess
import sys
import threading
import weakref

import numpy as np
import torch

from batchd import datawire, errors
from batchd.client import forks
from batchd.client.transport.channel import TLS
from batchd.client.transport.dataplane import SLICE_S
from batchd.client.transport.relayed_socket import RelayedSocket, send_with_fd

log = logging.getLogger("batchd.client.loader")
CHILD = pathlib.Path(__file__).with_name("relay_child.py")
AVAILABLE = sys.platform.startswith("linux") and hasattr(os, "memfd_create")


class RelayBuffers:
    """``allocate`` for a ``BufferPool`` whose buffers the relay writes: each a uint8 [nbytes]
    tensor over a memfd mapping, with an id and the fd to pass (``lookup``). Thread-safe. A buffer's
    finalizer takes no lock (the garbage collector may run it in a thread that holds ``_lock``):
    it closes the memfd and queues the address, forgotten under the lock by the next call."""

    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._by_address: dict[int, tuple[int, int, int]] = {}  # data_ptr -> (id, fd, size)
        self._dropped: queue.SimpleQueue = queue.SimpleQueue()  # addresses of buffers gone (finalizers)

    def __call__(self, nbytes: int) -> torch.Tensor:
        """A buffer of ``nbytes``. Raises what the memfd, its size or its mapping raised (OSError,
        OverflowError, ValueError...), its descriptor closed."""
        fd = os.memfd_create("batchd-relay", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            mm = mmap.mmap(fd, nbytes)
            try:
                buf = torch.from_numpy(np.frombuffer(mm, dtype=np.uint8))  # keeps the mapping alive
            except BaseException:
                mm.close()
                raise
        except BaseException:  # (OverflowError too: a length past 2**63 leaked the descriptor)
            os.close(fd)
            raise
        address = buf.data_ptr()
        with self._lock:
            self._forget_dropped()  # (before: a freed buffer's address may be this one's)
            self._by_address[address] = (next(self._ids), fd, nbytes)
        weakref.finalize(buf, self._drop, address, fd)
        return buf

    def lookup(self, buf: torch.Tensor) -> tuple[int, int, int]:
        """(id, fd, size) of a buffer this made. KeyError for another."""
        with self._lock:
            self._forget_dropped()
            return self._by_address[buf.data_ptr()]

    def _drop(self, address: int, fd: int) -> None:
        """A buffer's finalizer: no lock (class docstring)."""
        os.close(fd)
        self._dropped.put(address)

    def _forget_dropped(self) -> None:  # (under _lock)
        while True:
            try:
                self._by_address.pop(self._dropped.get_nowait(), None)
            except queue.Empty:
                return


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
        if self.alive():
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
             connect_timeout: float, timeout: float, max_message: int = datawire.MAX_MESSAGE) -> RelayedSocket:
        """A data connection to ``port`` on ``host`` (``address``'s, named in errors), dialed by
        the relay, TLS if ``tls``, ``token`` presented, within ``connect_timeout`` seconds;
        in-band Batch messages of at most ``max_message`` bytes. Raises ConnectionError (the
        server cannot be reached, the handshake failed, the relay could not be started or died)."""
        spec = {"address": address, "host": host, "port": port, "token": token.hex(), "max_message": max_message,
                "connect_timeout": connect_timeout, "timeout": timeout,
                "tls": None if tls is None else dataclasses.asdict(tls)}  # (paths: ``os.fspath`` below)
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with self._lock:  # the relay alive and the connection handed to it: one decision
                control = self._start()
                pid = self._proc.pid
                try:
                    send_with_fd(control, json.dumps(spec, default=os.fspath).encode(), theirs.fileno())
                except OSError:
                    raise errors.ConnectionError(f"the receive relay (pid {pid}) is gone; opening a data connection to "
                                                 f"{address} again starts another") from None
        except BaseException:
            mine.close()
            raise
        finally:
            theirs.close()
        sock = RelayedSocket(mine, address, timeout, self, pid, tls is not None, max_message)
        try:
            reply = sock.wait(None, connect_timeout + 5.0, f"opening a data connection to {address}")
            if reply[:1] != b"O":
                raise sock.error(reply)
        except BaseException:
            sock.close()
            raise
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
