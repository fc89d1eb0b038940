"""The ``data_plane:`` block of the server's config: the TCP port that carries batch bytes beside
``Batches`` calls that ask for ``TRANSPORT_SOCKET`` (server/serve/dataplane.py,
docs/design/network-path.md), and the limits on connections that have not yet presented their
token (server/serve/handshakes.py).

Example::

    data_plane: {}                   # on by default, on the gRPC port + 1 (50052 beside 50051)
    data_plane: {port: 50100}        # another fixed port (open it in the firewall beside the gRPC port)
    data_plane: {port: 0}            # a free port the server picks (clients learn it per call)
    data_plane: {enabled: false}     # no data plane: remote clients receive batches inline
"""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import StrictModel


class DataPlaneConfig(StrictModel):
    """The data plane's listener.

    enabled: listen at all (False: every call is answered inline, as by a server without one).
    port: the TCP port, on the host of the gRPC address. None (default): the gRPC port + 1
        (``port_for``), or a free one where the gRPC port is 0 (tests); 0: a free one. Clients
        learn it from each call's initial metadata. It speaks TLS with the gRPC port's
        certificate, key and client CA whenever the config has a ``tls`` block.
    token_ttl_s: a client must open its data connection within this many seconds of the call's
        answer; its one-time token is refused afterwards.
    first_byte_timeout_s: a connection that sends no byte (TLS ClientHello or token) within this
        many seconds of its accept is closed (clients send at once).
    handshake_timeout_s: TLS handshake and token within this many seconds of the accept.
    max_handshakes: connections waiting for their handshake and token at once; a new one beyond
        evicts the oldest (one thread reads them all: a waiting connection costs a socket).
    max_handshakes_per_source: of those, from one source address; a new one beyond evicts that
        address's oldest.
    """

    enabled: bool = True
    port: int | None = Field(default=None, ge=0, le=65535)
    token_ttl_s: float = Field(default=10.0, gt=0, le=300)
    first_byte_timeout_s: float = Field(default=2.0, gt=0, le=60)
    handshake_timeout_s: float = Field(default=5.0, gt=0, le=120)
    max_handshakes: int = Field(default=1024, ge=1, le=1 << 20)
    max_handshakes_per_source: int = Field(default=64, ge=1, le=1 << 20)

    @model_validator(mode="after")
    def _limits(self) -> "DataPlaneConfig":
        if self.first_byte_timeout_s > self.handshake_timeout_s:
            raise ValueError(f"first_byte_timeout_s ({self.first_byte_timeout_s:g}) must not exceed "
                             f"handshake_timeout_s ({self.handshake_timeout_s:g})")
        return self

    def port_for(self, grpc_port: int) -> int:
        """The port to listen on beside a gRPC port configured as ``grpc_port``: ``port`` if set,
        else ``grpc_port + 1``, or 0 (a free one) where ``grpc_port`` is 0. Raises ValueError for
        gRPC port 65535 with no ``port`` set."""
        if self.port is not None:
            return self.port
        if grpc_port == 0:
            return 0
        if grpc_port >= 65535:
            raise ValueError("data_plane.port: the gRPC port is 65535, so the default (the gRPC port + 1) does "
                             "not exist; set data_plane.port")
        return grpc_port + 1
