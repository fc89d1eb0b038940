"""The data plane's pending connections (server/serve/handshakes.py; issue 37): one thread reads
them all, so idle connections cost no thread; a flood evicts the oldest pending connection, never
a trainer that sends its token at once; one source address is capped, not the others; the
first-byte and handshake deadlines hold (a slow drip too); the accept loop outlives a failed
thread start, an error on one connection and EMFILE; the server listens on the gRPC port + 1
and warns of plain TCP; ``Server.stop`` closes the loader whatever the data plane raised."""

from __future__ import annotations

import json
import logging
import select
import socket
import ssl
import subprocess
import sys
import threading
import time

import pytest

from batchd.server.serve import dataplane
from batchd.server.serve.dataplane import DataPlane
from helpers import data_plane as plane
from helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(90)


def idle(p: DataPlane, source: str = "127.0.0.1") -> socket.socket:
    return socket.create_connection(("127.0.0.1", p.port), timeout=5, source_address=(source, 0))


def closed(s: socket.socket, timeout: float = 3.0) -> bool:
    """Whether the server closed ``s`` (EOF or reset) within ``timeout`` seconds (what it sent
    before, a TLS handshake's answer, is read and dropped)."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        s.settimeout(left)
        try:
            if s.recv(65536) == b"":
                return True
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False
    return False


def still_open(s: socket.socket) -> bool:
    s.setblocking(False)
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        s.setblocking(True)


def data_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("batchd-data")]


def test_idle_connections_cost_no_thread_and_a_flood_evicts_the_oldest_never_a_trainer():
    with plane(max_handshakes=8, max_handshakes_per_source=10_000, first_byte_timeout_s=30,
               handshake_timeout_s=30) as p:
        threads = data_threads()
        assert threads == ["batchd-data-accept"]
        held = [idle(p) for _ in range(8)]
        assert wait_until(lambda: p.stats()["handshakes"] == 8, 5)
        assert data_threads() == threads  # eight idle connections: no thread of their own
        ticket = p.expect()
        trainer = idle(p)  # a ninth: the oldest goes, the trainer sends its token at once
        trainer.sendall(ticket.token)
        connection = ticket.wait()
        assert closed(held[0]) and all(still_open(s) for s in held[1:])
        flood = [idle(p) for _ in range(200)]  # far beyond the table: it never holds more than 8
        assert wait_until(lambda: p.stats()["handshakes"] <= 8 and p.stats()["handshakes_evicted"] >= 200, 10)
        late = p.expect()  # a trainer amid the flood still gets in
        s = idle(p)
        s.sendall(late.token)
        late.wait().close()
        assert data_threads() == threads
        for sock in (*held, *flood, trainer, s):
            sock.close()
        assert wait_until(lambda: p.stats()["handshakes"] == 0, 5)
        connection.close()
        assert p.stats()["connections_accepted"] == 2


def test_one_source_is_capped_and_its_oldest_evicted_not_another_sources():
    with plane(max_handshakes=100, max_handshakes_per_source=3, first_byte_timeout_s=30,
               handshake_timeout_s=30) as p:
        theirs = [idle(p, "127.0.0.2") for _ in range(3)]
        ours = [idle(p) for _ in range(3)]
        assert wait_until(lambda: p.stats()["handshakes"] == 6, 5)
        fourth = idle(p, "127.0.0.2")
        assert closed(theirs[0])
        assert all(still_open(s) for s in (*theirs[1:], *ours, fourth))
        assert p.stats()["handshakes_evicted"] == 1
        for s in (*theirs, *ours, fourth):
            s.close()


def test_no_first_byte_in_time_or_a_slow_drip_past_the_handshake_deadline_is_closed(pki):
    from batchd.server.config import TlsConfig

    ctx = dataplane.tls_context(TlsConfig(cert=pki["server_cert"], key=pki["server_key"]))
    for tls in (None, ctx):
        with plane(ssl_context=tls, first_byte_timeout_s=0.3, handshake_timeout_s=1.5, token_ttl_s=0.5) as p:
            ticket = p.expect()
            silent, drip = idle(p), idle(p)
            t0 = time.monotonic()
            if tls is None:
                drip.sendall(ticket.token[:1])  # then a byte every 0.2 s: 6 s for the token
                dripping = threading.Thread(target=lambda: [(time.sleep(0.2), drip.send(ticket.token[i:i + 1]))
                                                            for i in range(1, 8)], daemon=True)
            else:  # a ClientHello, then silence: the handshake never ends
                incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
                client = ssl.create_default_context(cafile=str(pki["ca"])).wrap_bio(
                    incoming, outgoing, server_hostname="127.0.0.1")
                with pytest.raises(ssl.SSLWantReadError):
                    client.do_handshake()
                drip.sendall(outgoing.read())
                dripping = threading.Thread(target=lambda: None)
            dripping.start()
            assert closed(silent, 3) and 0.25 < time.monotonic() - t0 < 1.4  # the first-byte deadline
            assert closed(drip, 5) and 1.4 < time.monotonic() - t0 < 3.5  # it began: the whole handshake's
            dripping.join()
            assert p.stats()["handshakes_timed_out"] == 2 and p.stats()["connections_accepted"] == 0
            with pytest.raises(ConnectionError):
                ticket.wait()  # (its token was never presented whole: the call gets no connection)


class _Control:
    def __init__(self):
        self.failed = []

    def fail(self, e):
        self.failed.append(e)


def test_a_failed_thread_start_or_an_error_on_one_connection_leaves_the_accept_loop_running(monkeypatch):
    with plane() as p:
        start = threading.Thread.start

        def no_control_threads(self):
            if self.name == "batchd-data-control":
                raise RuntimeError("can't start new thread")
            start(self)

        monkeypatch.setattr(threading.Thread, "start", no_control_threads)
        control = _Control()
        ticket = p.expect(control)
        s = idle(p)
        s.sendall(ticket.token)
        assert wait_until(lambda: control.failed, 5)  # that call ends (it cannot read its grants there)
        assert isinstance(control.failed[0], ConnectionError) and closed(s)
        monkeypatch.setattr(threading.Thread, "start", start)

        calls = []
        token_read = p._token_read

        def broken_once(*a):
            calls.append(1)
            if len(calls) == 1:
                raise ValueError("a bug of ours, on one connection")
            return token_read(*a)

        p._handshakes._on_token = broken_once
        first, second = p.expect(), p.expect()
        a = idle(p)
        a.sendall(first.token)
        assert wait_until(lambda: len(calls) == 1, 5) and closed(a)
        b = idle(p)
        b.sendall(second.token)
        second.wait().close()  # the next connection got through
        for sock in (s, a, b):
            sock.close()
        assert p._handshakes._thread.is_alive() and p.stats()["connections_refused"] == 1


EMFILE_SCRIPT = r"""
import json, resource, sys, time
sys.path[:0] = SYS_PATH
from batchd.server.serve.dataplane import DataPlane
p = DataPlane("127.0.0.1", 0, max_handshakes=10_000, first_byte_timeout_s=30, handshake_timeout_s=30)
import os
used = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (used + 12, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
tickets = [p.expect() for _ in range(1)]
print(json.dumps({"port": p.port, "token": tickets[0].token.hex()}), flush=True)
connection = tickets[0].wait()
print(json.dumps({"claimed": True, **p.stats()}), flush=True)
sys.stdin.readline()
connection.close()
p.close()
"""


def test_the_accept_loop_outlives_emfile():
    """A process out of file descriptors: the oldest pending connection is evicted, accepts pause,
    and a trainer's connection still gets through (its client dials again, as a refused one does)."""
    script = EMFILE_SCRIPT.replace("SYS_PATH", repr(sys.path))
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        first = json.loads(proc.stdout.readline())
        port, token = first["port"], bytes.fromhex(first["token"])
        flood = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(40)]  # past its 12 spare fds
        time.sleep(0.5)
        got = None
        for _ in range(40):  # a trainer dials again while refused
            s = socket.create_connection(("127.0.0.1", port), timeout=5)
            s.sendall(token)
            if not closed(s, 0.3):
                got = s
                break
            s.close()
        assert got is not None, "the trainer never got through"
        assert select.select([proc.stdout], [], [], 30)[0], "the plane never claimed the trainer's connection"
        claimed = json.loads(proc.stdout.readline())
        assert claimed["claimed"] and claimed["handshakes_evicted"] >= 1, claimed
        proc.stdin.close()
        assert proc.wait(10) == 0
        for s in (*flood, got):
            s.close()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# --- in the server ------------------------------------------------------------------------------


def test_the_data_port_is_the_grpc_port_plus_one_and_plain_tcp_beyond_loopback_is_warned(make_server, caplog):
    port = free_port()
    server = make_server(datasets={}, workers=1, address=f"127.0.0.1:{port}")
    assert server.data_plane.port == port + 1 and server.data_address == f"127.0.0.1:{port + 1}"
    assert make_server(datasets={}, workers=1).data_plane.port != 1  # gRPC port 0: a free one
    blocker = socket.create_server(("127.0.0.1", 0))
    taken = blocker.getsockname()[1]
    with blocker, pytest.raises(RuntimeError, match=r"data_plane\.port is the gRPC port \+ 1 unless set"):
        make_server(datasets={}, workers=1, address=f"127.0.0.1:{taken - 1}")
    with caplog.at_level(logging.INFO, logger="batchd.server"):
        server._log_security()
    assert "plain TCP" in caplog.text and "data plane on 127.0.0.1" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING and "data plane" in r.message]
    server.data_plane.host = "10.1.2.3"  # (as if listening beyond loopback: the address is only read for the log)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="batchd.server"):
        server._log_security()
    assert "data plane on 10.1.2.3:" in caplog.text and "is plain TCP: anyone on the network path" in caplog.text
    server.data_plane.host = "127.0.0.1"


def test_stop_closes_the_loader_whatever_the_data_plane_raised(cache_dir):
    from batchd.server.app import Server
    from batchd.server.config import ServerConfig

    server = Server(ServerConfig.model_validate({"address": "127.0.0.1:0", "workers": 1, "datasets": {},
                                                 "cache_dir": str(cache_dir)})).start()
    plane_close = server.data_plane.close

    def broken():
        plane_close()
        raise RuntimeError("the data plane broke while closing")

    server.data_plane.close = broken
    with pytest.raises(RuntimeError, match="broke while closing"):
        server.stop(grace=0)
    assert server.loader.closed
