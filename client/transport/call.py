"""One ``Batches`` call (loader.proto): ``BatchesCall`` opens it on a channel, its ``Outbox``
(client/transport/outbox.py) as the request iterator (grants go as control frames on the data
connection once there is one that takes them, ``_open_data``), and reads it: what the server says
in the initial metadata, then the batches as ``WireBatch`` es (``messages``; on a TRANSPORT_SOCKET
call each with its ``payload`` read from the call's data connection,
``batchd.client.transport.dataplane``); a failed call's error translated (``batches_error``).
"""

from __future__ import annotations

import logging
import time
from typing import Iterator

import grpc

from batchd import datawire, errors, wire
from batchd.client import forks
from batchd.client.transport.outbox import Outbox
from batchd.client.transport.channel import error_detail, translate
from batchd.client.transport.dataplane import DataLink, DataSocket
from batchd.errors import BatchdError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader")

SERVER_ID_KEY = "batchd-server-id"
WORKERS_KEY = "batchd-workers"  # the server's worker processes (what it can build at once)
MAX_LEASES_KEY = "batchd-max-leases"  # slots it lends a shared-memory session at most
BATCHES_METHOD = "/batchd.v1.BatchLoader/Batches"
REFUSAL_WAIT_S = 2.0  # a data connection that cannot be opened: how long the call's own error may take to come



class ServerRefused(BatchdError):
    """The server refused the call's ``open`` (FAILED_PRECONDITION, ``DatasetChangedError``): its
    dataset is not the one the call expects. ``message`` is the server's explanation."""


class WeightsNotHeld(errors.ConnectionError):
    """The server does not hold the sampler's weights (FAILED_PRECONDITION, ``WeightsNotFound``: it
    restarted, or dropped them to stay within its max_weights_bytes): a ConnectionError, so the
    server's link opens the call again, the weights sent first (``ServerConnection.request``)."""


class ServerTooOld(BatchdError, RuntimeError):
    """The server does not implement ``Batches`` (UNIMPLEMENTED): it is older than this client."""


class BatchesCall:
    """One Batches call on ``channel`` to ``address`` with ``outbox`` as its request iterator.

    ``server()`` waits for the initial metadata; ``messages()`` yields (WireBatch, seconds its
    message took to come) and raises the call's error (``batches_error``); ``cancel()`` ends it.
    A forked child neither cancels the call nor reads it (``batchd.client.forks``).
    """

    def __init__(self, channel: grpc.Channel, address: str, outbox: Outbox, *, metadata: tuple = (),
                 data: DataLink | None = None):
        self.address = address
        self.outbox = outbox
        self.data = data  # how to open and read its data connection (TRANSPORT_SOCKET; lent: messages only)
        self._data_socket: DataSocket | None = None
        self._owner = forks.owner()
        forks.keep(self)
        rpc = channel.stream_stream(BATCHES_METHOD, request_serializer=pb.BatchesControl.SerializeToString,
                                    response_deserializer=None)
        try:
            self.call = rpc(iter(outbox), metadata=metadata or None)
        except grpc.RpcError as e:
            raise batches_error(e, address) from None
        self.cancelled = False
        self._in_band = False  # the call's Batch messages come on its data connection
        # grants are to go on the data connection once a batch came on it: ``outbox.direct``'s
        # arguments (releases, opens: whether the server reads those there too); None: not (or done)
        self._direct: dict | None = None

    def server(self) -> tuple[str, int, int | None]:
        """What the server says in the call's initial metadata (waits for it): its
        ``batchd-server-id`` ("" if it sent none), its worker processes (0 if it did not say) and
        the leases a shared-memory session may hold (None if it did not say). Raises the call's
        error if it failed before sending its metadata."""
        m = {k: v if isinstance(v, str) else v.decode(errors="replace") for k, v in self._initial_metadata()}
        workers, leases = m.get(WORKERS_KEY, ""), m.get(MAX_LEASES_KEY, "")
        return (m.get(SERVER_ID_KEY, ""), int(workers) if workers.isdigit() else 0,
                int(leases) if leases.isdigit() else None)

    def _initial_metadata(self) -> tuple:
        try:
            return self.call.initial_metadata() or ()
        except grpc.RpcError as e:
            raise batches_error(e, self.address) from None

    def messages(self) -> Iterator[tuple[wire.WireBatch, float, int]]:
        """(batch, seconds waited for it, bytes received for it), until the call ends OK.

        On a call whose server offered a data connection (``data``, TRANSPORT_SOCKET), the
        connection is opened first, and each batch comes with its ``payload`` read from it right
        after its message (the time and bytes count both); where the server said its messages
        come on that connection too (``batchd.datawire.messages``), batches are read from it
        alone until the server closes it, and then the call's status. Raises ``batches_error``
        of a failed call; ConnectionError if the data connection cannot be opened or breaks, or
        once ``cancel`` was called.
        """
        it = iter(self.call)
        ds = None
        try:
            if self.data is not None:
                try:
                    ds = self._open_data()
                except ConnectionError as e:
                    # the call's own error first, when it has one (a server that refused the call
                    # withdrew its token)
                    raise self._error_or(e) from None
            while True:
                t0 = time.perf_counter()
                if self._in_band:
                    got = self.data.receive_next(ds, self.call.done)
                    if got is None:  # (the server closed the data connection: its status follows)
                        if next(it, None) is not None:
                            raise errors.ConnectionError(
                                f"the batchd server at {self.address} sent a Batch message on the call after "
                                f"saying they come on its data connection")
                        return
                    raw, nbytes = got
                else:
                    data = next(it, None)
                    if data is None:
                        return
                    raw, nbytes = wire.decode_batch(data), len(data)
                    if ds is not None:
                        raw = self.data.receive(ds, raw)
                        nbytes += ds.last_received
                if ds is not None:  # (a batch came on the data connection)
                    self._confirmed(ds)
                yield raw, time.perf_counter() - t0, nbytes
        except (grpc.RpcError, ConnectionError) as e:
            if self.cancelled:
                raise errors.ConnectionError(f"the call to {self.address} was cancelled") from None
            if isinstance(e, grpc.RpcError):
                raise batches_error(e, self.address) from None
            raise
        finally:
            if ds is not None:
                ds.close()

    def _open_data(self) -> DataSocket | None:
        """The call's data connection, if its server offered one (its initial metadata)."""
        metadata = self._initial_metadata()
        ds = self.data.connect(metadata, ended=self.call.done)
        if ds is not None and self.data.lent and not datawire.messages(metadata):
            ds.close()  # (a lent batch has no payload to read there: its messages come on the call)
            return None
        if ds is None:
            if not self.data.lent:
                _say_inline(self.address)
            return None
        forks.keep(ds)
        self._data_socket = ds
        self._in_band = datawire.messages(metadata)
        if self.cancelled:  # cancelled while connecting: cancel() found no socket to close
            ds.close()
        # grants go on it once the server sent a byte there: a connection it refused (and
        # the client dials again, batchd.client.transport.redial) must not take them with it
        if datawire.controls(metadata) and ds.controls:
            self._direct = dict(releases=datawire.releases(metadata), opens=datawire.opens(metadata))
        return ds

    def _confirmed(self, ds) -> None:
        """A batch came on the data connection: from now on grants go there where they may."""
        if self._direct is not None:
            direct, self._direct = self._direct, None
            self.outbox.direct(ds.send_control, **direct)

    def _error_or(self, e: ConnectionError) -> Exception:
        """The call's own error if it ends with one within ``REFUSAL_WAIT_S`` (``batches_error``),
        else ``e``."""
        try:
            failed = self.call.exception(timeout=REFUSAL_WAIT_S)
        except Exception:  # (not over in time, or cancelled)
            return e
        return e if failed is None else batches_error(failed, self.address)

    def cancel(self) -> None:
        """Cancel the call (idempotent); the outbox stops. Nothing in a forked child."""
        if forks.forked(self._owner):
            return
        self.cancelled = True
        # the call first: an outbox that stops first ends the request stream (no `done`: the server
        # counts it cancelled either way, but would send what was granted in vain)
        self.call.cancel()
        self.outbox.abort()
        if self._data_socket is not None:
            self._data_socket.close()  # a receive waiting on it ends at once


_told_inline: set[str] = set()


def _say_inline(address: str) -> None:
    """Once per address: the server offered no data connection (no data plane there, or an older
    server): its batches come inline."""
    if address not in _told_inline:
        _told_inline.add(address)
        log.info("the batchd server at %s offers no data connection (data_plane disabled, or an older server); "
                 "its batches come inside the gRPC messages", address)


def batches_error(e: grpc.RpcError, address: str) -> Exception:
    """The exception for a failed Batches call: ``ServerRefused`` (the dataset there is not the
    expected one), ``ServerTooOld`` (no Batches there), else as ``batchd.client.transport.channel.translate``."""
    code = e.code() if hasattr(e, "code") else None
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return ServerTooOld(
            f"the batchd server at {address} does not implement the Batches call: it is older than this client "
            f"(batchd {_client_version()}); upgrade the server (or use a client of its version)")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        detail = error_detail(e)
        if detail.type == "DatasetChangedError" or not detail.type:
            return ServerRefused(f"{address}: {e.details() or detail.message}")
        if detail.type == "WeightsNotFound":
            return WeightsNotHeld(f"{address}: {e.details() or detail.message}")
    return translate(e, address)


def _client_version() -> str:
    try:
        from importlib.metadata import version

        return version("batchd")
    except Exception:  # not installed as a distribution (a source tree)
        return "from source"

