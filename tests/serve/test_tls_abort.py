"""TLS on the data plane never falls back to plain bytes when a connection is aborted from another
thread (issue 37; ``batchd.sockets``).

``SSLSocket.shutdown`` / ``close`` drop the socket's TLS object before the kernel shutdown, and
``SSLSocket.send`` / ``recv_into`` without one use the plain socket. The window between the two
is a few bytecodes; a tracer (``widened``) sleeps in it, inside the standard library's ``ssl``
module only, so that every abort that reaches it shows what a lucky race shows (3 of 300 aborts
without the tracer):

* server: a ``DataConnection`` sending 16 MiB batches over TLS through a recording proxy is
  aborted (``DataPlane.close`` does this) mid-send, again and again; the proxy's record of every
  connection must parse as TLS records to its end (a cut last record allowed), with no payload
  pattern anywhere in it;
* client: a ``DataSocket`` receiving over TLS is closed from another thread mid-receive: each
  receive either returns the batch's exact bytes or raises ConnectionAbortedError, never raw TLS
  records taken as batch bytes.
"""

from __future__ import annotations

import contextlib
import random
import select
import socket
import ssl
import sys
import threading
import time

import numpy as np
import pytest

from batchd import datawire, wire
from batchd.client.transport import buffers
from batchd.client.transport.channel import TLS
from batchd.client.transport.dataplane import DataSocket
from batchd.server.config import TlsConfig
from batchd.server.serve.dataplane import DataPlane, tls_context
from batchd.server.shm import SlotPool

pytestmark = pytest.mark.timeout(120)

PATTERN = b"PLAINTEXT-BYTES!"  # the payload: this, over and over (never found in ciphertext by chance)
NBYTES = 16 << 20
WIDEN_S = 0.05  # the sleep put between ``_sslobj = None`` and the kernel's shutdown / close
ROUNDS = 12
_TLS_DROPS = {ssl.SSLSocket.shutdown.__code__, ssl.SSLSocket._real_close.__code__, ssl.SSLSocket.unwrap.__code__}


def _widen(frame, event, arg):
    """A trace function: in SSLSocket.shutdown / _real_close / unwrap, sleep once right after the
    line that dropped the TLS object (the race's window, made wide)."""
    if event != "call" or frame.f_code not in _TLS_DROPS:
        return None
    slept = []

    def local(frame, event, arg):
        me = frame.f_locals.get("self")
        if event == "line" and not slept and me is not None and me.__dict__.get("_sslobj", 1) is None:
            slept.append(True)
            time.sleep(WIDEN_S)
        return local

    return local


def widened(fn) -> threading.Thread:
    """``fn`` in a thread of its own, traced by ``_widen``; started."""

    def run():
        sys.settrace(_widen)
        try:
            fn()
        finally:
            sys.settrace(None)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def tls_records(stream: bytes) -> int:
    """Bytes of ``stream`` that parse as TLS records from its start (the record layer, RFC 8446
    5.1: type 20-23, version 3.x, length <= 2**14 + 256); a last record cut short counts (the
    connection was aborted in it)."""
    at = 0
    while at + 5 <= len(stream):
        kind, major, length = stream[at], stream[at + 1], int.from_bytes(stream[at + 3 : at + 5], "big")
        if kind not in (20, 21, 22, 23) or major != 3 or length > (1 << 14) + 256:
            return at
        at += 5 + length
    return len(stream) if at >= len(stream) or len(stream) - at < 5 else at


def test_the_record_parser_finds_plain_bytes():
    record = bytes([23, 3, 3, 0, 4]) + b"abcd"
    assert tls_records(record * 3) == 27 and tls_records(record + record[:7]) == 16  # (a cut last record)
    assert tls_records(record + PATTERN * 2) == 9


class RecordingProxy:
    """127.0.0.1:port -> 127.0.0.1:target, one thread per connection; ``records[i]`` are the
    bytes the target sent on connection i."""

    def __init__(self, target: int):
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.records: list[bytearray] = []
        self.threads: list[threading.Thread] = []
        self._accept = threading.Thread(target=self._run, daemon=True)
        self._accept.start()

    def _run(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target))
            record = bytearray()
            self.records.append(record)
            t = threading.Thread(target=self._pump, args=(client, server, record), daemon=True)
            t.start()
            self.threads.append(t)

    @staticmethod
    def _pump(client: socket.socket, server: socket.socket, record: bytearray) -> None:
        peer = {client: server, server: client}
        with client, server:
            while True:
                ready, _, _ = select.select([client, server], [], [], 10)
                if not ready:
                    return
                for s in ready:
                    try:
                        data = s.recv(1 << 20)
                    except OSError:
                        data = b""
                    if not data:
                        return
                    if s is server:
                        record += data
                    try:
                        peer[s].sendall(data)
                    except OSError:
                        return

    def close(self) -> None:
        self.listener.close()
        for t in self.threads:
            t.join(15)


def patterned_slot(slots: SlotPool):
    slot = slots.acquire(NBYTES)
    slot.buf[:NBYTES] = PATTERN * (NBYTES // len(PATTERN))
    pieces, length = datawire.payload_layout([(0, NBYTES)])
    return slot, pieces, length


def test_an_aborted_tls_connection_sends_no_byte_outside_tls_records(slots, pki):
    """Server side: ``DataConnection.abort`` from another thread, mid-send, ``ROUNDS`` times."""
    slot, pieces, length = patterned_slot(slots)
    ctx = tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"]))
    client_ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    rng = random.Random(0)
    plane = DataPlane("127.0.0.1", 0, ssl_context=ctx)
    proxy = RecordingProxy(plane.port)
    outcomes = []
    try:
        for _ in range(ROUNDS):
            ticket = plane.expect()
            raw = socket.create_connection(("127.0.0.1", proxy.port), timeout=10)
            client = client_ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            client.sendall(ticket.token)
            connection = ticket.wait()
            sent: list = []

            def send_until_broken(connection=connection, sent=sent):
                try:
                    while True:
                        connection.send(0, slot, pieces, length)
                        sent.append(length)
                except BaseException as e:
                    sent.append(e)

            sender = threading.Thread(target=send_until_broken, daemon=True)
            sender.start()

            def drain(client=client):
                with contextlib.suppress(OSError, ssl.SSLError):
                    while client.recv(1 << 20):
                        pass

            reader = threading.Thread(target=drain, daemon=True)
            reader.start()
            time.sleep(rng.uniform(0.01, 0.08))  # mid-send: a batch takes some 20-100 ms through the proxy
            widened(connection.abort).join(10)
            sender.join(10)
            assert not sender.is_alive(), "the send did not end after the abort"
            outcomes.append(sent[-1])
            connection.close()
            client.close()
            reader.join(10)
    finally:
        plane.close()
        proxy.close()
        slots.release(slot)
    assert all(isinstance(o, ConnectionError) for o in outcomes), outcomes  # each send ended with the abort
    for i, record in enumerate(proxy.records):
        stream = bytes(record)
        parsed = tls_records(stream)
        assert parsed == len(stream) and PATTERN not in stream, (
            f"connection {i}: {len(stream) - parsed} bytes outside TLS records after byte {parsed} of {len(stream)}; "
            f"payload pattern in clear: {PATTERN in stream}")


def test_a_tls_receive_closed_from_another_thread_never_takes_records_for_batch_bytes(slots, pki):
    """Client side: ``DataSocket.close`` from another thread mid-receive, ``ROUNDS`` times."""
    slot, pieces, length = patterned_slot(slots)
    batch = wire.WireBatch(0, 0, 10, (wire.WireTensor("data", "uint8", (NBYTES,), offset=0),))
    expected = np.frombuffer(PATTERN * (NBYTES // len(PATTERN)), dtype=np.uint8)
    ctx = tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"]))
    rng = random.Random(1)
    plane = DataPlane("127.0.0.1", 0, ssl_context=ctx)
    wrong, aborted = [], 0
    try:
        for _ in range(ROUNDS):
            ticket = plane.expect()
            ds = DataSocket.connect(f"127.0.0.1:{plane.port}", plane.port, ticket.token, tls=TLS(ca=pki["ca"]),
                                    timeout=10)
            connection = ticket.wait()

            def send_until_broken(connection=connection):
                with contextlib.suppress(ConnectionError, OSError):
                    while True:
                        connection.send(0, slot, pieces, length)

            sender = threading.Thread(target=send_until_broken, daemon=True)
            sender.start()
            pool = buffers.BufferPool()
            results: list = []

            def receive_until_broken(ds=ds, pool=pool, results=results):
                try:
                    while True:
                        got = ds.receive(batch, pool)["data"].numpy()
                        results.append(bool(np.array_equal(got, expected)))
                except BaseException as e:
                    results.append(e)

            receiver = threading.Thread(target=receive_until_broken, daemon=True)
            receiver.start()
            time.sleep(rng.uniform(0.01, 0.08))
            widened(ds.close).join(10)
            receiver.join(10)
            assert not receiver.is_alive(), "the receive did not end after the close"
            connection.abort()
            sender.join(10)
            connection.close()
            wrong += [r for r in results if r is not True and not isinstance(r, ConnectionAbortedError)]
            aborted += isinstance(results[-1], ConnectionAbortedError)
    finally:
        plane.close()
        slots.release(slot)
    assert not wrong, f"receives that returned other bytes or failed otherwise than closed: {wrong}"
    assert aborted == ROUNDS
