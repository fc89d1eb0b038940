"""Opening channels to a batchd server and turning gRPC errors into the errors users catch."""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import pathlib
from dataclasses import dataclass, replace
from typing import Any, Iterator

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from batchd import errors
from batchd.client import forks
from batchd.errors import (
    AuthenticationError,
    BatchdError,
    DatasetNotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SampleError,
    ShapeMismatchError,
    WorkerError,
)
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

ERROR_DETAIL_KEY = "batchd-error-bin"
DEFAULT_MAX_MESSAGE_BYTES = 1 << 30
TOKEN_ENV = "BATCHD_TOKEN"  # the token used when none is passed


@dataclass(frozen=True)
class TLS:
    """How a client speaks TLS to a server.

    ca: PEM file of the CA certificate(s) that signed the server's certificate (None: the
        system's trusted roots). cert, key: PEM files of a client certificate and its key, for
        servers that verify clients (mutual TLS); give both or neither. server_name: the name
        to check the server's certificate against, when it differs from the address's host.
    """

    ca: str | os.PathLike[str] | None = None
    cert: str | os.PathLike[str] | None = None
    key: str | os.PathLike[str] | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both tls_cert and tls_key")


def tls_settings(tls: Any = None, tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None) -> TLS | None:
    """One ``TLS`` (or None: plaintext) from a client's arguments.

    ``tls``: None, False, True (TLS with the system's roots), a ``TLS``, or a dict of its
    fields; ``tls_ca`` / ``tls_cert`` / ``tls_key``: shortcuts that turn TLS on. Raises ValueError.
    """
    if isinstance(tls, dict):
        tls = TLS(**tls)
    elif tls is True:
        tls = TLS()
    elif tls is False:
        tls = None
    elif tls is not None and not isinstance(tls, TLS):
        raise ValueError(f"tls must be None, a bool, a batchd.client.transport.channel.TLS or a dict, not {type(tls).__name__}")
    shortcuts = {k: v for k, v in (("ca", tls_ca), ("cert", tls_cert), ("key", tls_key)) if v is not None}
    return replace(tls or TLS(), **shortcuts) if shortcuts else tls


def credentials(tls: TLS | None) -> grpc.ChannelCredentials | None:
    """The channel credentials for ``tls`` (None: plaintext). Every client path builds them here.

    Raises ValueError naming a file that cannot be read.
    """
    if tls is None:
        return None

    def read(what: str, path) -> bytes | None:
        if path is None:
            return None
        try:
            return pathlib.Path(path).expanduser().read_bytes()
        except OSError as e:
            raise ValueError(f"cannot read {what} {path}: {e.strerror}") from None

    return grpc.ssl_channel_credentials(
        root_certificates=read("tls_ca", tls.ca),
        private_key=read("tls_key", tls.key),
        certificate_chain=read("tls_cert", tls.cert),
    )


def resolve_token(token: str | None) -> str | None:
    """``token``, else the ``BATCHD_TOKEN`` environment variable, else None. Raises ValueError if malformed."""
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is not None:
        token = token.strip()
        if not token or not token.isprintable() or any(c.isspace() for c in token):
            raise ValueError("token must be a non-empty string without spaces")
    return token


class _Token(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
             grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call on the channel (one method for the four kinds)."""

    def __init__(self, token: str):
        self._entry = ("authorization", f"Bearer {token}")

    def _intercept(self, continuation, details: grpc.ClientCallDetails, request):
        details = _CallDetails(details.method, details.timeout, [*(details.metadata or ()), self._entry],
                               details.credentials, getattr(details, "wait_for_ready", None),
                               getattr(details, "compression", None))
        return continuation(details, request)

    intercept_unary_unary = intercept_unary_stream = intercept_stream_unary = intercept_stream_stream = _intercept


@dataclass(frozen=True)
class _CallDetails(grpc.ClientCallDetails):
    method: str
    timeout: float | None
    metadata: Any
    credentials: Any
    wait_for_ready: Any
    compression: Any


def _loopback(address: str) -> bool:
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


_warned_clear_token: set[str] = set()


def make_channel(address: str, *, tls: TLS | None = None, token: str | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> grpc.Channel:
    """A channel to ``address`` (not waited for): TLS per ``tls``, ``token`` on every call.

    Raises RuntimeError in a process forked from one where gRPC runs (``batchd.client.forks``).
    """
    forks.check_grpc(address)
    options = [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", 64 << 20),
        ("grpc.enable_retries", 1),
    ]
    creds = credentials(tls)
    if creds is None:
        channel = grpc.insecure_channel(address, options=options)
    else:
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        channel = grpc.secure_channel(address, creds, options=options)
    if token is not None:
        if creds is None and not _loopback(address) and address not in _warned_clear_token:
            _warned_clear_token.add(address)
            log.warning("sending a token to %s without TLS: it crosses the network in clear text (pass tls_ca=...)",
                        address)
        channel = grpc.intercept_channel(channel, _Token(token))
    return channel


def open_channel(address: str, *, connect_timeout: float = 10.0,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
                 tls: TLS | None = None, token: str | None = None) -> grpc.Channel:
    """A ready channel to ``address`` (``HOST:PORT`` or ``unix:PATH``); see ``make_channel``.

    Raises ConnectionError if no server answers within ``connect_timeout`` seconds (a TLS
    handshake that fails, e.g. plaintext against a TLS server, looks the same), ValueError if a
    TLS file cannot be read.
    """
    channel = make_channel(address, tls=tls, token=token, max_message_bytes=max_message_bytes)
    if not wait_for_server(channel, connect_timeout, address):
        channel.close()
        hint = "; is it a TLS server (tls_ca=...)?" if tls is None else "; check the TLS settings (tls_ca, tls_cert, tls_key)"
        raise errors.ConnectionError(f"no batchd server answered at {address} within {connect_timeout:g} s{hint}"
                                     ) from None
    return channel


@contextlib.contextmanager
def one_off(address: str, timeout: float, tls: Any = None, tls_ca: Any = None, tls_cert: Any = None,
            tls_key: Any = None, token: str | None = None) -> Iterator[grpc.Channel]:
    """A ready channel for a request or two (``list_datasets``, ``get_stats``; the arguments as theirs),
    closed after them; a failed call raises ``translate``'s error. Raises as ``open_channel``."""
    channel = open_channel(address, connect_timeout=timeout, tls=tls_settings(tls, tls_ca, tls_cert, tls_key),
                           token=resolve_token(token))
    try:
        yield channel
    except grpc.RpcError as e:
        raise translate(e, address) from None
    finally:
        channel.close()


_DEADLINE_GRACE_S = 1.0  # how long past its own deadline a call may take to end before gRPC counts as stalled


def wait_for_server(channel: grpc.Channel, timeout: float, address: str = "") -> bool:
    """Whether a server answers on ``channel`` within ``timeout`` seconds (it connects, or
    reconnects, meanwhile).

    One health ``Check`` call with ``wait_for_ready``: any answer, even UNIMPLEMENTED or
    UNAUTHENTICATED, is a server. Not ``grpc.channel_ready_future``: its connectivity polling
    thread can deadlock a later ``channel.close()`` (grpc/grpc#20026; seen here in CI).

    The call's own deadline ends it; this thread waits no longer than that plus
    ``_DEADLINE_GRACE_S``. Past it, in a child forked from a process that had loaded gRPC (where
    gRPC cannot run: ``batchd.client.forks``), raises ``forks.grpc_stalled``'s RuntimeError, the
    call and the channel held (anything done with them would hang too); elsewhere, False.
    """
    timeout = max(0.0, timeout)
    call = health_pb2_grpc.HealthStub(channel).Check.future(health_pb2.HealthCheckRequest(), timeout=timeout,
                                                            wait_for_ready=True)
    try:
        call.result(timeout=timeout + _DEADLINE_GRACE_S)
    except grpc.FutureTimeoutError:
        error = forks.grpc_stalled(f"the server at {address}" if address else "the server", timeout)
        if error is not None:
            forks.hold(call)
            forks.hold(channel)
            raise error from None
        call.cancel()
        return False
    except grpc.RpcError as e:
        return e.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
    return True


def error_detail(e: grpc.RpcError) -> pb.ErrorDetail:
    """The ``ErrorDetail`` a failed call's trailing metadata carries (``batchd-error-bin``; empty if none)."""
    detail = pb.ErrorDetail()
    for key, value in (e.trailing_metadata() or ()) if hasattr(e, "trailing_metadata") else ():
        if key == ERROR_DETAIL_KEY:
            detail.ParseFromString(value)
    return detail


def translate(e: grpc.RpcError, address: str) -> Exception:
    """The batchd or builtin exception for a failed call (see loader.proto for the codes)."""
    code, details, detail = e.code(), e.details() or "", error_detail(e)
    if code == grpc.StatusCode.NOT_FOUND:
        return DatasetNotFoundError(details)
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ShapeMismatchError(details) if detail.type == "ShapeMismatchError" else ValueError(details)
    if code == grpc.StatusCode.DATA_LOSS and detail.type == "SampleError" and detail.indices:
        return SampleError(detail.dataset, detail.indices[0], detail.paths[0] if detail.paths else "", detail.reason)
    if code == grpc.StatusCode.INTERNAL and detail.type == "WorkerError":
        return WorkerError(details)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED) or _transport_failure(code, details, detail):
        return errors.ConnectionError(f"batchd server at {address} is unavailable: {details}")
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return AuthenticationError(f"{address}: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return PermissionDeniedError(details)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return ResourceExhaustedError(details)
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return errors.TimeoutError(f"batchd server at {address} did not answer in time: {details}")
    return BatchdError(f"{code.name} from {address}: {details}")


_TRANSPORT_FAILURES = ("RST_STREAM", "Stream removed", "Socket closed", "Connection reset", "GOAWAY")


def _transport_failure(code: grpc.StatusCode, details: str, detail: pb.ErrorDetail) -> bool:
    """The connection broke (the server went away mid-call), as gRPC reports it without UNAVAILABLE."""
    return (code in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL) and not detail.type
            and any(marker in details for marker in _TRANSPORT_FAILURES))
