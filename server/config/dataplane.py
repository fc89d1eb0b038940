"""The ``data_plane:`` block of the server's config: the TCP port that carries batch bytes beside
``Batches`` calls that ask for ``TRANSPORT_SOCKET`` (server/serve/dataplane.py,
docs/design/network-path.md).

Example::

    data_plane: {port: 0}            # on by default, on a free port the server picks
    data_plane: {port: 50052}        # a fixed port (open it in the firewall beside the gRPC port)
    data_plane: {enabled: false}     # no data plane: remote clients receive batches inline
"""

from __future__ import annotations

from pydantic import Field

from .base import StrictModel


class DataPlaneConfig(StrictModel):
    """The data plane's listener.

    enabled: listen at all (False: every call is answered inline, as by a server without one).
    port: the TCP port, on the host of the gRPC address (0: a free one, which clients learn from
        each call's initial metadata). It speaks TLS with the gRPC port's certificate, key and
        client CA whenever the config has a ``tls`` block.
    token_ttl_s: a client must open its data connection within this many seconds of the call's
        answer; its one-time token is refused afterwards.
    """

    enabled: bool = True
    port: int = Field(default=0, ge=0, le=65535)
    token_ttl_s: float = Field(default=10.0, gt=0, le=300)
