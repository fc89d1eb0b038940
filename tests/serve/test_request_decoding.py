"""One request type from the wire to the task: decoding StreamBatchesRequest, refusing what does not decode."""

from __future__ import annotations

import logging

import grpc
import pytest

from batchd.server.compute.protocol import StreamRequest
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc

pytestmark = pytest.mark.timeout(120)


def test_from_proto_keeps_every_field():
    msg = pb.StreamBatchesRequest(
        dataset="d", pipeline=pb.Pipeline(preset="flip"), batch_size=7, shuffle=True, seed=5, epoch=2, drop_last=True,
        rank=1, world_size=3, start_batch=4, prefetch=6, transport=pb.TRANSPORT_SHARED_MEMORY, session="s",
        compression=pb.COMPRESSION_LZ4, batch_stride=2, batch_offset=1, stream_tag="t")
    r = StreamRequest.from_proto(msg, "ipv4:1.2.3.4:5")
    assert (r.dataset, r.preset, r.albumentations_json, r.batch_size, r.shuffle, r.seed, r.epoch, r.drop_last) == (
        "d", "flip", "", 7, True, 5, 2, True)
    assert (r.rank, r.world_size, r.start_batch, r.prefetch, r.batch_stride, r.batch_offset) == (1, 3, 4, 6, 2, 1)
    assert (r.transport, r.session, r.compression, r.stream_tag, r.peer) == ("shm", "s", "lz4", "t", "ipv4:1.2.3.4:5")
    # shared memory without a session is inline; the session is kept (it names the call for progress)
    r = StreamRequest.from_proto(pb.StreamBatchesRequest(dataset="d", transport=pb.TRANSPORT_SHARED_MEMORY))
    assert (r.transport, r.session, r.stride, r.first_batch) == ("inline", "", 1, 0)


@pytest.mark.parametrize("field, value", [("transport", 7), ("compression", 9)])
def test_unknown_enum_values_are_invalid_argument(fmnist_server, field, value):
    with grpc.insecure_channel(fmnist_server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        request = pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=10, **{field: value})
        with pytest.raises(grpc.RpcError) as info:
            next(iter(stub.StreamBatches(request, timeout=30)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{field}: unknown value {value}" in info.value.details()
    assert not fmnist_server.loader.streams


def test_undecodable_request_is_invalid_argument_and_a_warning(fmnist_server, caplog):
    caplog.set_level(logging.INFO)
    with grpc.insecure_channel(fmnist_server.address) as channel:
        for method, streaming in (("StreamBatches", True), ("Stats", False)):
            call = (channel.unary_stream if streaming else channel.unary_unary)(
                f"/batchd.v1.BatchLoader/{method}", request_serializer=lambda b: b, response_deserializer=lambda b: b)
            with pytest.raises(grpc.RpcError) as info:
                result = call(b"\x0a\xff\xff", timeout=30)  # field 1, a length that runs past the end
                if streaming:
                    next(iter(result))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "not a valid protobuf message" in info.value.details()
    undecodable = [r for r in caplog.records if "undecodable request" in r.getMessage()]
    assert len(undecodable) == 2 and all(r.levelno == logging.WARNING for r in undecodable)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
