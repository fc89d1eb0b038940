"""A data connection's lengths are checked before a buffer is taken, and no error path leaks a
descriptor or a buffer (issue 37): through the receive relay (client/transport/relay.py, relay_child.py)
and in the trainer (client/transport/dataplane.py).

An in-band frame's header names its payload length; the relay used to take a buffer of that
length (plus the message) before anyone read the message: an 8 GiB header made a 9 GiB memfd, a
length of 2**64 - 1 raised OverflowError (not a ConnectionError: the iteration failed instead of
reconnecting) and leaked the memfd's descriptor. Now the relay sends the message first (``S``
then ``m`` answers), the trainer checks it (its size against the loader's maximum, its tensors
against the header's length: ``dataplane.framed_batch``) and only then takes a buffer. Every
error is a ConnectionError (a broken call, resumed), and after each one the process holds the
descriptors and memfds it held before (``/proc/self/fd``).

Fake data ports on 127.0.0.1:0 (``helpers.fake_data_server``), a real relay process.
"""

from __future__ import annotations

import gc
import os
import socket
import struct
import threading

import numpy as np
import pytest

from batchd import datawire, wire
from batchd.client.transport import buffers, relay
from batchd.client.transport.dataplane import DataSocket
from helpers import fake_data_server

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not relay.AVAILABLE, reason="the relay needs Linux (memfd_create)")]

GIB = 1 << 30
BATCH = wire.WireBatch(5, 0, 10, (wire.WireTensor("label", "int64", (4,), offset=0),))  # 32 bytes of payload


def message(index: int = 3, n: int = 4) -> bytes:
    return wire.encode_batch(index, 0, 10, [wire.WireTensor("label", "int64", (n,), offset=0)])


def frame(index: int, length: int, msg: bytes, payload: bytes = b"") -> bytes:
    """An in-band frame's bytes: a header naming ``length`` payload bytes, ``msg``, ``payload``."""
    return datawire.HEADER.pack(datawire.MESSAGE_MAGIC, len(msg), index, length) + msg + payload


def sends(data: bytes, *, end: str = "hold"):
    """A fake data port's script: send ``data``, then close the connection (``end="close"``),
    reset it ("reset") or hold it until the client closes it ("hold")."""
    def script(conn):
        conn.sendall(data)
        if end == "reset":
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if end != "hold":
            return
        try:
            conn.recv(1)
        except OSError:
            pass
    return script


def dial(listener, through_relay: bool, max_message: int = datawire.MAX_MESSAGE):
    port = listener.getsockname()[1]
    if through_relay:
        return relay.shared().open(f"127.0.0.1:{port}", "127.0.0.1", port, bytes(datawire.TOKEN_BYTES), tls=None,
                                   connect_timeout=5.0, timeout=5.0, max_message=max_message)
    return DataSocket.connect(f"127.0.0.1:{port}", port, bytes(datawire.TOKEN_BYTES), timeout=5.0,
                              max_message=max_message)


def memfds() -> list[int]:
    """Sizes of this process's relay buffers (memfds named batchd-relay)."""
    sizes = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:batchd-relay"):
                sizes.append(os.fstat(int(fd)).st_size)
        except OSError:
            pass
    return sizes


def open_fds() -> int:
    """This process's open descriptors, once what the collector may free was freed."""
    gc.collect()
    return len(os.listdir("/proc/self/fd"))


def pool_for(through_relay: bool) -> buffers.BufferPool:
    return buffers.BufferPool(relay.shared().buffers if through_relay else buffers.pageable)


@pytest.fixture(autouse=True)
def relay_started():
    """The relay running before a test counts descriptors (its control socket is the process's)."""
    listener, t = fake_data_server(sends(b""))
    with listener, dial(listener, True):
        pass
    t.join(5)


LENGTHS = {"8 GiB": 8 * GIB, "2**64 - 1": (1 << 64) - 1, "one byte more": 33}


@pytest.mark.parametrize("through_relay", [True, False], ids=["relay", "in-the-trainer"])
@pytest.mark.parametrize("length", LENGTHS.values(), ids=LENGTHS.keys())
def test_a_header_longer_than_its_message_says_is_a_connection_error_before_any_buffer(through_relay, length):
    pool = pool_for(through_relay)
    fds = open_fds()
    # (a frame that fits the buffer at hand is read whole before its message is checked: no buffer is taken for it)
    listener, t = fake_data_server(sends(frame(3, length, message(), bytes(length) if length < 1 << 20 else b"")))
    with listener, dial(listener, through_relay) as ds:
        with pytest.raises(ConnectionError, match=rf"sent a header for batch 3 of {length} bytes before the "
                                                  rf"message of batch 3 of 32 bytes"):
            ds.receive_next(pool, ended=lambda: False)
        assert max(memfds(), default=0) < 1 << 20, "a buffer of the header's length was taken"
    t.join(5)
    assert pool.allocated <= 1 and pool.outstanding == 0  # (the first take: the last frame's size, none yet)
    pool.clear()
    gc.collect()
    assert open_fds() == fds and memfds() == []


def test_a_buffer_that_cannot_be_made_leaks_no_descriptor():
    """``RelayBuffers`` closes its memfd whatever fails (OverflowError for 2**64 - 1 too)."""
    fds = open_fds()
    for nbytes in ((1 << 64) - 1, 1 << 62):
        with pytest.raises((OverflowError, OSError, ValueError, MemoryError)):
            relay.shared().buffers(nbytes)
    assert open_fds() == fds


def test_a_buffer_freed_in_a_thread_that_holds_the_buffers_lock_does_not_deadlock():
    """A buffer's finalizer may run wherever the garbage collector does, in a thread that holds
    ``RelayBuffers``' lock too (a collection triggered by an allocation inside it): the finalizer
    takes no lock, closes the memfd at once, and the address is forgotten by the next call. Before,
    the finalizer took the lock: this thread hung."""
    buffers_ = relay.RelayBuffers()
    buf = buffers_(4096)
    _, fd, _ = buffers_.lookup(buf)
    done = threading.Event()

    def free_inside_the_lock():
        nonlocal buf
        with buffers_._lock:
            buf = None  # its finalizer runs here, in the thread that holds the lock
        done.set()

    threading.Thread(target=free_inside_the_lock, daemon=True).start()
    assert done.wait(10), "the finalizer waited for the lock its own thread held"
    with pytest.raises(OSError):
        os.fstat(fd)  # the memfd is closed at once
    other = buffers_(4096)
    assert buffers_.lookup(other)[2] == 4096 and len(buffers_._by_address) == 1  # the freed one forgotten


ERRORS = {
    # what the server sends -> what the ConnectionError says
    "wrong magic": (b"XXXX" + bytes(20), "sent a header with magic"),
    "message past the maximum": (frame(3, 32, bytes(2000)), "message of 2000 bytes"),
    "message that does not parse": (frame(3, 32, b"\xff" * 40, bytes(32)), "does not parse"),
    "message of another batch": (frame(4, 32, message(3), bytes(32)), "header for batch 4 of 32 bytes before the "
                                                                       "message of batch 3"),
    "closed mid-message": (frame(3, 32, message())[:30], "closed its data connection"),
    "closed mid-payload": (frame(3, 32, message(), bytes(10)), "closed its data connection"),
    "reset mid-payload": (frame(3, 32, message(), bytes(10)), None),  # (closed, or broke: either words)
    "closed in a big frame": (frame(3, 8 * 70_000, message(n=70_000), bytes(1000)), "closed its data connection"),
}


@pytest.mark.parametrize("through_relay", [True, False], ids=["relay", "in-the-trainer"])
def test_every_error_on_a_data_connection_is_a_connection_error_and_leaks_nothing(through_relay):
    pool = pool_for(through_relay)
    fds = open_fds()
    for name, (data, match) in ERRORS.items():
        listener, t = fake_data_server(sends(data, end={"closed": "close", "reset": "reset"}.get(name.split()[0], "hold")))
        with listener, dial(listener, through_relay, max_message=1000) as ds:
            with pytest.raises(ConnectionError, match=match):
                ds.receive_next(pool, ended=lambda: False)
        t.join(5)
        assert pool.outstanding == 0, name
    pool.clear()
    gc.collect()
    assert open_fds() == fds and memfds() == [], "a descriptor or a relay buffer was left open"


def test_a_frame_that_fits_no_buffer_yet_comes_whole_after_its_message_was_checked():
    """The ``S`` path with a good frame: the message comes first, then a buffer of its size."""
    pool = pool_for(True)
    n = 100_000
    listener, t = fake_data_server(sends(frame(3, 8 * n, message(n=n), np.arange(n, dtype=np.int64).tobytes())))
    with listener, dial(listener, True) as ds:
        batch, nbytes = ds.receive_next(pool, ended=lambda: False)
        assert batch.batch_index == 3 and np.array_equal(batch.payload["label"].numpy(), np.arange(n))
        assert nbytes == datawire.HEADER.size + len(message(n=n)) + 8 * n
    t.join(5)
