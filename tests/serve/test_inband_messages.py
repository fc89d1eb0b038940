"""Batch messages in band (``StreamBatchesRequest.data_messages``; batchd/datawire.py, magic BDM1)
on a real server, driven on the wire (``rawclient.RawBatches``) with the client's ``DataSocket``:
the server says so in the call's metadata, sends nothing on the call but its status, and each
frame's message and payload give the bytes the call's messages and payloads give; the statistics
count the messages with the payloads; a call that fails mid-epoch closes its data connection
after whole frames and ends with its own status; a client that does not ask gets its messages on
the call (as before)."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from batchd import datawire
from batchd.client.transport import buffers
from batchd.client.transport.dataplane import DataSocket
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until
from rawclient import RawBatches, digest
from test_socket_transport import NUM_BATCHES, _open, read_socket_call

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server
    from test_socket_transport import _config

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), **_config(fmnist_root)) as srv:
        yield srv


@pytest.fixture
def stub(server):
    from batchd.v1 import loader_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        yield loader_pb2_grpc.BatchLoaderStub(channel)


def read_frames(server, call: RawBatches) -> tuple[list[tuple[int, str]], int]:
    """[(batch index, digest)] of every frame of ``call`` until the server closes its data
    connection, and the bytes read."""
    metadata = call.call.initial_metadata()
    assert datawire.messages(metadata), "the server did not say the messages come on the data connection"
    port, token = datawire.offered(metadata)
    pool, got, nbytes = buffers.BufferPool(), [], 0
    with DataSocket.connect(server.address, port, token) as ds:
        while (frame := ds.receive_next(pool, ended=call.call.done)) is not None:
            batch, n = frame
            assert not any(t.data for t in batch.tensors) and not batch.segment
            got.append((batch.batch_index, digest({k: v.numpy() for k, v in batch.payload.items()})))
            nbytes += n
    return got, nbytes


def test_messages_in_band_give_the_bytes_of_messages_on_the_call_and_nothing_goes_on_the_call(server, stub):
    order = [int(b) for b in np.random.default_rng(3).permutation(NUM_BATCHES)]
    first = stub.Stats(pb.StatsRequest(), timeout=10).totals
    on_call, _ = read_socket_call(stub, server.address, order, request=_open(transport=pb.TRANSPORT_SOCKET, seed=5))
    before = stub.Stats(pb.StatsRequest(), timeout=10).totals
    assert before.data_messages == first.data_messages, "a client that did not ask got frames"
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=5, data_messages=True), grant=order)
    call.close()
    got, nbytes = read_frames(server, call)
    assert list(call.call) == [], "a Batch message on the call"
    assert call.call.code() == grpc.StatusCode.OK
    assert dict(got) == dict(on_call) and len(got) == NUM_BATCHES
    after = stub.Stats(pb.StatsRequest(), timeout=10).totals
    assert after.data_plane_bytes_sent - before.data_plane_bytes_sent == nbytes
    assert after.data_messages - before.data_messages == NUM_BATCHES
    payload = after.bytes_copied_socket - before.bytes_copied_socket
    assert nbytes > payload + NUM_BATCHES * datawire.HEADER.size, "the messages are not counted"
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


def test_a_call_that_fails_mid_epoch_closes_its_data_connection_after_whole_frames(server, stub):
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=6, data_messages=True), grant=[0, 1, 2])
    metadata = call.call.initial_metadata()
    port, token = datawire.offered(metadata)
    pool = buffers.BufferPool()
    with DataSocket.connect(server.address, port, token) as ds:
        got = [ds.receive_next(pool, ended=call.call.done)[0].batch_index for _ in range(3)]
        call.send(grant=[10_000])  # not a batch of the epoch: the server refuses it (INVALID_ARGUMENT)
        assert ds.receive_next(pool, ended=call.call.done) is None, "not closed between frames"
    with pytest.raises(grpc.RpcError) as e:
        list(call.call)
    assert sorted(got) == [0, 1, 2]
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT, e.value.details()
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


def test_a_header_that_is_not_a_frame_is_a_broken_connection(server, stub):
    """A client that asked for frames and reads an old header (BDP1) says so, naming the server."""
    call = RawBatches(stub, _open(transport=pb.TRANSPORT_SOCKET, seed=7), grant=[0])
    call.close()
    port, token = datawire.offered(call.call.initial_metadata())
    with DataSocket.connect(server.address, port, token) as ds:
        with pytest.raises(ConnectionError, match=f"{server.address}.*magic b'BDP1'"):
            ds.receive_next(buffers.BufferPool(), ended=call.call.done)
