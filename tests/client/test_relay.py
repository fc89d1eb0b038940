"""The receive relay (client/transport/relay.py): the data plane's batches received by a process of
batchd's own into memory the trainer maps, so the trainer's CPU does not copy them.

Real servers on 127.0.0.1:0 (a ``batchd serve`` subprocess), a real relay process: the bytes
equal those over shared memory and with the relay off; the trainer process never reads a data
connection (its own receive path made to raise); a relay killed with SIGKILL mid-epoch is
replaced and the epoch comes whole, each batch once, the same bytes; a relay ends with the
trainer that started it, SIGKILL included; control frames (grants) go through it to the server,
also while a read waits.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import albumentations as A
import numpy as np
import pytest

import batchd
from batchd import datawire, wire
from batchd.client.transport import buffers
from batchd.client.transport import dataplane
from batchd.client.transport import relay
from helpers import digest, fake_data_server, wait_until
from procs import RANDOM_AUG, fmnist_test_config

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(not relay.AVAILABLE, reason="the relay needs Linux (memfd_create)")]

N_TEST, BATCH = 10_000, 250


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), workers=2, datasets=fmnist_test_config(fmnist_root),
                        pipelines={"aug": A.to_dict(RANDOM_AUG)}) as srv:
        yield srv


def read(address, **kw) -> list[str]:
    kw = {"batch_size": BATCH, "shuffle": True, "seed": 5, "transform": "aug", "timeout": 60, **kw}
    with batchd.RemoteDataLoader(address, "fmnist-test", **kw) as ld:
        return [digest(b) for b in ld]


def test_the_relay_gives_the_bytes_of_shared_memory_and_of_the_trainers_own_receive(server, monkeypatch):
    want = read(server.address, transport="shm")
    assert len(want) == N_TEST // BATCH
    assert read(server.address, transport="socket", relay=False) == want

    def trainer_reads(*a, **k):
        raise AssertionError("the trainer process read a data connection itself")

    monkeypatch.setattr(dataplane.DataSocket, "receive", trainer_reads)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=5,
                                 transform="aug", transport="socket") as ld:
        assert ld.relay == "auto"
        got = [digest(b) for b in ld]
        received = ld.stats()["bytes_received"]["socket"]
    assert got == want
    assert received >= N_TEST * 28 * 28
    assert relay.shared().alive()


def test_relay_false_receives_in_the_trainer(server, monkeypatch):
    def relay_opens(*a, **k):
        raise AssertionError("relay=False opened a relayed connection")

    monkeypatch.setattr(relay.Relay, "open", relay_opens)
    assert len(read(server.address, transport="socket", relay=False)) == N_TEST // BATCH
    with pytest.raises(ValueError, match="relay must be 'auto', True or False"):
        batchd.RemoteDataLoader(server.address, "fmnist-test", relay="yes")


def test_a_relay_killed_mid_epoch_is_replaced_and_nothing_is_lost_or_repeated(server):
    want = read(server.address, transport="shm", seed=9)
    shared = relay.shared()
    started = shared.started
    got, killed = [], []
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=9,
                                 transform="aug", transport="socket", timeout=60) as ld:
        for i, batch in enumerate(ld):
            got.append(digest(batch))
            if i in (5, 20):  # twice: the replacement is replaced too
                pid = shared.pid
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
    assert got == want, "batches lost, repeated or changed across the relay's deaths"
    assert shared.started >= started + 2 and shared.pid not in killed


def test_the_relay_ends_with_its_trainer_even_on_sigkill(server, tmp_path):
    script = tmp_path / "trainer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        import batchd
        from batchd.client.transport import relay
        ld = batchd.RemoteDataLoader({server.address!r}, "fmnist-test", batch_size=250, transport="socket")
        it = iter(ld)
        next(it)
        print(relay.shared().pid, flush=True)
        time.sleep(120)
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = [None]
        reader = threading.Thread(target=lambda: line.__setitem__(0, proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(60)
        assert line[0], "the trainer printed no relay pid"
        pid = int(line[0])
        assert os.path.exists(f"/proc/{pid}")
        proc.kill()
        proc.wait(10)
        # the relay is the trainer's child: once it exits, init reaps it
        assert wait_until(lambda: not os.path.exists(f"/proc/{pid}") or _zombie(pid), 10), \
            f"the relay (pid {pid}) outlived its trainer"
    finally:
        proc.kill()
        proc.wait()


PAYLOAD_BATCH = wire.WireBatch(5, 0, 10, (wire.WireTensor("label", "int64", (4,), offset=0),))  # 32 bytes of payload


def _sends(data: bytes):
    """A fake data port's script: send ``data``, then hold the connection until the relay closes it."""
    def script(conn):
        conn.sendall(data)
        try:
            conn.recv(1)
        except OSError:
            pass
    return script


def _open(listener, timeout: float = 30.0) -> relay.RelayedSocket:
    port = listener.getsockname()[1]
    return relay.shared().open(f"127.0.0.1:{port}", "127.0.0.1", port, bytes(datawire.TOKEN_BYTES), tls=None,
                               connect_timeout=5.0, timeout=timeout)


def test_the_relay_checks_the_header_and_its_error_gives_the_buffer_back():
    pool = buffers.BufferPool(relay.shared().buffers)
    listener, t = fake_data_server(_sends(datawire.pack_header(6, 32) + bytes(32)))
    with listener, _open(listener) as rs:
        with pytest.raises(ConnectionError, match=r"server at 127\.0\.0\.1:\d+ sent a header for batch 6 of 32 "
                                                  r"bytes .* where batch 5 of 32 bytes was due"):
            rs.receive(PAYLOAD_BATCH, pool)
    t.join(5)
    assert pool.outstanding == 0 and pool.bytes_free > 0  # the relay answered: the buffer is reusable


def _frame(index: int, n: int) -> bytes:
    """An in-band frame (datawire.MESSAGE_MAGIC) of batch ``index``: ``n`` int64 labels 0..n-1."""
    message = wire.encode_batch(index, 0, 10, [wire.WireTensor("label", "int64", (n,), offset=0)])
    return datawire.pack_header(index, 8 * n, len(message)) + message + np.arange(n, dtype=np.int64).tobytes()


def test_in_band_frames_through_the_relay_a_larger_buffer_when_one_does_not_fit_and_the_end(monkeypatch):
    """Frames read by the relay: the first into a buffer too small (answered S, then read into a
    larger one), the next into the buffer of the last size; the server's close between frames
    is the end (None); a server silent once the call is over is given up after the grace."""
    monkeypatch.setattr(dataplane, "ENDED_GRACE_S", 0.5)
    pool = buffers.BufferPool(relay.shared().buffers)
    listener, t = fake_data_server(lambda conn: (conn.sendall(_frame(3, 20_000) + _frame(4, 100)), time.sleep(0.5)))
    with listener, _open(listener) as rs:
        first, n1 = rs.receive_next(pool, ended=lambda: False)
        assert first.batch_index == 3 and first.payload["label"].tolist() == list(range(20_000))
        del first  # its buffer goes back: the next frame is read into it (the last frame's size)
        gc.collect()
        second, n2 = rs.receive_next(pool, ended=lambda: False)
        assert second.batch_index == 4 and second.payload["label"].tolist() == list(range(100))
        assert (n1, n2) == (len(_frame(3, 20_000)), len(_frame(4, 100)))
        assert pool.allocated == 2, "the second frame did not reuse a buffer of the first one's size"
        assert rs.receive_next(pool, ended=lambda: False) is None
    t.join(5)
    listener, t = fake_data_server(lambda conn: time.sleep(3))
    with listener, _open(listener) as rs:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="did not answer in time"):
            rs.receive_next(pool, ended=lambda: time.monotonic() - t0 > 0.5)
        assert time.monotonic() - t0 < 15, "not the grace: the relay's timeout (30 s) and its margin"
    t.join(5)


class _Spy:
    """A relayed connection's pair socket that sets ``read_sent`` once a READ went on it."""

    def __init__(self, sock, read_sent: threading.Event):
        self._sock, self._read_sent = sock, read_sent

    def __getattr__(self, name):
        return getattr(self._sock, name)

    def sendmsg(self, buffers, *args):
        n = self._sock.sendmsg(buffers, *args)
        if bytes(buffers[0])[:1] == b"R":
            self._read_sent.set()
        return n

    def send(self, data, *args):
        n = self._sock.send(data, *args)
        if bytes(data)[:1] == b"R":
            self._read_sent.set()
        return n


def test_control_frames_through_the_relay_reach_the_server_also_while_a_read_waits():
    """The relay writes the trainer's control frames (grants) on the data connection as they
    come: between reads, and while a read waits for a payload (a frame waiting on the pair is
    not the trainer closing it)."""
    frames = [datawire.pack_control(bytes([k]) * (k + 1)) for k in range(6)]
    want = b"".join(frames)
    seen, gate = bytearray(), threading.Event()

    def script(conn):
        conn.settimeout(20)
        while len(seen) < len(frames[0]) + len(frames[1]):  # before any READ: between reads
            seen.extend(conn.recv(1 << 16))
        gate.set()  # the receive below starts; its payload comes only after the other frames came
        while len(seen) < len(want):
            seen.extend(conn.recv(1 << 16))
        conn.sendall(datawire.pack_header(5, 32) + bytes(range(32)))
        try:
            conn.recv(1)
        except OSError:
            pass

    pool = buffers.BufferPool(relay.shared().buffers)
    listener, t = fake_data_server(script)
    with listener, _open(listener) as rs:
        assert rs.controls
        rs.send_control(frames[0])
        rs.send_control(frames[1])
        assert gate.wait(10), "frames sent between reads did not reach the server"
        read_sent = threading.Event()
        rs._sock = _Spy(rs._sock, read_sent)
        got = []
        r = threading.Thread(target=lambda: got.append(rs.receive(PAYLOAD_BATCH, pool)))
        r.start()
        assert read_sent.wait(10)
        for frame in frames[2:]:  # behind the READ on the pair: only the waiting read can forward them
            rs.send_control(frame)
        r.join(20)
        assert got and got[0]["label"].numpy().tobytes() == bytes(range(32))
    t.join(5)
    assert bytes(seen) == want


@pytest.mark.parametrize("how", ["stopping", "close"])
def test_a_buffer_the_relay_may_still_write_is_never_reused(how):
    """A receive abandoned mid-payload (the loader stops, or closes the connection) leaves the
    relay's read running until it looks again: that buffer leaves the pool for good."""
    pool = buffers.BufferPool(relay.shared().buffers)
    listener, t = fake_data_server(_sends(datawire.pack_header(5, 32) + bytes(10)))
    with listener, _open(listener) as rs:
        stopping, errors = threading.Event(), []

        def receive():
            try:
                rs.receive(PAYLOAD_BATCH, pool, stopping)
            except BaseException as e:
                errors.append(e)

        r = threading.Thread(target=receive)
        r.start()
        assert wait_until(lambda: pool.outstanding == 1, 5)
        stopping.set() if how == "stopping" else rs.close()
        r.join(5)
        assert not r.is_alive() and errors and isinstance(errors[0], ConnectionAbortedError), errors
    t.join(5)
    assert pool.outstanding == 0 and pool.bytes_free == 0, "an abandoned buffer went back to the pool"


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True
