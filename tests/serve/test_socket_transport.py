"""The Batches call with TRANSPORT_SOCKET on a real server (docs/design/network-path.md), driven on
the wire (``rawclient.RawBatches``) with the client's ``DataSocket``: the bytes equal those
inline and over shared memory; a server without a data plane, a compressed call and a
StreamBatches call answer inline; a client that never connects, and a data connection killed
mid-call, end the call UNAVAILABLE with every slot back; the statistics count the data plane;
grants, revokes, progress and a later open written on a plain data connection (control frames) are
applied as on the call, and a bad frame or the client's end closing ends the call; on a TLS server with
tokens, the data connection is TLS (no control frames offered) and nobody without the call's
token (no bearer token on the call, a wrong or reused token, plaintext) gets a byte."""

from __future__ import annotations

import re
import socket
import ssl
import threading

import albumentations as A
import grpc
import numpy as np
import pytest

from batchd import datawire, wire
from batchd.client.transport import buffers
from batchd.client.transport.channel import TLS, make_channel
from batchd.client.transport.dataplane import DataSocket
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import wait_until
from rawclient import RawBatches, RawSession, digest, tensors

pytestmark = pytest.mark.timeout(240)

N_TEST, BATCH = 10_000, 250
NUM_BATCHES = N_TEST // BATCH
AUG = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-20, 20), p=0.7)])
TOKEN = "socket-test-token-0123456789"


def _config(fmnist_root, **kw) -> dict:
    return {"workers": 2, "datasets": {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root),
                                                       "split": "test"}},
            "pipelines": {"aug": A.to_dict(AUG)}, "max_leases_per_session": NUM_BATCHES + 8, **kw}


def _open(**kw) -> pb.StreamBatchesRequest:
    fields = dict(dataset="fmnist-test", batch_size=BATCH, shuffle=True, seed=9, epoch=2,
                  pipeline=pb.Pipeline(preset="aug"))
    fields.update(kw)
    return pb.StreamBatchesRequest(**fields)


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), metrics_port=0, **_config(fmnist_root)) as srv:
        yield srv


@pytest.fixture
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield loader_pb2_grpc.BatchLoaderStub(channel)


def socket_arrays(raw: wire.WireBatch, ds: DataSocket, pool: buffers.BufferPool) -> dict[str, np.ndarray]:
    got = ds.receive(raw, pool)
    return {name: t.numpy().copy() for name, t in got.items()}


def read_socket_call(stub, address: str, grants, *, tls: TLS | None = None, request=None):
    """A TRANSPORT_SOCKET Batches call granting ``grants`` (then half-closed): [(batch index,
    digest)] in arrival order, and the call."""
    call = RawBatches(stub, request or _open(transport=pb.TRANSPORT_SOCKET), grant=grants)
    call.close()
    offer = datawire.offered(call.call.initial_metadata())
    assert offer is not None, "no data connection offered"
    port, token = offer
    pool = buffers.BufferPool()
    got = []
    with DataSocket.connect(address, port, token, tls=tls) as ds:
        for message in call.call:
            raw = wire.decode_batch(message.SerializeToString())
            assert not any(t.data for t in raw.tensors) and not raw.segment
            got.append((raw.batch_index, digest(socket_arrays(raw, ds, pool))))
    return got, call


def test_the_bytes_over_the_data_plane_equal_those_inline_and_over_shared_memory(server, stub):
    everything = list(range(NUM_BATCHES))
    inline = {b.batch_index: digest(tensors(b)) for b in stub.StreamBatches(_open(), timeout=120)}
    session = RawSession(grpc.insecure_channel(server.address))
    try:
        shm = RawBatches(session.stub, _open(transport=pb.TRANSPORT_SHARED_MEMORY, session=session.session,
                                             stream_tag="t"), grant=everything)
        shm.close()
        shared = {}
        for b in shm:
            assert b.segment
            shared[b.batch_index] = digest(tensors(b))
    finally:
        session.close()
    order = [int(b) for b in np.random.default_rng(1).permutation(NUM_BATCHES)]
    got, call = read_socket_call(stub, server.address, order)
    assert call.call.code() == grpc.StatusCode.OK
    assert sorted(b for b, _ in got) == everything, "a batch missing or sent twice"
    assert inline == shared == dict(got)
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


def test_the_statistics_count_the_data_plane(server, stub):
    before = stub.Stats(pb.StatsRequest(), timeout=10).totals
    got, _ = read_socket_call(stub, server.address, list(range(4)), request=_open(transport=pb.TRANSPORT_SOCKET,
                                                                                    seed=77))
    after = stub.Stats(pb.StatsRequest(), timeout=10).totals
    payload = after.bytes_copied_socket - before.bytes_copied_socket
    assert payload >= 4 * BATCH * 28 * 28  # at least the images
    assert after.data_plane_bytes_sent - before.data_plane_bytes_sent == payload + 4 * datawire.HEADER.size
    assert after.data_connections_accepted - before.data_connections_accepted == 1
    assert after.bytes_copied_inline == before.bytes_copied_inline
    import urllib.request

    text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()
    sent = re.search(r"^batchd_data_plane_bytes_sent_total (\S+)$", text, re.M)
    assert sent and float(sent.group(1)) == after.data_plane_bytes_sent
    assert 'batchd_data_connections_total{outcome="accepted"}' in text
    assert 'batchd_bytes_copied_total{transport="socket"}' in text
    from batchd._status_table import format_status

    status = format_status(stub.Stats(pb.StatsRequest(), timeout=10), server.address)
    assert re.search(r"^data: .* sent on \d+ data connections .*; \d+ refused$", status, re.M), status


def test_a_stream_being_sent_shows_its_data_bytes(server, stub):
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=78), grant=[0, 1])
    port, token = datawire.offered(call.call.initial_metadata())
    with DataSocket.connect(server.address, port, token) as ds:
        first = wire.decode_batch(next(call.call).SerializeToString())
        socket_arrays(first, ds, buffers.BufferPool())
        assert wait_until(lambda: any(s.data_bytes_sent > 0 and s.transport == "socket"
                                      for s in stub.Stats(pb.StatsRequest(), timeout=10).streams))
        call.cancel()


@pytest.mark.parametrize("case", ["no-data-plane", "lz4", "stream-batches"])
def test_inline_where_the_socket_cannot_or_need_not_serve(make_server, fmnist_root, case):
    kw = {"data_plane": {"enabled": False}} if case == "no-data-plane" else {}
    srv = make_server(**_config(fmnist_root, **kw))
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        request = _open(transport=pb.TRANSPORT_SOCKET, compression=pb.COMPRESSION_LZ4 if case == "lz4" else 0)
        if case == "stream-batches":
            call = stub.StreamBatches(_open(transport=pb.TRANSPORT_SOCKET, end_batch=2), timeout=60)
        else:
            call = RawBatches(stub, request, grant=[0, 1]).call
        assert datawire.offered(call.initial_metadata()) is None
        batch = next(call)
        assert any(t.data for t in batch.tensors)  # the bytes came inline
        call.cancel()


def test_a_client_that_never_opens_its_data_connection_gets_unavailable(make_server, fmnist_root):
    srv = make_server(**_config(fmnist_root, data_plane={"token_ttl_s": 0.5}))
    with grpc.insecure_channel(srv.address) as channel:
        call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel), _open(transport=pb.TRANSPORT_SOCKET),
                          grant=[0, 1, 2])
        with pytest.raises(grpc.RpcError) as e:
            for _ in call.call:
                pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "did not open its data connection within 0.5 s" in e.value.details()
    assert wait_until(lambda: not srv.loader.streams and srv.loader.slots.in_use == 0)


def test_a_data_connection_killed_mid_call_ends_the_call_unavailable_with_every_slot_back(make_server, fmnist_root):
    srv = make_server(**_config(fmnist_root))
    with grpc.insecure_channel(srv.address) as channel:
        call = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel), _open(transport=pb.TRANSPORT_SOCKET),
                          grant=list(range(NUM_BATCHES)))
        port, token = datawire.offered(call.call.initial_metadata())
        raw = socket.create_connection(("127.0.0.1", port))
        raw.sendall(token)
        messages = iter(call.call)
        first = wire.decode_batch(next(messages).SerializeToString())
        header = raw.recv(datawire.HEADER.size, socket.MSG_WAITALL)
        assert datawire.unpack_header(header)[1] == first.batch_index
        raw.recv(1000)  # part of the payload, then the connection is reset
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        raw.close()
        with pytest.raises(grpc.RpcError) as e:
            for _ in messages:
                pass
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "data connection" in e.value.details()
    assert wait_until(lambda: not srv.loader.streams and srv.loader.slots.in_use == 0)
    assert srv.loader.counters["streams_cancelled"] + srv.loader.counters["streams_failed"] >= 1


# --- control frames on the data connection --------------------------------------------------------


def _frame(**fields) -> bytes:
    return datawire.pack_control(pb.BatchesControl(**fields).SerializeToString())


def test_grants_revokes_and_progress_on_the_data_connection_are_applied_as_on_the_call(server, stub):
    inline = {b.batch_index: digest(tensors(b)) for b in stub.StreamBatches(_open(seed=81), timeout=120)}
    before = stub.Stats(pb.StatsRequest(), timeout=10).totals
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=81), grant=[0])
    metadata = call.call.initial_metadata()
    assert datawire.controls(metadata), "a plain data plane offers control frames"
    port, token = datawire.offered(metadata)
    pool, got = buffers.BufferPool(), {}
    order = [int(b) for b in np.random.default_rng(2).permutation(np.arange(1, NUM_BATCHES))]
    frames = 0
    with DataSocket.connect(server.address, port, token) as ds:
        messages = iter(call.call)
        first = wire.decode_batch(next(messages).SerializeToString())
        got[first.batch_index] = digest(socket_arrays(first, ds, pool))
        ds.send_control(_frame(progress=pb.StreamProgress(batches_taken=1, samples_taken=BATCH)))
        frames += 1
        assert wait_until(lambda: any(st.batches_taken == 1 and st.transport == "socket"
                                      for st in stub.Stats(pb.StatsRequest(), timeout=10).streams)), \
            "the progress in a frame did not reach the stream"
        ds.send_control(_frame(grant=order[:5] + [order[-1]]))
        ds.send_control(_frame(revoke=[order[-1]]))  # (it may be on its way: then it comes anyway)
        frames += 2
        for k in range(5, len(order) - 1, 7):
            ds.send_control(_frame(grant=order[k:min(k + 7, len(order) - 1)]))
            frames += 1
        while len(got) < NUM_BATCHES - 1:
            raw = wire.decode_batch(next(messages).SerializeToString())
            assert raw.batch_index not in got, "a batch sent twice"
            got[raw.batch_index] = digest(socket_arrays(raw, ds, pool))
        after_grants = stub.Stats(pb.StatsRequest(), timeout=10).totals
        call.close()
        for message in messages:  # the revoked batch, if it was on its way
            raw = wire.decode_batch(message.SerializeToString())
            got[raw.batch_index] = digest(socket_arrays(raw, ds, pool))
    assert call.call.code() == grpc.StatusCode.OK
    assert all(inline[b] == d for b, d in got.items()) and set(got) >= set(range(NUM_BATCHES)) - {order[-1]}
    after = stub.Stats(pb.StatsRequest(), timeout=10).totals
    assert after_grants.control_frames - before.control_frames == frames
    assert after.control_messages - before.control_messages == 2, "grants went on the call (open and done only)"
    assert after.batches_granted - before.batches_granted == NUM_BATCHES
    assert after.batches_revoked - before.batches_revoked == (NUM_BATCHES - len(got) == 1)
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


def test_a_later_open_on_the_data_connection_switches_the_call_as_on_the_call(server, stub):
    """The next pass in a frame (``open``, ``open_seq`` 1, with its first grants and the leases of
    nothing): the call switches to it as a message's ``open`` does. Each pass's batches equal
    StreamBatches' of its epoch, and carry their ``open_seq``; the call's only messages are its
    first ``open`` and its ``done``."""
    inline = {e: {b.batch_index: digest(tensors(b)) for b in stub.StreamBatches(_open(seed=83, epoch=e), timeout=120)}
              for e in (2, 3)}
    before = stub.Stats(pb.StatsRequest(), timeout=10).totals
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=83, epoch=2), grant=[0, 1, 2])
    port, token = datawire.offered(call.call.initial_metadata())
    pool, got = buffers.BufferPool(), {2: {}, 3: {}}
    with DataSocket.connect(server.address, port, token) as ds:
        messages = iter(call.call)
        ds.send_control(_frame(grant=list(range(3, NUM_BATCHES)), open_seq=0))
        for _ in range(NUM_BATCHES):
            raw = wire.decode_batch(next(messages).SerializeToString())
            assert raw.open_seq == 0
            got[2][raw.batch_index] = digest(socket_arrays(raw, ds, pool))
        ds.send_control(_frame(open=_open(transport=pb.TRANSPORT_SOCKET, seed=83, epoch=3), open_seq=1,
                               grant=[0, 1]))
        ds.send_control(_frame(grant=list(range(2, NUM_BATCHES)), open_seq=1))
        for _ in range(NUM_BATCHES):
            raw = wire.decode_batch(next(messages).SerializeToString())
            assert raw.open_seq == 1, "a batch of the second pass without its open_seq"
            got[3][raw.batch_index] = digest(socket_arrays(raw, ds, pool))
        call.close()
        assert next(messages, None) is None
    assert call.call.code() == grpc.StatusCode.OK
    assert got == inline
    after = stub.Stats(pb.StatsRequest(), timeout=10).totals
    assert after.control_messages - before.control_messages == 2, "the second open went on the call"
    assert after.batches_calls_started - before.batches_calls_started == 1
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


@pytest.mark.parametrize("case", ["open", "done", "release", "magic", "not-protobuf", "closed"])
def test_a_bad_frame_or_a_closed_data_connection_ends_the_call(server, stub, case):
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=82), grant=[0])
    port, token = datawire.offered(call.call.initial_metadata())
    with DataSocket.connect(server.address, port, token) as ds:
        messages = iter(call.call)
        socket_arrays(wire.decode_batch(next(messages).SerializeToString()), ds, buffers.BufferPool())
        if case == "closed":  # as a relay that died does: grants sent into it may be lost
            ds.close()
        else:
            frame = {"open": _frame(open=_open()), "done": _frame(done=True), "release": _frame(release=[1]),
                     "magic": b"XXXX" + _frame(grant=[1])[4:],
                     "not-protobuf": datawire.pack_control(b"\xff\xff\xff")}[case]
            ds.send_control(frame)
        with pytest.raises(grpc.RpcError) as e:
            for _ in messages:
                pass
    want = {"open": (grpc.StatusCode.INVALID_ARGUMENT, "open names open_seq 0; the next is 1"),
            "done": (grpc.StatusCode.INVALID_ARGUMENT, "release, progress and a later open only"),
            "release": (grpc.StatusCode.INVALID_ARGUMENT, "release only on a shared-memory call"),
            "magic": (grpc.StatusCode.INVALID_ARGUMENT, "magic b'XXXX'"),
            "not-protobuf": (grpc.StatusCode.INVALID_ARGUMENT, "not a valid BatchesControl"),
            "closed": (grpc.StatusCode.UNAVAILABLE, "data connection from 127.0.0.1")}[case]
    assert (e.value.code(), want[1] in e.value.details()) == (want[0], True), e.value.details()
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


# --- TLS and tokens -----------------------------------------------------------------------------


def test_tls_and_tokens_nobody_without_the_calls_token_gets_a_byte(make_server, fmnist_root, pki):
    srv = make_server(**_config(fmnist_root, tls={"cert": str(pki["server_cert"]), "key": str(pki["server_key"])},
                                auth={"tokens": [{"name": "trainer", "token": TOKEN, "datasets": ["*"]}]}))
    tls = TLS(ca=pki["ca"])
    with make_channel(srv.address, tls=tls) as channel:  # a channel without the bearer token
        refused = RawBatches(loader_pb2_grpc.BatchLoaderStub(channel), _open(transport=pb.TRANSPORT_SOCKET),
                             grant=[0])
        with pytest.raises(grpc.RpcError) as e:
            next(refused.call)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert datawire.offered(refused.call.initial_metadata()) is None  # no token handed out
    with make_channel(srv.address, tls=tls, token=TOKEN) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET), grant=[0, 1, 2])
        call.close()
        port, token = datawire.offered(call.call.initial_metadata())
        assert not datawire.controls(call.call.initial_metadata()), "control frames offered over TLS"

        def nothing(sock) -> bytes:
            sock.settimeout(5)
            out = b""
            try:
                while chunk := sock.recv(1 << 16):
                    out += chunk
            except (OSError, ssl.SSLError):
                pass
            sock.close()
            return out

        plain = socket.create_connection(("127.0.0.1", port))  # the right token, in clear, to a TLS plane
        plain.sendall(token)
        leaked = nothing(plain)
        assert datawire.MAGIC not in leaked and len(leaked) < 64
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        wrong = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
        wrong.sendall(bytes(32))  # (no token at all: tests/serve/test_dataplane_server.py, with a short handshake timeout)
        assert nothing(wrong) == b""
        pool = buffers.BufferPool()
        got = []
        with DataSocket.connect(srv.address, port, token, tls=tls) as ds:
            assert ds.tls
            messages = iter(call.call)
            first = wire.decode_batch(next(messages).SerializeToString())
            socket_arrays(first, ds, pool)  # a batch on ds: the server has claimed the token for it
            got.append(first.batch_index)
            reused = ctx.wrap_socket(socket.create_connection(("127.0.0.1", port)), server_hostname="127.0.0.1")
            reused.sendall(token)
            assert nothing(reused) == b""
            for message in messages:
                got.append(wire.decode_batch(message.SerializeToString()).batch_index)
                socket_arrays(wire.decode_batch(message.SerializeToString()), ds, pool)
        assert sorted(got) == [0, 1, 2] and call.call.code() == grpc.StatusCode.OK
        totals = stub.Stats(pb.StatsRequest(), timeout=10).totals
        assert totals.data_connections_accepted == 1 and totals.data_connections_refused == 3


def test_many_calls_at_once_each_get_their_own_connection(server):
    """Tokens are matched to their calls: 4 calls over one channel, their data connections opened
    in the reverse order, each gets its own batches."""
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        calls = [RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=100 + i), grant=[i, i + 4])
                 for i in range(4)]
        offers = [datawire.offered(c.call.initial_metadata()) for c in calls]
        sockets = [None] * 4
        for i in reversed(range(4)):
            sockets[i] = DataSocket.connect(server.address, *offers[i])
        results: dict[int, list[int]] = {}

        def read(i):
            calls[i].close()
            pool = buffers.BufferPool()
            results[i] = []
            for message in calls[i].call:
                raw = wire.decode_batch(message.SerializeToString())
                socket_arrays(raw, sockets[i], pool)
                results[i].append(raw.batch_index)

        threads = [threading.Thread(target=read, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        for ds in sockets:
            ds.close()
    assert {i: sorted(r) for i, r in results.items()} == {i: [i, i + 4] for i in range(4)}
