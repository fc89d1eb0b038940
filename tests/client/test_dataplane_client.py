"""The data plane's client side (client/transport/dataplane.py, client/transport/buffers.py) over real sockets: the
fields received equal the slot's tensors (plain, TLS, mutual TLS); buffers are reused once their
tensors are freed and never while one lives; a header that is not the announced batch's, a
server that closes or goes silent, a stop or a close from another thread: each a prompt error
naming the server; a forked child leaves the parent's connection alone."""

from __future__ import annotations

import contextlib
import gc
import multiprocessing
import os
import socket
import threading
import time

import numpy as np
import pytest
import torch

from batchd import datawire, wire
from batchd.client.transport import buffers
from batchd.client.transport.channel import TLS
from batchd.client.transport.dataplane import DataSocket, data_host
from batchd.server.config import TlsConfig
from batchd.server.serve.dataplane import DataPlane, tls_context
from batchd.server.shm import Owner, SlotPool
from helpers import fake_data_server as fake_server

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def slots():
    owner = Owner()
    pool = SlotPool(max_slots=8, prefix=owner.prefix)
    yield pool
    pool.close()
    owner.close()


@contextlib.contextmanager
def connected(tls_config: TlsConfig | None = None, tls: TLS | None = None, timeout: float = 10.0):
    """A plane, a call's server-side connection and its client ``DataSocket``."""
    plane = DataPlane("127.0.0.1", 0, ssl_context=tls_context(tls_config) if tls_config else None)
    try:
        ticket = plane.expect()
        client = DataSocket.connect(f"127.0.0.1:{plane.port}", plane.port, ticket.token, tls=tls, timeout=timeout)
        server = ticket.wait()
        try:
            yield server, client
        finally:
            client.close()
            server.close()
    finally:
        plane.close()


def fields_of(rng: np.random.Generator, b: int = 8) -> dict[str, np.ndarray]:
    return {"image": rng.integers(0, 256, (b, 64, 80, 3), dtype=np.uint8),
            "label": rng.integers(0, 10, b).astype(np.int64),
            "boxes": rng.random((5, 4)).astype(np.float32)}  # ragged: samples of 2, 0 and 3 boxes


def put(slots: SlotPool, arrays: dict[str, np.ndarray], batch_index: int):
    """The arrays in a slot at gapped offsets (0xAB between), the message the server would send
    for them and what to send: (slot, WireBatch, pieces, length)."""
    slot = slots.acquire(sum(a.nbytes + 4096 for a in arrays.values()))
    slot.buf[:] = b"\xab" * slot.capacity
    at, placed = 128, []
    for a in arrays.values():
        slot.buf[at : at + a.nbytes] = a.tobytes()
        placed.append((at, a.nbytes))
        at += a.nbytes + 1000
    pieces, length = datawire.payload_layout(placed)
    tensors = []
    for (name, a), piece in zip(arrays.items(), pieces):
        if name == "boxes":
            tensors.append(wire.WireTensor(name, "float32", (a.size,), offset=piece.offset, sample_ndim=2,
                                           sample_shapes=(2, 4, 0, 4, 3, 4), sample_offsets=(0, 8, 8, 20)))
        else:
            tensors.append(wire.WireTensor(name, str(a.dtype), a.shape, offset=piece.offset))
    return slot, wire.WireBatch(batch_index, 0, 10, tuple(tensors)), pieces, length


def check(got: dict, arrays: dict[str, np.ndarray]) -> None:
    assert np.array_equal(got["image"].numpy(), arrays["image"])
    assert np.array_equal(got["label"].numpy(), arrays["label"])
    boxes = got["boxes"].split()
    assert [tuple(t.shape) for t in boxes] == [(2, 4), (0, 4), (3, 4)]
    assert np.array_equal(torch.cat([t.reshape(-1, 4) for t in boxes]).numpy(), arrays["boxes"])


@pytest.mark.parametrize("mode", ["plain", "tls", "mutual-tls"])
def test_received_fields_equal_the_slot_and_buffers_come_back_when_freed(slots, pki, mode):
    server_tls = client = None
    if mode != "plain":
        mutual = mode == "mutual-tls"
        server_tls = TlsConfig(cert=pki["server_cert"], key=pki["server_key"],
                               client_ca=pki["ca"] if mutual else None, require_client_cert=mutual)
        client = TLS(ca=pki["ca"], cert=pki["client_cert"] if mutual else None,
                     key=pki["client_key"] if mutual else None)
    rng = np.random.default_rng(0)
    pool = buffers.BufferPool()
    with connected(server_tls, client) as (server, ds):
        assert ds.tls is (mode != "plain")
        kept = []
        for b in range(6):
            arrays = fields_of(rng)
            slot, batch, pieces, length = put(slots, arrays, b)
            server.send(b, slot, pieces, length)
            slots.release(slot)  # reused by the next batch at once: the bytes were copied
            got = ds.receive(batch, pool)
            check(got, arrays)
            got["image"][0, 0, 0, 0] += 1  # writable, as DataLoader batches are
            if b < 2:
                kept.append((got, arrays))  # held: their buffers stay out
            del got
            gc.collect()
        assert pool.outstanding == 2 and pool.allocated == 3 and pool.reused == 3
        for got, arrays in kept:
            arrays["image"][0, 0, 0, 0] += 1
            check(got, arrays)  # later batches never wrote into a buffer still in use
        del kept, got
        gc.collect()
        assert pool.outstanding == 0


def test_a_part_of_a_batch_that_lives_on_keeps_its_buffer(slots):
    rng = np.random.default_rng(1)
    pool = buffers.BufferPool()
    with connected() as (server, ds):
        arrays = fields_of(rng)
        slot, batch, pieces, length = put(slots, arrays, 0)
        server.send(0, slot, pieces, length)
        labels = ds.receive(batch, pool)["label"]  # the rest of the batch is freed at once
        gc.collect()
        assert pool.outstanding == 1
        server.send(1, slot, pieces, length)
        ds.receive(wire.WireBatch(1, 0, 10, batch.tensors), pool)
        gc.collect()
        assert pool.allocated == 2 and np.array_equal(labels.numpy(), arrays["label"])
        del labels
        gc.collect()
        assert pool.outstanding == 0
        slots.release(slot)


BATCH = wire.WireBatch(5, 0, 10, (wire.WireTensor("label", "int64", (4,), offset=0),))


@pytest.mark.parametrize("header,match", [
    (b"XXXX" + bytes(4) + (5).to_bytes(8, "little") + (32).to_bytes(8, "little"), "magic b'XXXX'"),
    (datawire.pack_header(6, 32), "batch 6 of 32 bytes"),
    (datawire.pack_header(5, 64), "batch 5 of 64 bytes"),
], ids=["magic", "batch-index", "length"])
def test_a_header_that_is_not_the_announced_batchs_is_a_connection_error(header, match):
    listener, t = fake_server(lambda conn: (conn.sendall(header + bytes(64)), time.sleep(1)))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32)) as ds:
        with pytest.raises(ConnectionError, match=f"server at 127.0.0.1:.*{match}.*batch 5 of 32 bytes"):
            ds.receive(BATCH, buffers.BufferPool())
    t.join(5)


def test_a_server_that_closes_mid_payload_or_goes_silent_is_a_connection_error():
    pool = buffers.BufferPool()
    listener, t = fake_server(lambda conn: conn.sendall(datawire.pack_header(5, 32) + bytes(10)))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32)) as ds:
        with pytest.raises(ConnectionError, match=r"closed its data connection \(10 of 32 bytes read\)"):
            ds.receive(BATCH, pool)
    assert pool.outstanding == 0  # the buffer went back
    listener, t = fake_server(lambda conn: time.sleep(3))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32), timeout=0.5) as ds:
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match="brought no byte for 0.5 s"):
            ds.receive(BATCH, pool)
        assert time.monotonic() - t0 < 2.5


def test_between_in_band_frames_the_wait_lasts_as_long_as_the_call_then_a_grace(monkeypatch):
    """A frame may be long in coming (a slow pipeline): no limit while the call lasts, even past
    ``timeout``; once the call is over, a server whose host vanished (no close) is given up after
    ``ENDED_GRACE_S`` without a byte; a close between frames is the end (None)."""
    from batchd.client.transport import dataplane

    monkeypatch.setattr(dataplane, "ENDED_GRACE_S", 0.5)
    message = wire.encode_batch(5, 0, 10, [wire.WireTensor("label", "int64", (4,), offset=0)])
    frame = datawire.pack_header(5, 32, len(message)) + message + np.arange(4, dtype=np.int64).tobytes()
    listener, t = fake_server(lambda conn: (time.sleep(1.5), conn.sendall(frame), time.sleep(0.2)))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32), timeout=0.5) as ds:
        batch, nbytes = ds.receive_next(buffers.BufferPool(), ended=lambda: False)
        assert batch.batch_index == 5 and batch.payload["label"].tolist() == [0, 1, 2, 3]
        assert nbytes == len(frame)
        assert ds.receive_next(buffers.BufferPool(), ended=lambda: False) is None  # closed between frames
    t.join(5)
    listener, t = fake_server(lambda conn: time.sleep(3))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32), timeout=30) as ds:
        t0 = time.monotonic()
        # (without the grace: "no byte for 30 s", the data timeout)
        with pytest.raises(ConnectionError, match="no byte for 0.5 s after its call ended"):
            ds.receive_next(buffers.BufferPool(), ended=lambda: time.monotonic() - t0 > 0.5)


@pytest.mark.parametrize("how", ["stopping", "close"])
def test_a_receive_stops_promptly_when_stopped_or_closed(how):
    listener, t = fake_server(lambda conn: time.sleep(3))
    with listener, DataSocket.connect(f"127.0.0.1:{listener.getsockname()[1]}", listener.getsockname()[1],
                                      bytes(32), timeout=30) as ds:
        stopping = threading.Event()
        result: list = []

        def receive():
            try:
                ds.receive(BATCH, buffers.BufferPool(), stopping)
            except BaseException as e:
                result.append(e)

        r = threading.Thread(target=receive)
        r.start()
        time.sleep(0.3)
        stopping.set() if how == "stopping" else ds.close()
        r.join(2)
        assert not r.is_alive() and isinstance(result[0], ConnectionAbortedError)


def test_connect_errors_name_the_server(pki):
    port = socket.create_server(("127.0.0.1", 0))
    free = port.getsockname()[1]
    port.close()
    with pytest.raises(ConnectionError, match=f"data port {free} of the batchd server at 127.0.0.1:50051"):
        DataSocket.connect("127.0.0.1:50051", free, bytes(32), connect_timeout=2)
    with pytest.raises(ConnectionError, match="has no host"):
        DataSocket.connect("unix:/tmp/batchd.sock", 1234, bytes(32))
    plain = DataPlane("127.0.0.1", 0, handshake_timeout_s=1)
    try:  # TLS against a plain data plane
        with pytest.raises(ConnectionError, match="cannot open a data connection"):
            DataSocket.connect("127.0.0.1:50051", plain.port, bytes(32), tls=TLS(ca=pki["ca"]), connect_timeout=3)
    finally:
        plain.close()
    secure = DataPlane("127.0.0.1", 0, ssl_context=tls_context(TlsConfig(cert=pki["server_cert"],
                                                                          key=pki["server_key"])))
    try:  # a server certificate the client's CA did not sign (the system roots)
        with pytest.raises(ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            DataSocket.connect("127.0.0.1:50051", secure.port, bytes(32), tls=TLS(), connect_timeout=3)
    finally:
        secure.close()


def test_data_host():
    assert data_host("10.1.2.3:50051") == "10.1.2.3"
    assert data_host("[::1]:50051") == "::1"
    assert data_host("dns:///batchd.svc:50051") == "batchd.svc"
    assert data_host("loader-0:50051") == "loader-0"
    assert data_host("unix:/run/batchd.sock") is None


def _child_closes(ds: DataSocket) -> None:
    ds.close()  # the parent's socket: must leave the connection alone
    os._exit(0)


def test_a_forked_child_that_closes_the_parents_data_socket_leaves_the_connection_alone(slots):
    rng = np.random.default_rng(2)
    pool = buffers.BufferPool()
    with connected() as (server, ds):
        child = multiprocessing.get_context("fork").Process(target=_child_closes, args=(ds,))
        child.start()
        child.join(10)
        assert child.exitcode == 0
        arrays = fields_of(rng)
        slot, batch, pieces, length = put(slots, arrays, 0)
        server.send(0, slot, pieces, length)
        check(ds.receive(batch, pool), arrays)
        slots.release(slot)


def test_capacity_and_pool_bounds():
    assert buffers.capacity_for(1) == 1 << 16
    assert buffers.capacity_for(9_633_792) >= 9_633_792 * 9 // 8
    pool = buffers.BufferPool(keep=2)
    taken = [pool.take(n) for n in (1 << 20, 2 << 20, 3 << 20)]
    for b in taken:
        pool.give_back(b)
    assert pool.outstanding == 0 and pool.peak == 3 and len(pool._free) == 3  # as many as were out at once
    assert pool.take(1 << 20).numel() == buffers.capacity_for(1 << 20)  # the smallest that fits
    big = pool.take(4 << 20)  # none fits: a fourth buffer, more than the peak of 3 ...
    assert pool.allocated == 4 and pool.outstanding == 2 and pool.peak == 3
    pool.give_back(big)  # ... so the smallest free one goes once it is back: 3 buffers in all
    assert sorted(b.numel() for b in pool._free) == [buffers.capacity_for(n) for n in (3 << 20, 4 << 20)]


def test_a_steady_stream_allocates_no_buffer_once_the_pool_holds_its_peak():
    pool = buffers.BufferPool(keep=2)
    held = [pool.take(1 << 20) for _ in range(20)]  # a lookahead of 20 received batches
    for _ in range(200):  # the loop takes the oldest, one more arrives
        pool.give_back(held.pop(0))
        held.append(pool.take(1 << 20))
    assert pool.allocated == 20 and pool.reused == 200
