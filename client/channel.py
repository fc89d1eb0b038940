"""Opening channels to a batchd server and turning gRPC errors into the errors users catch."""

from __future__ import annotations

import grpc

from batchd.errors import BatchdError, DatasetNotFoundError, SampleError, ShapeMismatchError, WorkerError
from batchd.v1 import loader_pb2 as pb

ERROR_DETAIL_KEY = "batchd-error-bin"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30


def open_channel(address: str, *, connect_timeout: float = 10.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A ready channel to ``address`` (``HOST:PORT`` or ``unix:PATH``).

    Raises ConnectionError if no server answers within ``connect_timeout`` seconds.
    """
    channel = grpc.insecure_channel(
        address,
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", 64 << 20),
            ("grpc.enable_retries", 1),
        ],
    )
    try:
        grpc.channel_ready_future(channel).result(timeout=connect_timeout)
    except grpc.FutureTimeoutError:
        channel.close()
        raise ConnectionError(f"no batchd server answered at {address} within {connect_timeout:g} s") from None
    return channel


def translate(e: grpc.RpcError, address: str) -> Exception:
    """The batchd or builtin exception for a failed call (see loader.proto for the codes)."""
    code, details = e.code(), e.details() or ""
    detail = pb.ErrorDetail()
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == ERROR_DETAIL_KEY:
            detail.ParseFromString(value)
    if code == grpc.StatusCode.NOT_FOUND:
        return DatasetNotFoundError(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ShapeMismatchError(details) if detail.type == "ShapeMismatchError" else ValueError(details)
    if code == grpc.StatusCode.DATA_LOSS and detail.type == "SampleError" and detail.indices:
        return SampleError(detail.dataset, detail.indices[0], detail.paths[0] if detail.paths else "", detail.reason)
    if code == grpc.StatusCode.INTERNAL and detail.type == "WorkerError":
        return WorkerError(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or _transport_failure(code, details, detail):
        return ConnectionError(f"batchd server at {address} is unavailable: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return TimeoutError(f"batchd server at {address} did not answer in time: {details}")
    return BatchdError(f"{code.name} from {address}: {details}")


_TRANSPORT_FAILURES = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset", "GOAWAY")


def _transport_failure(code: grpc.StatusCode, details: str, detail: pb.ErrorDetail) -> bool:
    """The connection broke (the server went away mid-call), as gRPC reports it without UNAVAILABLE."""
    return (code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and not detail.type
            and any(marker in details for marker in _TRANSPORT_FAILURES))
