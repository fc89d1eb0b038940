"""The servicer at gRPC's edge: its methods registered as handlers, and errors turned into statuses.

StreamBatches and Batches responses come pre-serialized from ``Transport.encode``
(server/serve/transport.py: the slot lent in place, or its bytes copied once into the message), so
their handlers are registered with an identity serializer. Requests are parsed leniently: one
that does not parse is answered INVALID_ARGUMENT (gRPC would log it and answer INTERNAL). Every
handler is wrapped (``_guarded``): an exception that is not an abort becomes INTERNAL with a
request id the server log names, so no traceback or internal detail reaches a client; a failed
stream ends with the status its error maps to and an ``ErrorDetail`` (``abort_with_detail``).
"""

from __future__ import annotations

import logging
import traceback
import uuid

import grpc

from batchd.errors import ResourceExhaustedError, SampleError, WorkerError
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger("batchd.server.serve.service")  # one logger for the servicer

SERVICE = "batchd.v1.BatchLoader"
ERROR_DETAIL_KEY = "batchd-error-bin"


def abort_with_detail(context: grpc.ServicerContext, dataset: str, e: BaseException, redact=None) -> None:
    """End the call with the status ``e`` maps to (INTERNAL for a WorkerError, DATA_LOSS for a
    SampleError, RESOURCE_EXHAUSTED, else INVALID_ARGUMENT) and an ``ErrorDetail`` (type, dataset,
    the sample's index, path and reason) in the trailing metadata; ``redact`` takes server paths
    out of what the client sees (the server log keeps the whole error and its traceback)."""
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
    an undecodable request becomes INVALID_ARGUMENT + a warning (a bidirectional call's requests
    are checked one by one by the handler).

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


# method -> (request type, response serializer, kind: "unary", "stream" (server streaming) or "bidi")
_METHODS = {
    "ListDatasets": (pb.ListDatasetsRequest, pb.ListDatasetsResponse.SerializeToString, "unary"),
    "DescribeDataset": (pb.DescribeDatasetRequest, pb.DatasetInfo.SerializeToString, "unary"),
    "StreamBatches": (pb.StreamBatchesRequest, bytes, "stream"),  # batches come pre-serialized (batchd.wire)
    "Batches": (pb.BatchesControl, bytes, "bidi"),  # ... here too
    "OpenSession": (pb.OpenSessionRequest, pb.SessionEvent.SerializeToString, "stream"),
    "ReleaseLeases": (pb.ReleaseLeasesRequest, pb.ReleaseLeasesResponse.SerializeToString, "unary"),
    "Stats": (pb.StatsRequest, pb.StatsResponse.SerializeToString, "unary"),
    "PutWeights": (pb.WeightsChunk, pb.PutWeightsResponse.SerializeToString, "upload"),
}
_HANDLERS = {"unary": grpc.unary_unary_rpc_method_handler, "stream": grpc.unary_stream_rpc_method_handler,
             "bidi": grpc.stream_stream_rpc_method_handler, "upload": grpc.stream_unary_rpc_method_handler}


def add_to_server(service, server: grpc.Server) -> None:
    """Register ``service`` (a ``BatchLoaderService``, or a stand-in with the same methods; one
    without ``Batches`` leaves that call unimplemented); StreamBatches and Batches responses are
    pre-serialized bytes.

    Every handler is wrapped by ``_guarded``: no traceback or internal detail reaches a client.
    """
    handlers = {}
    for method, (request_type, serialize, kind) in _METHODS.items():
        if not hasattr(service, method):
            continue
        handlers[method] = _HANDLERS[kind](_guarded(method, getattr(service, method), streaming=kind in ("stream", "bidi")),
                                           request_deserializer=_lenient(request_type), response_serializer=serialize)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
