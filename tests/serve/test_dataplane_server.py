"""The data plane's server side (server/serve/dataplane.py) over real sockets: a slot's batch
reaches the client that presents its call's token, plain (sendfile) and TLS; no one else gets a
byte (no token, a wrong, reused, late or withdrawn token, plaintext to a TLS plane, mutual TLS
without the right certificate); a send to a client that stopped reading ends when its call is
cancelled or the plane closes; nothing hangs."""

from __future__ import annotations

import socket
import ssl
import threading
import time

import numpy as np
import pytest

from batchd import datawire
from batchd.server.config import ConfigError, DataPlaneConfig, ServerConfig, TlsConfig, load_config
from batchd.server.serve.dataplane import DataPlane, tls_context
from batchd.server.shm import SlotPool
from helpers import data_plane as plane

pytestmark = pytest.mark.timeout(60)


def batch_in(slots: SlotPool, rng: np.random.Generator):
    """A slot holding three tensors at slot offsets with gaps, the gaps full of 0xAB (another
    batch's leftovers): label int64 [8] at 0, image uint8 [8, 96, 96, 3] at 4096, and a 100-byte
    field at the end. Returns (slot, pieces, length, expected payload bytes)."""
    label = rng.integers(0, 10, 8).astype(np.int64).tobytes()
    image = rng.integers(0, 256, 8 * 96 * 96 * 3, dtype=np.uint8).tobytes()
    tail = rng.integers(0, 256, 100, dtype=np.uint8).tobytes()
    at = [(0, label), (4096, image), (4096 + len(image) + 1000, tail)]
    slot = slots.acquire(at[-1][0] + len(tail) + 500)
    slot.buf[:] = b"\xab" * slot.capacity
    for offset, data in at:
        slot.buf[offset : offset + len(data)] = data
    pieces, length = datawire.payload_layout([(offset, len(data)) for offset, data in at])
    expected = bytearray(length)
    for piece, (_, data) in zip(pieces, at):
        expected[piece.offset : piece.offset + piece.nbytes] = data
    return slot, pieces, length, bytes(expected)


def client_tls(pki, cert: str | None = None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki["ca"]))
    if cert is not None:
        ctx.load_cert_chain(str(pki[f"{cert}_cert"]), str(pki[f"{cert}_key"]))
    return ctx


def dial(p: DataPlane, token: bytes | None, ctx: ssl.SSLContext | None = None) -> socket.socket:
    """A connection to the plane (TLS with ``ctx``) that sent ``token`` (nothing if None)."""
    s = socket.create_connection(("127.0.0.1", p.port), timeout=5)
    if ctx is not None:
        s = ctx.wrap_socket(s, server_hostname="127.0.0.1")
    if token is not None:
        s.sendall(token)
    return s


def read_all(s: socket.socket, limit: int, timeout: float = 5.0) -> bytes:
    """What ``s`` brings until it closes, ``limit`` bytes, or ``timeout`` seconds pass."""
    out = bytearray()
    deadline = time.monotonic() + timeout
    while len(out) < limit and time.monotonic() < deadline:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = s.recv(limit - len(out))
        except (TimeoutError, ssl.SSLError, ConnectionResetError):
            break
        if not chunk:
            break
        out += chunk
    return bytes(out)


# --- config -------------------------------------------------------------------------------------


def test_the_config_block(tmp_path):
    assert ServerConfig().data_plane == DataPlaneConfig(enabled=True, port=None, token_ttl_s=10.0, first_byte_timeout_s=2.0,
                                                        handshake_timeout_s=5.0, max_handshakes=1024,
                                                        max_handshakes_per_source=64)
    assert DataPlaneConfig().port_for(50051) == 50052 and DataPlaneConfig().port_for(0) == 0
    assert DataPlaneConfig(port=0).port_for(50051) == 0 and DataPlaneConfig(port=7).port_for(50051) == 7
    with pytest.raises(ValueError, match="65535"):
        DataPlaneConfig().port_for(65535)
    path = tmp_path / "c.yaml"
    path.write_text("datasets: {}\ndata_plane: {port: 50052}\n")
    assert load_config(path).data_plane.port == 50052
    path.write_text("datasets: {}\ndata_plane: {port: 70000}\n")
    with pytest.raises(ConfigError, match=r"data_plane\.port"):
        load_config(path)
    path.write_text("datasets: {}\ndata_plane: {prot: 1}\n")
    with pytest.raises(ConfigError, match=r"data_plane\.prot"):
        load_config(path)
    path.write_text("datasets: {}\ndata_plane: {first_byte_timeout_s: 9, handshake_timeout_s: 3}\n")
    with pytest.raises(ConfigError, match="first_byte_timeout_s"):
        load_config(path)


# --- what a client with its token gets ----------------------------------------------------------


@pytest.mark.parametrize("tls", [False, True], ids=["plain", "tls"])
def test_the_token_holder_gets_header_and_payload_and_nothing_of_the_slot_between(slots, pki, tls):
    rng = np.random.default_rng(0)
    ctx = tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"])) if tls else None
    with plane(ssl_context=ctx) as p:
        ticket = p.expect()
        assert len(ticket.token) == datawire.TOKEN_BYTES
        s = dial(p, ticket.token, client_tls(pki) if tls else None)
        connection = ticket.wait()
        assert connection.tls is tls
        sent = []
        for b in (7, 8):
            slot, pieces, length, expected = batch_in(slots, rng)
            connection.send(b, slot, pieces, length)
            slots.release(slot)
            sent.append((b, length, expected))
        got = read_all(s, sum(datawire.HEADER.size + n for _, n, _ in sent))
        connection.close()
        assert read_all(s, 1) == b""  # the end of the call closes the connection
        s.close()
        at = 0
        for b, length, expected in sent:
            assert datawire.unpack_header(got[at : at + 24]) == (datawire.MAGIC, b, length)
            payload = got[at + 24 : at + 24 + length]
            assert payload == expected  # tensors at 64-byte offsets, zeros between: no 0xAB
            at += 24 + length
        assert at == len(got)
        assert p.stats()["bytes_sent"] == at and p.stats()["connections_accepted"] == 1


def test_a_batch_of_small_tensors_only_and_an_empty_batch(slots):
    with plane() as p:
        ticket = p.expect()
        s = dial(p, ticket.token)
        connection = ticket.wait()
        slot = slots.acquire(1024)
        slot.buf[:16] = bytes(range(16))
        pieces, length = datawire.payload_layout([(0, 16), (200, 0)])
        connection.send(1, slot, pieces, length)
        connection.send(2, slot, [], 0)
        assert length == 64  # the empty field starts at the next 64 bytes
        got = read_all(s, 24 + 64 + 24)
        assert datawire.unpack_header(got[:24]) == (datawire.MAGIC, 1, 64)
        assert got[24:88] == bytes(range(16)) + bytes(48)
        assert datawire.unpack_header(got[88:]) == (datawire.MAGIC, 2, 0)
        connection.close()
        s.close()
        slots.release(slot)


# --- who gets nothing ---------------------------------------------------------------------------


def test_no_wrong_reused_late_or_withdrawn_token_gets_a_byte(slots):
    with plane(handshake_timeout_s=0.5) as p:
        ticket = p.expect()
        silent = dial(p, None)
        wrong = dial(p, bytes(32))
        short = dial(p, ticket.token[:16])  # half the token, then nothing: the handshake times out
        assert read_all(wrong, 1) == b"" and read_all(silent, 1) == b"" and read_all(short, 1) == b""
        holder = dial(p, ticket.token)
        connection = ticket.wait()
        reused = dial(p, ticket.token)
        assert read_all(reused, 1) == b""
        slot, pieces, length, _ = batch_in(slots, np.random.default_rng(1))
        connection.send(0, slot, pieces, length)
        assert len(read_all(holder, 24 + length)) == 24 + length  # the holder's connection still works

        withdrawn = p.expect()
        withdrawn.close()  # its call ended before the client connected
        assert read_all(dial(p, withdrawn.token), 1) == b""
        with pytest.raises(ConnectionAbortedError):
            withdrawn.wait()
        assert p.stats()["connections_refused"] == 5 and p.stats()["connections_accepted"] == 1
        for s in (silent, wrong, short, holder, reused):
            s.close()
        connection.close()
        slots.release(slot)
    with plane(token_ttl_s=0.3) as p:
        late = p.expect()
        time.sleep(0.5)
        latecomer = dial(p, late.token)
        assert read_all(latecomer, 1) == b""
        latecomer.close()
        with pytest.raises(ConnectionError, match="did not open its data connection within 0.3 s"):
            late.wait()


def test_plaintext_to_a_tls_plane_gets_no_batch_bytes_and_spends_no_token(slots, pki):
    ctx = tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"]))
    with plane(ssl_context=ctx, handshake_timeout_s=2) as p:
        ticket = p.expect()
        plain = dial(p, ticket.token)  # the right token, stolen, sent in clear
        leaked = read_all(plain, 1 << 20)
        assert datawire.MAGIC not in leaked and len(leaked) < 64  # at most a TLS alert
        plain.close()
        holder = dial(p, ticket.token, client_tls(pki))  # the token was not spent
        connection = ticket.wait()
        slot, pieces, length, expected = batch_in(slots, np.random.default_rng(2))
        connection.send(3, slot, pieces, length)
        assert read_all(holder, 24 + length)[24:] == expected
        holder.close()
        connection.close()
        slots.release(slot)


def test_mutual_tls_needs_a_client_certificate_from_the_ca(slots, pki):
    ctx = tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"], client_ca=pki["ca"],
                                require_client_cert=True))
    with plane(ssl_context=ctx, handshake_timeout_s=2) as p:
        ticket = p.expect()
        for cert in (None, "rogue"):
            try:
                s = dial(p, ticket.token, client_tls(pki, cert))
            except (ssl.SSLError, ConnectionError):
                continue  # refused in the handshake (TLS 1.2)
            leaked = read_all(s, 1 << 20)  # TLS 1.3: the client learns it was refused on its first read
            assert datawire.MAGIC not in leaked and len(leaked) == 0
            s.close()
        holder = dial(p, ticket.token, client_tls(pki, "client"))
        connection = ticket.wait()
        slot, pieces, length, expected = batch_in(slots, np.random.default_rng(3))
        connection.send(4, slot, pieces, length)
        assert read_all(holder, 24 + length)[24:] == expected
        assert p.stats()["connections_refused"] == 2
        holder.close()
        connection.close()
        slots.release(slot)


# --- never hang ---------------------------------------------------------------------------------


def big_slot(slots: SlotPool, nbytes: int = 64 << 20):
    slot = slots.acquire(nbytes)
    pieces, length = datawire.payload_layout([(0, nbytes)])
    return slot, pieces, length


def blocked_send(connection, slot, pieces, length, cancelled=lambda: False):
    """Start sending in a thread; returns (thread, list that gets the exception or "done")."""
    result: list = []

    def run():
        try:
            connection.send(0, slot, pieces, length, cancelled)
            result.append("done")
        except BaseException as e:
            result.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, result


def test_a_send_to_a_client_that_stopped_reading_waits_until_the_call_is_cancelled(slots):
    with plane() as p:
        ticket = p.expect()
        s = dial(p, ticket.token)
        connection = ticket.wait()
        slot, pieces, length = big_slot(slots)
        cancel = threading.Event()
        t, result = blocked_send(connection, slot, pieces, length, cancel.is_set)
        t.join(1.0)
        assert t.is_alive() and not result  # the client's call is alive: the send waits
        cancel.set()
        t.join(2.0)
        assert not t.is_alive() and isinstance(result[0], ConnectionAbortedError)
        connection.close()
        s.close()
        slots.release(slot)


def test_close_ends_a_blocked_send_a_waiting_ticket_and_every_thread(slots):
    p = DataPlane("127.0.0.1", 0, handshake_timeout_s=30)
    ticket = p.expect()
    s = dial(p, ticket.token)
    connection = ticket.wait()
    slot, pieces, length = big_slot(slots)
    t, result = blocked_send(connection, slot, pieces, length)
    waiting = p.expect()
    waited: list = []
    w = threading.Thread(target=lambda: waited.append(pytest.raises(ConnectionAbortedError, waiting.wait)))
    w.start()
    stuck = socket.create_connection(("127.0.0.1", p.port))  # in its handshake, sends nothing
    time.sleep(0.5)
    t0 = time.monotonic()
    p.close()
    took = time.monotonic() - t0
    t.join(2.0)
    w.join(2.0)
    assert not t.is_alive() and isinstance(result[0], ConnectionError)
    assert not w.is_alive() and waited
    assert took < 5  # the handshake thread was woken, not waited out (its timeout is 30 s)
    assert not [th for th in threading.enumerate() if th.name.startswith("batchd-data")]
    with pytest.raises(ConnectionAbortedError):
        p.expect()
    connection.close()
    for sock in (s, stuck):
        sock.close()
    slots.release(slot)


def test_a_client_that_goes_away_mid_batch_fails_the_send(slots):
    with plane() as p:
        ticket = p.expect()
        s = dial(p, ticket.token)
        connection = ticket.wait()
        slot, pieces, length = big_slot(slots)
        t, result = blocked_send(connection, slot, pieces, length)
        read_all(s, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
        s.close()
        t.join(5.0)
        assert not t.is_alive() and isinstance(result[0], ConnectionError)
        connection.close()
        slots.release(slot)


# --- in the server ------------------------------------------------------------------------------


def test_a_server_listens_on_its_data_port_with_its_tls_and_closes_it_on_stop(make_server, pki, tmp_path):
    from batchd.server.serve.dataplane import listen_host

    server = make_server(datasets={}, workers=1)
    assert server.data_plane is not None and not server.data_plane.tls
    assert server.data_address == f"127.0.0.1:{server.data_plane.port}"
    port = server.data_plane.port
    server.stop(grace=0)
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.1", port), timeout=2)
    secure = make_server(datasets={}, workers=1, tls={"cert": str(pki["server_cert"]), "key": str(pki["server_key"])})
    assert secure.data_plane.tls
    assert make_server(datasets={}, workers=1, data_plane={"enabled": False}).data_plane is None
    assert make_server(datasets={}, workers=1, address=f"unix:{tmp_path}/s.sock").data_plane is None
    assert listen_host(["unix:/x.sock", "[::]:50051"]) == "::" and listen_host(["0.0.0.0:1"]) == "0.0.0.0"
    fixed = make_server(datasets={}, workers=1, data_plane={"port": port})  # free again: the stop closed it
    assert fixed.data_plane.port == port
