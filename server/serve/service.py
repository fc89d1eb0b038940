"""The gRPC servicer: a thin adapter from ``batchd.v1.BatchLoader`` to a ``Loader``.

Its methods are registered with gRPC by ``handlers.add_to_server`` (pre-serialized responses, a
catch-all for unexpected errors). StreamBatches and Batches calls send their batches with the
loop of ``sending.py``; a Batches call's requests are read on a thread of their own
(``CallControl``, server/serve/control.py).

Both calls send initial metadata ``batchd-server-id`` (``Loader.server_id``) before anything
else, and refuse a request whose ``expect_*`` fields do not match the dataset served
(FAILED_PRECONDITION, ErrorDetail type "DatasetChangedError"). DescribeDataset and ListDatasets
answer from a per-dataset cache of ``DatasetInfo`` (server/serve/described.py; the build parts
and fingerprints are computed once per dataset per process). Every unary call and every control message is counted
(``Loader.count``; StatsTotals), so per-batch control costs show as numbers.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time

import grpc
import numpy as np

from batchd.errors import DatasetNotFoundError, ResourceExhaustedError
from batchd.server.compute.protocol import StreamRequest
from batchd.server.loader import Loader
from batchd.server.serve import stats
from batchd.server.serve.control import CallControl
from batchd.server.serve.data_connection import CallSender
from batchd.server.serve.dataplane import DataPlane
from batchd.server.serve.described import dataset_info, expected_mismatches
from batchd.server.serve.handlers import ERROR_DETAIL_KEY
from batchd.server.serve.security import OPEN, Authenticator, Redactor, Scope
from batchd.server.serve.sending import _POLL_S, BatchSending
from batchd.server.serve.stream import Stream
from batchd.server.serve.weights import WeightsNotFoundError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

SERVER_ID_KEY = "batchd-server-id"
WORKERS_KEY = "batchd-workers"  # the server's worker processes (a Batches call's initial metadata)
MAX_LEASES_KEY = "batchd-max-leases"  # slots a shared-memory session may hold at once
OPEN_TIMEOUT_S = 30.0  # a Batches call whose first message (open) does not come within this is refused


class BatchLoaderService(BatchSending):
    """Implements the ``batchd.v1.BatchLoader`` service over ``loader``."""

    def __init__(self, loader: Loader, *, max_long_calls: int | None = None, data_plane: DataPlane | None = None):
        """max_long_calls: StreamBatches, Batches and OpenSession calls served at once (each holds a
        server thread while open); more are refused with RESOURCE_EXHAUSTED. None: no limit here.
        data_plane: where Batches calls asking for TRANSPORT_SOCKET get their data connection
        (server/serve/dataplane.py; may be set after construction); None: they are answered inline."""
        self.loader = loader
        self.max_long_calls = max_long_calls
        self.data_plane = data_plane
        self._lock = threading.Lock()
        self._long_calls = 0
        self._infos: dict[str, pb.DatasetInfo] = {}  # DescribeDataset's answers, computed once per dataset
        self._sessions_waiting: set[threading.Event] = set()  # set to end an idle OpenSession call
        # with auth: the interceptor (app.py) refuses calls without a valid token; here, each
        # call's token limits the datasets it may see. Messages to clients go through redact.
        self.auth = Authenticator(loader.config.auth) if loader.config.auth is not None else None
        self.redact = Redactor(loader.config)

    def _scope(self, context: grpc.ServicerContext) -> Scope:
        return OPEN if self.auth is None else self.auth.scope(context)

    def _check_dataset(self, context: grpc.ServicerContext, name: str) -> None:
        """PERMISSION_DENIED unless the caller's token may read ``name`` (same message if it does not exist)."""
        scope = self._scope(context)
        if not scope.allows(name):
            log.info("refused dataset %r to token %r (%s)", name[:100], scope.name, context.peer())
            context.abort(grpc.StatusCode.PERMISSION_DENIED, scope.denied(name))

    def info(self, name: str) -> pb.DatasetInfo:
        """DescribeDataset's answer for dataset ``name`` with this server's id, computed on first use
        and kept (a dataset's description does not change while the process runs). Do not modify
        it. Raises DatasetNotFoundError."""
        with self._lock:
            info = self._infos.get(name)
        if info is None:
            info = dataset_info(self.loader, name)
            info.server_id = self.loader.server_id
            with self._lock:
                info = self._infos.setdefault(name, info)
        return info

    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsResponse:
        self.loader.count("list_datasets_calls")
        scope = self._scope(context)
        names = [n for n in sorted(self.loader.datasets) if scope.allows(n)]
        return pb.ListDatasetsResponse(datasets=[self.info(n) for n in names])

    def DescribeDataset(self, request: pb.DescribeDatasetRequest, context: grpc.ServicerContext) -> pb.DatasetInfo:
        self.loader.count("describe_dataset_calls")
        self._check_dataset(context, request.name)
        try:
            info = self.info(request.name)
        except DatasetNotFoundError as e:  # the name echoed as sent: a path or not, the same answer
            context.abort(grpc.StatusCode.NOT_FOUND, self.redact(str(e), keep=(request.name,)))
        if not request.labels:
            return info
        labels = self.loader.dataset(request.name).labels()
        with_labels = pb.DatasetInfo()
        with_labels.CopyFrom(info)
        if labels is not None:
            with_labels.labels = np.ascontiguousarray(labels, "<i8").tobytes()
        return with_labels

    def PutWeights(self, chunks, context: grpc.ServicerContext) -> pb.PutWeightsResponse:
        """Hold a weight vector (``WeightsStore.put``): INVALID_ARGUMENT for a malformed upload or bad
        weights, RESOURCE_EXHAUSTED beyond max_weights_bytes."""
        self.loader.count("put_weights_calls")
        received = [0]

        def checked():
            for chunk in chunks:
                if not isinstance(chunk, pb.WeightsChunk):
                    raise ValueError("PutWeights: a WeightsChunk is not a valid protobuf message")
                received[0] += len(chunk.weights)
                yield chunk
        try:
            weights = self.loader.weights.put(checked())
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except ResourceExhaustedError as e:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        finally:
            self.loader.count("weights_bytes_received", received[0])
        log.info("holding weights %s... (%d weights, %d non-zero) from %s", weights.digest[:12], len(weights.values),
                 weights.nonzero, context.peer())
        return pb.PutWeightsResponse()

    def _admit(self, context: grpc.ServicerContext, method: str) -> None:
        """Count a long-lived call in, or refuse it (RESOURCE_EXHAUSTED) at ``max_long_calls``: the
        server threads left over stay free for Stats, ReleaseLeases and health checks."""
        with self._lock:
            if self.max_long_calls is None or self._long_calls < self.max_long_calls:
                self._long_calls += 1
                return
            n = self._long_calls
        log.warning("refused %s from %s: %d streams and sessions open, the limit (grpc_threads less the threads "
                    "kept for short calls)", method, context.peer(), n)
        context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                      f"the server already serves {n} streams and sessions, its limit; try again when one ends")

    def _leave(self) -> None:
        with self._lock:
            self._long_calls -= 1

    @property
    def long_calls(self) -> int:
        """StreamBatches, Batches and OpenSession calls being served now."""
        with self._lock:
            return self._long_calls

    def drain(self) -> None:
        """Shutting down: batches stop being built (``Loader.drain``: no slot is written again), open
        streams end with UNAVAILABLE, then idle sessions end now (not after the grace period).

        In that order: ending a session gives back every slot lent to it, while the client may
        still hold the batches in them (mapped copy-on-write: pages it has not written follow
        the slot). Were the pool still dispatching, it would build new batches into those slots.
        """
        self.loader.drain()
        with self._lock:
            waiting = list(self._sessions_waiting)
        for event in waiting:
            event.set()

    def _check_datasets(self, context: grpc.ServicerContext, request: pb.StreamBatchesRequest) -> None:
        """``_check_dataset`` for the request's dataset, or for every source of its mix."""
        if request.HasField("mix"):
            for source in request.mix.sources:
                self._check_dataset(context, source.dataset)
        else:
            self._check_dataset(context, request.dataset)

    def StreamBatches(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext):
        self._check_datasets(context, request)
        self._admit(context, "StreamBatches")
        try:
            try:
                args = StreamRequest.from_proto(request, context.peer())
            except ValueError as e:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.redact(str(e)))
            if args.transport == "socket":  # a Batches call's transport only (loader.proto)
                args = dataclasses.replace(args, transport="inline")
            self._send_metadata(context, args)
            stream = self._open(request, args, context)
            yield from self._serve(stream, context)
        finally:
            self._leave()

    def Batches(self, requests, context: grpc.ServicerContext):
        """The bidirectional call (loader.proto; docs/design/stream-protocol.md): the first message
        opens the stream, later ones grant, revoke, release and report progress (``CallControl``),
        and a later ``open`` switches the call to another request (the next epoch: a new stream,
        ``open_seq`` one more); batches are sent as they are built. Ends OK once the client
        half-closed and every grant was sent; INVALID_ARGUMENT for a bad message or grant,
        RESOURCE_EXHAUSTED past max_grants, UNAVAILABLE when the server shuts down, as
        StreamBatches otherwise."""
        self._admit(context, "Batches")
        control = sender = None
        try:
            control = CallControl(requests, is_active=context.is_active, transport=self.loader.transport,
                                  max_grants=self.loader.config.max_grants, count=self.loader.count)
            request = self._await_open(control, context)
            if request is None:
                return  # the client went away first
            open_seq = 0
            while request is not None:
                self._check_datasets(context, request)
                try:
                    args = StreamRequest.from_proto(request, context.peer())
                except ValueError as e:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.redact(str(e)))
                args = dataclasses.replace(args, start_batch=0, batch_stride=0, batch_offset=0, end_batch=0,
                                           prefetch=0, granted=True)
                if open_seq == 0 and args.transport == "socket":
                    sender = (self._data_sender(context, control, request.data_messages)
                              if args.compression == "none" else None)
                elif open_seq == 0 and args.transport == "shm" and request.data_messages:
                    sender = self._data_sender(context, control, True)  # (messages and frames only: none, no data plane)
                if args.transport == "socket" and sender is None:
                    # no data plane here, or the client asked for compressed bytes: inline
                    args = dataclasses.replace(args, transport="inline")
                if open_seq == 0:
                    self._send_metadata(context, args, sender.metadata() if sender is not None else ())
                stream = self._open(request, args, context, open_seq)
                control.attach(stream)
                yield from self._serve(stream, context, control, sender)
                request = control.take_next_open()  # the client switched the call to the next epoch
                open_seq += 1
            if open_seq > 1:  # (its later passes were logged at debug)
                log.info("Batches call from %s ended after %d passes", context.peer(), open_seq)
        finally:
            if sender is not None:
                sender.close()
            if control is not None:
                control.detach()
            self._leave()

    def _data_sender(self, context: grpc.ServicerContext, control: CallControl, messages: bool) -> CallSender | None:
        """The call's side of the data plane (its token, then its connection; ``messages``: the
        Batch messages go on it too), or None: the server has none (``data_plane.enabled:
        false``, a unix:-only server) or it is closing."""
        if self.data_plane is None:
            return None
        try:
            return CallSender(self.data_plane, cancelled=lambda: not context.is_active(), control=control,
                              messages=messages)
        except ConnectionAbortedError:
            return None

    def _await_open(self, control: CallControl, context: grpc.ServicerContext) -> pb.StreamBatchesRequest | None:
        """The Batches call's ``open`` (polling: the call may end meanwhile); None if the call ended.
        INVALID_ARGUMENT for a first message that does not open, or none within ``OPEN_TIMEOUT_S``."""
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        while not control.wait_open(_POLL_S):
            if not context.is_active():
                return None
            if time.monotonic() > deadline:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                              f"Batches: no first BatchesControl (open) within {OPEN_TIMEOUT_S:g} s")
        if control.error is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.redact(str(control.error)))
        return control.open

    def _send_metadata(self, context: grpc.ServicerContext, args: StreamRequest, metadata: tuple = ()) -> None:
        """The call's initial metadata: the server id, its capacity (``batchd-workers``, and on a
        shared-memory call ``batchd-max-leases``), and ``metadata`` (a data connection's port and
        token). CANCELLED if the client went away already."""
        capacity = ((WORKERS_KEY, str(self.loader.pool.num_workers)),)
        if args.transport == "shm":
            capacity += ((MAX_LEASES_KEY, str(self.loader.config.max_leases_per_session)),)
        try:
            context.send_initial_metadata(((SERVER_ID_KEY, self.loader.server_id), *capacity, *metadata))
        except grpc.RpcError:  # the client went away already
            context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")

    def _open(self, request: pb.StreamBatchesRequest, args: StreamRequest, context: grpc.ServicerContext,
              open_seq: int = 0) -> Stream:
        """Check the request's expect_* fields and open its stream (``open_seq``: a Batches call's
        count of earlier ``open`` messages); aborts with the status each refusal maps to
        (NOT_FOUND, INVALID_ARGUMENT, FAILED_PRECONDITION, RESOURCE_EXHAUSTED, UNAVAILABLE while
        shutting down)."""
        try:
            self._check_expected(request, context)
            return self.loader.open_stream(args, open_seq=open_seq)
        except DatasetNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, self.redact(str(e), keep=(request.dataset,)))
        except WeightsNotFoundError as e:  # the client sends them again (PutWeights) and opens again
            detail = pb.ErrorDetail(type="WeightsNotFound", message=str(e), dataset=request.dataset)
            context.set_trailing_metadata(((ERROR_DETAIL_KEY, detail.SerializeToString()),))
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.redact(str(e)))
        except ResourceExhaustedError as e:
            log.warning("refused a stream from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.redact(str(e)))

    def _check_expected(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext) -> None:
        """FAILED_PRECONDITION (ErrorDetail type DatasetChangedError) unless the dataset served is the
        one the request expects. Raises DatasetNotFoundError."""
        try:
            differ = expected_mismatches(request, self.info)
        except DatasetNotFoundError:
            if not request.HasField("mix"):
                raise
            differ = []  # (an unknown source: open_stream names it, INVALID_ARGUMENT)
        if not differ:
            return
        message = (f"dataset {request.dataset or 'mix'!r} on this server is not the one the client expects: "
                   f"{'; '.join(differ)} (expected vs served)")
        log.warning("refused a stream from %s: %s", context.peer(), message)
        detail = pb.ErrorDetail(type="DatasetChangedError", message=message, dataset=request.dataset)
        context.set_trailing_metadata(((ERROR_DETAIL_KEY, detail.SerializeToString()),))
        context.abort(grpc.StatusCode.FAILED_PRECONDITION, message)

    def OpenSession(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext):
        """The first event names the probe segment; then the call stays open, its thread waiting on
        an event (set when the call ends, or by ``drain``), until the client or the server ends it."""
        if not request.session:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "session id is empty")
        self._admit(context, "OpenSession")
        ended = threading.Event()
        try:
            if not context.add_callback(ended.set):
                return  # the call is over already
            with self._lock:
                self._sessions_waiting.add(ended)
            if self.loader.draining or self.loader.closed:
                return
            yield from self._session(request, context, ended)
        finally:
            with self._lock:
                self._sessions_waiting.discard(ended)
            self._leave()

    def _session(self, request: pb.OpenSessionRequest, context: grpc.ServicerContext, ended: threading.Event):
        leases, owner = self.loader.leases, self.loader.owner
        leases.open(request.session)
        log.info("shared-memory session %s opened by %s", request.session[:8], context.peer())
        try:
            yield pb.SessionEvent(probe_segment=owner.probe_name, probe_token=owner.probe_token)
            ended.wait()
        finally:
            returned = leases.close(request.session)
            log.info("shared-memory session %s closed; %d slots it held went back", request.session[:8], returned)

    def ReleaseLeases(self, request: pb.ReleaseLeasesRequest, context: grpc.ServicerContext):
        self.loader.count("release_leases_calls")
        released = self.loader.transport.release(request)
        if released:
            self.loader.count("leases_released_by_rpc", released)
        return pb.ReleaseLeasesResponse()

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
        self.loader.count("stats_calls")
        reply = stats_to_proto(stats.snapshot(self.loader))
        scope = self._scope(context)
        if scope.datasets is not None:  # a token limited to some datasets sees only their streams
            kept = [s for s in reply.streams if scope.allows(s.dataset)]
            del reply.streams[:]
            reply.streams.extend(kept)
            kept_cache = [c for c in reply.cache if scope.allows(c.dataset)]
            del reply.cache[:]
            reply.cache.extend(kept_cache)
        return reply


def stats_to_proto(s: stats.ServerStats) -> pb.StatsResponse:
    return pb.StatsResponse(
        uptime_seconds=s.uptime_seconds,
        version=s.version,
        streams=[pb.StreamStats(**dataclasses.asdict(st)) for st in s.streams],
        pool=pb.PoolStats(**dataclasses.asdict(s.pool)),
        totals=pb.StatsTotals(**dataclasses.asdict(s.totals)),
        cache=[pb.CacheStats(**dataclasses.asdict(c)) for c in s.cache],
    )
