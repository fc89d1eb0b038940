"""Asking a server what it serves: ``list_datasets`` and ``describe_dataset``."""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from batchd.client.channel import open_channel, resolve_token, tls_settings, translate
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc


@dataclass(frozen=True, slots=True)
class DatasetInfo:
    """A dataset on a server.

    sample_shape: one decoded image [H, W, C] before any pipeline; -1 where it varies.
    classes: label ``l`` is ``classes[l]``.
    """

    name: str
    kind: str
    num_samples: int
    classes: tuple[str, ...]
    sample_shape: tuple[int, ...]
    sample_dtype: str

    @classmethod
    def from_proto(cls, m: pb.DatasetInfo) -> "DatasetInfo":
        image = next((t for t in m.sample if t.name == "image"), pb.TensorSpec(dtype="uint8"))
        return cls(m.name, m.kind, m.num_samples, tuple(m.class_names), tuple(image.shape), image.dtype)


def describe(channel: grpc.Channel, address: str, name: str, timeout: float) -> DatasetInfo:
    """Raises DatasetNotFoundError, ConnectionError or TimeoutError."""
    stub = loader_pb2_grpc.BatchLoaderStub(channel)
    try:
        return DatasetInfo.from_proto(stub.DescribeDataset(pb.DescribeDatasetRequest(name=name), timeout=timeout))
    except grpc.RpcError as e:
        raise translate(e, address) from None


def list_datasets(address: str, *, timeout: float = 10.0, tls=None, tls_ca=None, tls_cert=None, tls_key=None,
                  token: str | None = None) -> list[DatasetInfo]:
    """The datasets served at ``address`` (those the token may read), sorted by name.

    tls, tls_ca, tls_cert, tls_key, token: as for RemoteDataLoader.
    Raises ConnectionError if no server answers within ``timeout`` seconds, AuthenticationError
    without a valid token (for a server with auth).
    """
    channel = open_channel(address, connect_timeout=timeout, tls=tls_settings(tls, tls_ca, tls_cert, tls_key),
                           token=resolve_token(token))
    try:
        reply = loader_pb2_grpc.BatchLoaderStub(channel).ListDatasets(pb.ListDatasetsRequest(), timeout=timeout)
    except grpc.RpcError as e:
        raise translate(e, address) from None
    finally:
        channel.close()
    return [DatasetInfo.from_proto(d) for d in reply.datasets]


def describe_dataset(address: str, name: str, *, timeout: float = 10.0, tls=None, tls_ca=None, tls_cert=None,
                     tls_key=None, token: str | None = None) -> DatasetInfo:
    """One dataset at ``address``. Raises DatasetNotFoundError, ConnectionError, or (with auth)
    AuthenticationError / PermissionDeniedError. TLS and token arguments as for RemoteDataLoader."""
    channel = open_channel(address, connect_timeout=timeout, tls=tls_settings(tls, tls_ca, tls_cert, tls_key),
                           token=resolve_token(token))
    try:
        return describe(channel, address, name, timeout)
    finally:
        channel.close()
