"""Asking a server for its live figures (the ``Stats`` RPC behind ``batchd status``)."""

from __future__ import annotations

from google.protobuf.json_format import MessageToDict

from batchd.client.transport.channel import one_off
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc


def get_stats(address: str, *, timeout: float = 5.0, tls=None, tls_ca=None, tls_cert=None, tls_key=None,
              token: str | None = None) -> pb.StatsResponse:
    """The server's open streams, workers, shared memory and totals (see ``StatsResponse``).

    tls, tls_ca, tls_cert, tls_key, token: as for RemoteDataLoader (a token limited to some
    datasets sees only their streams).
    Raises ConnectionError if no server answers within ``timeout`` seconds, TimeoutError if it
    answers too slowly, BatchdError for other failures (e.g. a server without the Stats RPC;
    AuthenticationError without a valid token).
    """
    with one_off(address, timeout, tls, tls_ca, tls_cert, tls_key, token) as channel:
        return loader_pb2_grpc.BatchLoaderStub(channel).Stats(pb.StatsRequest(), timeout=timeout)


def stats_dict(reply: pb.StatsResponse) -> dict:
    """``reply`` as plain JSON-able data: proto field names, zero values included, 64-bit ints as ints."""
    data = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _ints(data, reply)


def _ints(data, message):
    """MessageToDict writes (u)int64 as strings (JSON's numbers are doubles); turn them back into ints."""
    for field in message.DESCRIPTOR.fields:
        if field.name not in data:
            continue
        value = getattr(message, field.name)
        if field.message_type is not None:
            if field.is_repeated:
                data[field.name] = [_ints(d, m) for d, m in zip(data[field.name], value)]
            else:
                data[field.name] = _ints(data[field.name], value)
        elif field.cpp_type in (field.CPPTYPE_INT64, field.CPPTYPE_UINT64):
            data[field.name] = list(value) if field.is_repeated else int(value)
    return data
