"""One batchd server as a loader sees it: ``ServerConnection``.

Its channel, the dataset's ``DatasetInfo`` (described once per server process: again only when
the server's id changed, ``check_server``), its shared-memory session (opened on first use), its
``DataLink`` (the socket data plane, ``wants_socket``), and the ``Batches`` call it opens
(``open_call``, ``batchd.client.transport.call``), whose request stream carries a pass's ``open``
and then its grants, revokes, lease releases and progress. A server's link
(``batchd.client.transport.link``) holds one connection at a time and replaces it when the
server comes back after a failure.

``options`` is the loader's ``LoaderOptions`` (transport/ does not import the facade).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
import weakref
from typing import Any, Callable

import grpc
import tenacity

from batchd import errors
from batchd.client import forks
from batchd.client.transport import buffers, orders, relay
from batchd.client.transport.call import BatchesCall
from batchd.client.transport.channel import open_channel, wait_for_server
from batchd.client.transport.dataplane import DataLink
from batchd.client.transport.datasets import DatasetInfo, mismatches
from batchd.client.transport.outbox import Outbox
from batchd.client.transport.shm import SharedMemorySession, SharedMemoryUnavailable
from batchd.errors import DatasetChangedError, DatasetNotFoundError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.client.loader")  # users (and tests) watch this logger
_RELEASE_TIMEOUT_S = 10.0  # a ReleaseLeases call's deadline (seconds)
_RELEASE_RETRY_S = 30.0  # a ReleaseLeases call that fails with a transient status is retried this long (seconds)
_TRANSIENT = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED,
              grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.ABORTED}


class ServerConnection:
    """A channel to ``address`` and the dataset ``options.dataset`` there.

    transfer: the loader's ``CudaTransfer`` (None for CPU batches). freed(session, lease): where
    the shared-memory session's freed leases go (its link; called in finalizers, so it takes no
    lock). Raises (at construction) ConnectionError if no server answers within
    ``options.connect_timeout`` seconds, DatasetNotFoundError, ValueError (TLS files),
    AuthenticationError/PermissionDeniedError.
    """

    def __init__(self, address: str, options: Any, transfer: Any = None,
                 freed: Callable[[str, int], None] = lambda session, lease: None, *, warned: set | None = None):
        self.address = address
        self.options = options
        self.transfer = transfer
        self.freed = freed  # (a link made after the connection sets it before its first call)
        self._warned = warned if warned is not None else set()  # what was said once per loader (a set of keys)
        self._channel = open_channel(address, connect_timeout=options.connect_timeout,
                                     max_message_bytes=options.max_message_bytes, tls=options.tls, token=options.token)
        self._owner = forks.owner()  # a forked child neither uses nor closes this channel (batchd.client.forks)
        forks.keep(self)
        self._finalizer = weakref.finalize(self, forks.in_owner(self._owner, self._channel.close))
        # the shared-memory session opened so far (None: none, or the transport is not shared memory)
        self.shm: SharedMemorySession | None = None
        self._shm_tried = False
        self._release_rpc = self._channel.unary_unary(
            "/batchd.v1.BatchLoader/ReleaseLeases", request_serializer=pb.ReleaseLeasesRequest.SerializeToString,
            response_deserializer=pb.ReleaseLeasesResponse.FromString)
        # the socket data plane (TRANSPORT_SOCKET): its payloads go to the relay's buffers (client/transport/relay.py),
        # to pinned ones when copied to CUDA, else to ordinary ones
        if options.relay is True and not relay.AVAILABLE:
            raise ValueError("relay=True needs Linux (memfd_create); use relay='auto' or False")
        use_relay = options.relay is True or (options.relay == "auto" and transfer is None and relay.AVAILABLE)
        link_relay = relay.shared() if use_relay else None
        pool = buffers.BufferPool(link_relay.buffers if link_relay is not None else
                                  buffers.PinnedPool() if transfer is not None else buffers.pageable)
        self.data = DataLink(address, options.tls, pool, connect_timeout=options.connect_timeout,
                             timeout=options.timeout, optional=options.transport == "auto", relay=link_relay,
                             max_message=options.max_message_bytes)
        # a shared-memory call's messages and control frames (no payload: never through the relay)
        self.lent_messages = DataLink(address, options.tls, buffers.BufferPool(buffers.pageable),
                                      connect_timeout=options.connect_timeout, timeout=options.timeout,
                                      optional=True, max_message=options.max_message_bytes, lent=True)
        self.tag = uuid.uuid4().hex[:12]  # its calls' stream_tags begin with it (unique across clients)
        self.describes = 0  # DescribeDataset calls made (one per server process, unless its data changed)
        # the sampler's weights are held there: sent before the first call, again after the server
        # restarted (another id), a restart of the session or a WeightsNotHeld (the link resets it)
        self.weights_sent = False
        try:
            self.info: DatasetInfo = self._describe(options.connect_timeout)
        except BaseException:
            self.close()
            raise

    def _describe(self, timeout: float) -> DatasetInfo:
        self.describes += 1
        return orders.describe(self._channel, self.address, self.options, timeout)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def shared_memory(self) -> SharedMemorySession | None:
        """The shared-memory session, opened on first use; None when batches travel otherwise.

        Raises RuntimeError if ``transport="shm"`` and the server's shared memory is not readable
        here, ConnectionError if the server cannot be reached (then nothing is decided).
        """
        if self.options.transport in ("inline", "socket") or self._shm_tried:
            return self.shm
        try:  # (a ConnectionError: unreachable now, asked again on the next call)
            self.shm = SharedMemorySession.open(self._channel, self.address, self.options.connect_timeout,
                                                self.freed)
            self._shm_tried = True
        except SharedMemoryUnavailable as e:
            self._shm_tried = True
            if self.options.transport == "shm":
                raise RuntimeError(f"transport='shm' but shared memory with {self.address} is unavailable: {e}") from None
            if ("no-shm", self.address) not in self._warned:  # (once per loader and server)
                self._warned.add(("no-shm", self.address))
                log.warning("shared memory with %s is unavailable (%s); batches travel over the network: on the "
                            "server's data plane where it has one, else in gRPC messages", self.address, e)
        return self.shm

    def wants_socket(self) -> bool:
        """Whether calls ask for the socket data plane: ``transport="socket"``, or ``"auto"`` without
        shared memory, to a server with a host to dial (not ``unix:``) whose data port was not
        found unreachable (``DataLink.reachable``)."""
        t = self.options.transport
        if t == "socket":
            return self.data.possible
        return t == "auto" and self.data.possible and self.data.reachable and self.shared_memory() is None

    def new_session(self) -> None:
        """After a broken call (a restarted server has new shared memory): close the old session
        (it ends once the batches still held on it are freed) and open a new one on next use. The
        sampler's weights are sent again before the next call (the server may have restarted, or
        dropped them: ``WeightsNotHeld``)."""
        self.weights_sent = False
        if self.shm is not None:
            self.shm.close()
        self.shm, self._shm_tried = None, False

    def request(self, epoch: int, *, start_position: int = 0, transport: int | None = None,
                tag: str = "") -> pb.StreamBatchesRequest:
        """The ``open`` of a pass over ``epoch`` (its remainder from ``start_position``), with the
        dataset this loader expects there: its size always, its dataset and build fingerprints
        under ``strict`` (the server refuses the call otherwise). ``transport``: the call's (a
        later ``open`` keeps its call's); None: chosen now, opening the shared-memory session on
        first use (see ``shared_memory``). ``tag``: the call's stream_tag (the server records the
        leases it sends under it; a broken call is reported by it). A call's first ``open``
        (``transport`` None) sends a weighted sampler's weights first unless ``weights_sent``."""
        o, info = self.options, self.info
        if transport is None:
            if orders.needs_upload(o) and not self.weights_sent:
                orders.put_weights(self._channel, self.address, o.sampler, o.connect_timeout)
                self.weights_sent = True
            shm = self.shared_memory()
            transport = (pb.TRANSPORT_SHARED_MEMORY if shm is not None else
                         pb.TRANSPORT_SOCKET if self.wants_socket() else pb.TRANSPORT_INLINE)
        shm = self.shm if transport == pb.TRANSPORT_SHARED_MEMORY else None
        return orders.apply(pb.StreamBatchesRequest(
            dataset=o.dataset, pipeline=o.pipeline, batch_size=o.batch_size, shuffle=o.shuffle,
            seed=o.seed, epoch=epoch, drop_last=o.drop_last, rank=o.rank, world_size=o.world_size,
            transport=transport, session=shm.session if shm is not None else "", compression=o.compression,
            stream_tag=tag,
            image_encoding=pb.IMAGE_ENCODING_JPEG if o.decode_on_client else pb.IMAGE_ENCODING_DECODED,
            start_position=start_position, expect_num_samples=info.num_samples,
            data_messages=transport == pb.TRANSPORT_SOCKET or (
                transport == pb.TRANSPORT_SHARED_MEMORY and self.lent_messages.possible
                and self.lent_messages.reachable),
            expect_fingerprint=info.fingerprint if o.strict else "",
            expect_build_fingerprint=info.build_fingerprint if o.strict else "",
        ), o, info)

    def open_call(self, request: pb.StreamBatchesRequest, progress: Any, take_releases: Callable[[], list[int]],
                  pending: Callable[[], bool]) -> BatchesCall:
        """The Batches call for ``request`` (its first ``open``; nothing granted yet: ``call.outbox``).
        The session's freed leases ride on it (``take_releases``; ``pending``: whether any is
        queued). Raises ConnectionError and the errors of ``batches_error``."""
        shm = self.shm if request.session else None
        releases = {} if shm is None else dict(
            take_releases=take_releases, pending=pending, sent=shm.forget,
            unsent=lambda leases: [self.freed(shm.session, lease) for lease in leases])
        outbox = Outbox(request, progress=progress, **releases)
        data = (self.data if request.transport == pb.TRANSPORT_SOCKET else
                self.lent_messages if request.data_messages else None)
        return BatchesCall(self._channel, self.address, outbox, data=data)

    def release(self, session: str, leases: list[int] = (), *, abandoned: str = "",
                received: list[int] = ()) -> bool:
        """ReleaseLeases, for what cannot ride on a call: ``leases`` freed after the call ended,
        or the report of a call that broke (``abandoned``: its tag; ``received``: the leases of
        the session still held here: the server releases the others sent on it). A transient
        failure is retried with exponential backoff (tenacity) for ``_RELEASE_RETRY_S`` seconds,
        or until the session is gone. False if the server could not be told (its session ends
        with its call, and every slot with it)."""
        request = pb.ReleaseLeasesRequest(session=session, leases=list(leases), abandoned_stream=abandoned,
                                          received_leases=list(received))
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, grpc.RpcError) and e.code() in _TRANSIENT),
            wait=tenacity.wait_exponential(multiplier=0.1, max=2.0),
            stop=tenacity.stop_after_delay(_RELEASE_RETRY_S) | (lambda _: self.shm is None or self.shm.gone),
            reraise=True)
        try:
            retrying(self._release_rpc, request, timeout=_RELEASE_TIMEOUT_S)
        except (grpc.RpcError, ValueError) as e:  # (ValueError: the channel is closed)
            log.debug("could not release %d leases on %s: %s", len(leases) + len(received), self.address, e)
            return False
        if self.shm is not None and self.shm.session == session and leases:
            self.shm.forget(list(leases))
        return True

    def check_server(self, server_id: str, timeout: float) -> None:
        """A call began on server process ``server_id`` (``batchd-server-id``): describe the dataset
        again only when that differs from the process last described (``check_unchanged``, which
        raises if it changed beyond what the loader accepts)."""
        if server_id and server_id != self.info.server_id:
            if self.info.server_id:
                log.info("batchd server at %s restarted (server id %s, was %s); describing %r again", self.address,
                         server_id, self.info.server_id, self.options.dataset)
            self.check_unchanged(timeout)

    def check_unchanged(self, timeout: float) -> None:
        """Describe the dataset again and compare it with ``self.info`` (``accepted``): a restarted
        server may serve other files under the same name. Called when a call shows another server
        id, or the server refused a call's expected dataset.

        ``self.info`` becomes the new description. Raises DatasetChangedError as ``accepted``;
        ConnectionError or TimeoutError if the server does not answer within ``timeout`` seconds;
        DatasetNotFoundError if it no longer serves the dataset.
        """
        now = self._describe(timeout)
        self.weights_sent = self.weights_sent and now.server_id == self.info.server_id
        accepted(self.options, self.address, self.info, now, " (a restart)")
        self.info = now

    def refusal(self, refused: Exception, timeout: float) -> BaseException:
        """The DatasetChangedError behind a call the server ``refused`` (``ServerRefused``): the
        dataset described again and compared (``check_unchanged`` raises it, naming what changed);
        the server's words if that shows nothing."""
        try:
            self.check_unchanged(timeout)
        except (DatasetChangedError, DatasetNotFoundError, ConnectionError, TimeoutError) as changed:
            return changed
        return DatasetChangedError(self.options.dataset, self.address, [str(refused)])

    def wait_ready(self, timeout: float) -> bool:
        """Whether the channel is (again) connected within ``timeout`` seconds."""
        return wait_for_server(self._channel, timeout)

    def serving(self, timeout: float) -> bool:
        """Whether the server's gRPC health service says SERVING (not draining) within ``timeout`` s."""
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        try:
            reply = health_pb2_grpc.HealthStub(self._channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        """Close the channel (a shared-memory session must have ended: ``ServerLink`` sees to it).
        Idempotent; nothing in a forked child (the channel is the parent's)."""
        if forks.forked(self._owner):
            return
        if self.shm is not None:
            self.shm.close()
        if self._finalizer.alive:
            self._finalizer()


def accepted(options: Any, address: str, before: DatasetInfo, now: DatasetInfo, how: str = "") -> None:
    """The one comparison a loader makes on a server it reconnects to or probes, where it may read
    on from ``now`` after ``before``: raises DatasetChangedError (a ValueError) naming the dataset,
    ``address`` and what changed if the number of samples differs (an epoch's batches are planned
    from it), or, under ``options.strict``, a dataset or build fingerprint (other bytes:
    ``datasets.mismatches``); else warns where fingerprints differ (``how``: said after
    "changed", e.g. " (a restart)")."""
    size = None if before.num_samples == now.num_samples else (before.num_samples, now.num_samples)
    changes = mismatches(before.identity(), now.identity())
    if size is not None or (options.strict and changes):
        raise DatasetChangedError(options.dataset, address, changes, size)
    if changes:
        log.warning("dataset %r at %s changed since the loader last read it%s: %s (before vs now); going on "
                    "with the new data (strict=False)", options.dataset, address, how, "; ".join(changes))


def probe(address: str, options: Any, transfer: Any, freed: Callable[[str, int], None], warned: set,
          reference: DatasetInfo | None, timeout: float) -> ServerConnection:
    """A fresh connection to a server that was down (or never answered), checked: its health
    service says SERVING and it serves ``reference``'s dataset (``accepted``). ``timeout``:
    seconds to connect and ask. Raises ConnectionError or TimeoutError (not there, or not
    SERVING), DatasetChangedError, and what a first description raises.
    """
    fresh = ServerConnection(address, dataclasses.replace(options, connect_timeout=timeout), transfer, freed,
                             warned=warned)
    try:
        if not fresh.serving(timeout):
            raise errors.ConnectionError(f"batchd server {address}: its health service does not say SERVING")
        if reference is not None:
            accepted(options, address, reference, fresh.info)
    except BaseException:
        fresh.close()
        raise
    return fresh
