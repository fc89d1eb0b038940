"""The gRPC servicer: a thin adapter from ``batchd.v1.BatchLoader`` to a ``Loader``.

StreamBatches responses come pre-serialized from ``Transport.encode`` (server/serve/transport.py: the
slot lent in place, or its bytes copied once into the message), so the handler is registered
with an identity serializer. The stream's generator never blocks for long: it waits for the next batch in slices
of ``_POLL_S`` and stops as soon as ``context.is_active()`` turns false (client gone).
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import traceback
import uuid

import grpc

from batchd.errors import DatasetNotFoundError, ResourceExhaustedError, SampleError, ShapeMismatchError, WorkerError
from batchd.server import build
from batchd.server.serve import stats
from batchd.server.serve.lag import LagLog
from batchd.server.loader import Loader
from batchd.server.compute.pool import WAKE_STREAM
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.security import OPEN, Authenticator, Redactor, Scope
from batchd.server.serve.transport import LEASE_WAIT_S
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

SERVICE = "batchd.v1.BatchLoader"
ERROR_DETAIL_KEY = "batchd-error-bin"
_POLL_S = 0.25


def dataset_info(loader: Loader, name: str) -> pb.DatasetInfo:
    """DescribeDataset's answer: size, classes, the sample's fields (``Dataset.fields``, then index
    and position), the dataset and build fingerprints, on_error."""
    ds = loader.dataset(name)
    parts = build.build_parts(ds.decode_settings, cache=loader.cache is not None)
    return pb.DatasetInfo(
        name=name,
        kind=ds.kind,
        num_samples=len(ds),
        class_names=list(ds.classes),
        sample=[
            *(pb.TensorSpec(name=f.name, dtype=f.dtype, shape=list(f.shape)) for f in ds.fields),
            pb.TensorSpec(name="index", dtype="int64", shape=[]),
            pb.TensorSpec(name="position", dtype="int64", shape=[]),  # in the epoch's global order (server/compute/worker.py)
        ],
        fingerprint=ds.fingerprint,
        build_fingerprint=build.build_fingerprint(parts),
        build=parts,
        on_error=loader.config.datasets[name].on_error,
    )


class BatchLoaderService:
    """Implements ListDatasets, DescribeDataset and StreamBatches over ``loader``."""

    def __init__(self, loader: Loader, *, max_long_calls: int | None = None):
        """max_long_calls: StreamBatches and OpenSession calls served at once (each holds a server
        thread while open); more are refused with RESOURCE_EXHAUSTED. None: no limit here."""
        self.loader = loader
        self.max_long_calls = max_long_calls
        self._lock = threading.Lock()
        self._long_calls = 0
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

    def ListDatasets(self, request: pb.ListDatasetsRequest, context: grpc.ServicerContext) -> pb.ListDatasetsResponse:
        scope = self._scope(context)
        names = [n for n in sorted(self.loader.datasets) if scope.allows(n)]
        return pb.ListDatasetsResponse(datasets=[dataset_info(self.loader, n) for n in names])

    def DescribeDataset(self, request: pb.DescribeDatasetRequest, context: grpc.ServicerContext) -> pb.DatasetInfo:
        self._check_dataset(context, request.name)
        try:
            return dataset_info(self.loader, request.name)
        except DatasetNotFoundError as e:  # the name echoed as sent: a path or not, the same answer
            context.abort(grpc.StatusCode.NOT_FOUND, self.redact(str(e), keep=(request.name,)))

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
        """StreamBatches and OpenSession calls being served now."""
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

    def StreamBatches(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext):
        self._check_dataset(context, request.dataset)
        self._admit(context, "StreamBatches")
        try:
            yield from self._stream(request, context)
        finally:
            self._leave()

    def _stream(self, request: pb.StreamBatchesRequest, context: grpc.ServicerContext):
        try:
            stream = self.loader.open_stream(StreamRequest.from_proto(request, context.peer()))
        except DatasetNotFoundError as e:
            context.abort(grpc.StatusCode.NOT_FOUND, self.redact(str(e), keep=(request.dataset,)))
        except ValueError as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, self.redact(str(e)))
        except ResourceExhaustedError as e:
            log.warning("refused a stream from %s: %s", context.peer(), e)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except RuntimeError as e:
            context.abort(grpc.StatusCode.UNAVAILABLE, self.redact(str(e)))
        reason = "finished"
        transport = self.loader.transport
        lag = LagLog(stream, self.loader)
        try:
            while True:
                if self.loader.draining:
                    reason = "ended: the server is shutting down"
                    context.abort(grpc.StatusCode.UNAVAILABLE,
                                  f"the server is shutting down; reconnect to resume at batch {stream.next_index}")
                if stream.waiting_since is None:
                    stream.waiting_since = time.monotonic()
                try:
                    batch = stream.next(_POLL_S)
                except (SampleError, ShapeMismatchError, WorkerError, ResourceExhaustedError, ValueError, TypeError) as e:
                    reason = f"failed: {type(e).__name__}"
                    _abort_with_detail(context, stream.request.dataset, e, self.redact)
                    return
                if transport.abandoned(stream):
                    if batch is not None:
                        stream.release(batch, sent=False)
                    reason = "abandoned by the client"
                    return
                if batch is None:
                    if stream.finished:
                        return
                    if not context.is_active():
                        reason = "cancelled by the client"
                        return
                    lag.waiting()
                    continue
                lag.got_batch(batch.batch_index)
                data = self._send(stream, batch, context)
                if data is None:  # the call ended, or the server began draining, while a lease was awaited
                    if self.loader.draining:
                        continue  # the check above ends the call
                    reason = "cancelled by the client"
                    return
                stream.bytes_sent += len(data)
                yield data
        finally:
            self.loader.close_stream(stream, reason)

    def _send(self, stream, batch, context: grpc.ServicerContext) -> bytes | None:
        """Serialize ``batch`` for the client (lent or inline: ``Transport.encode``), then let go of it.

        At the session's lease cap, waits up to ``LEASE_WAIT_S`` for a lease to come back; None if
        the call ended (or the server began draining) meanwhile.
        """
        patient_until = time.monotonic() + LEASE_WAIT_S
        data = None
        stream.send_started = time.perf_counter()  # the batch's send_seconds count from here (Transport)
        try:
            while data is None:
                data = self.loader.transport.encode(stream, batch, patient=time.monotonic() < patient_until)
                if data is None and (not context.is_active() or self.loader.draining):
                    return None
            return data
        finally:
            stream.release(batch, sent=data is not None)
            self.loader.pool.wake(WAKE_STREAM)  # a prefetch place is free

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
        self.loader.transport.release(request)
        return pb.ReleaseLeasesResponse()

    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext) -> pb.StatsResponse:
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


def _abort_with_detail(context: grpc.ServicerContext, dataset: str, e: BaseException, redact=None) -> None:
    detail = pb.ErrorDetail(type=type(e).__name__, dataset=dataset)
    if isinstance(e, SampleError):
        detail.indices.append(e.index)
        detail.paths.append(redact(e.path) if redact is not None else e.path)
        detail.reason = redact(e.reason) if redact is not None else e.reason
    code = grpc.StatusCode.INTERNAL if isinstance(e, WorkerError) else (
        grpc.StatusCode.DATA_LOSS if isinstance(e, SampleError) else
        grpc.StatusCode.RESOURCE_EXHAUSTED if isinstance(e, ResourceExhaustedError) else grpc.StatusCode.INVALID_ARGUMENT
    )
    log.error("stream on dataset %r failed: %s", dataset, "".join(traceback.format_exception(e)).rstrip())
    message = str(e).split("\n\nWorker traceback:")[0]  # the traceback stays in the server log
    if getattr(e, "__notes__", None) and not isinstance(e, WorkerError):
        message += "\n" + "\n".join(n for n in e.__notes__ if not n.startswith("Worker traceback"))
    if redact is not None:  # no server paths or tracebacks for the client; the log above has them
        message = redact(message)
    detail.message = message
    context.set_trailing_metadata(((ERROR_DETAIL_KEY, detail.SerializeToString()),))
    context.abort(code, message)


def _internal_error(context: grpc.ServicerContext, method: str, e: Exception) -> None:
    """Log an unexpected exception with a request id; the client gets only the id."""
    request_id = uuid.uuid4().hex[:12]
    log.error("request %s: %s from %s failed: %s", request_id, method, context.peer(),
              "".join(traceback.format_exception(e)).rstrip())
    context.abort(grpc.StatusCode.INTERNAL, f"internal error (see the server log, request id {request_id})")


class _Undecodable:
    """What the lenient deserializer returns for request bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: Exception):
        self.error = error


def _lenient(message_type):
    """``message_type.FromString`` that returns ``_Undecodable`` instead of raising: gRPC would log the
    parse error at ERROR and answer INTERNAL; the handler answers INVALID_ARGUMENT instead."""
    def parse(data: bytes):
        try:
            return message_type.FromString(data)
        except Exception as e:  # google.protobuf.message.DecodeError, RuntimeWarning-free variants
            return _Undecodable(e)
    return parse


def _refuse_undecodable(method: str, request: _Undecodable, context: grpc.ServicerContext) -> None:
    log.warning("%s from %s: undecodable request (%s)", method, context.peer(), request.error)
    context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: the request is not a valid protobuf message")


def _guarded(method: str, handler, streaming: bool):
    """``handler`` with a catch-all: an exception that is not an abort becomes INTERNAL + a log entry;
    an undecodable request becomes INVALID_ARGUMENT + a warning.

    An abort (``context.abort``) raises too; it has set the status (``context.code()``) and passes.
    """
    if streaming:
        def guarded_stream(request, context):
            if isinstance(request, _Undecodable):
                _refuse_undecodable(method, request, context)
            try:
                yield from handler(request, context)
            except Exception as e:
                if context.code() is not None:
                    raise
                _internal_error(context, method, e)
        return guarded_stream

    def guarded(request, context):
        if isinstance(request, _Undecodable):
            _refuse_undecodable(method, request, context)
        try:
            return handler(request, context)
        except Exception as e:
            if context.code() is not None:
                raise
            _internal_error(context, method, e)
    return guarded


# method -> (request type, response serializer, streaming)
_METHODS = {
    "ListDatasets": (pb.ListDatasetsRequest, pb.ListDatasetsResponse.SerializeToString, False),
    "DescribeDataset": (pb.DescribeDatasetRequest, pb.DatasetInfo.SerializeToString, False),
    "StreamBatches": (pb.StreamBatchesRequest, bytes, True),  # batches come pre-serialized (batchd.wire)
    "OpenSession": (pb.OpenSessionRequest, pb.SessionEvent.SerializeToString, True),
    "ReleaseLeases": (pb.ReleaseLeasesRequest, pb.ReleaseLeasesResponse.SerializeToString, False),
    "Stats": (pb.StatsRequest, pb.StatsResponse.SerializeToString, False),
}


def add_to_server(service: BatchLoaderService, server: grpc.Server) -> None:
    """Register ``service``; StreamBatches responses are pre-serialized bytes.

    Every handler is wrapped by ``_guarded``: no traceback or internal detail reaches a client.
    """
    handlers = {}
    for method, (request_type, serialize, streaming) in _METHODS.items():
        make = grpc.unary_stream_rpc_method_handler if streaming else grpc.unary_unary_rpc_method_handler
        handlers[method] = make(_guarded(method, getattr(service, method), streaming=streaming),
                                request_deserializer=_lenient(request_type), response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
