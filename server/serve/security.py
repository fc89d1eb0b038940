"""Who may call the server, and what a caller may see of it.

- ``Authenticator``: bearer tokens from the config (``auth.tokens``), each with the datasets it
  may read. ``identify`` compares a presented token with every configured one in constant time
  (``hmac.compare_digest`` of SHA-256 digests, so neither content nor length leaks through
  timing) and returns the token's ``Scope``; the token itself is never logged, only its name.
- ``AuthInterceptor``: refuses every ``batchd.v1.BatchLoader`` call without a valid token with
  UNAUTHENTICATED, before the request is even parsed. The gRPC health service stays open so
  probes work without a token. Per-dataset checks (PERMISSION_DENIED) are in the servicer,
  which asks ``Authenticator.scope(context)``.
- ``Redactor``: takes the server's own paths (cache_dir, dataset roots, the Python install) and
  any traceback out of a message before a client sees it; the full text goes to the server log.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import os
import pathlib
import sys
import threading
import time
from dataclasses import dataclass

import grpc

from batchd.server.config import AuthConfig, ServerConfig

log = logging.getLogger(__name__)

OPEN_PREFIXES = ("/grpc.health.v1.Health/",)  # callable without a token (liveness/readiness probes)


@dataclass(frozen=True, slots=True)
class Scope:
    """What one caller may read: ``name`` of its token ("" with no auth), its datasets (None: all)."""

    name: str
    datasets: frozenset[str] | None

    def allows(self, dataset: str) -> bool:
        return self.datasets is None or dataset in self.datasets

    def denied(self, dataset: str) -> str:
        """The PERMISSION_DENIED message: the same whether or not ``dataset`` exists."""
        return f"token {self.name!r} may not read dataset {_short(dataset)!r}"


OPEN = Scope("", None)


def _short(text: str, limit: int = 100) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _digest(token: str | bytes) -> bytes:
    return hashlib.sha256(token.encode("utf-8", "surrogatepass") if isinstance(token, str) else token).digest()


class Authenticator:
    """Bearer tokens -> scopes. ``identify`` is constant-time in which token (if any) matches."""

    def __init__(self, auth: AuthConfig):
        self._tokens = [
            (_digest(t.secret), Scope(t.name, None if t.all_datasets else frozenset(t.datasets))) for t in auth.tokens
        ]

    def identify(self, metadata) -> Scope | None:
        """The scope of the ``authorization: Bearer <token>`` in ``metadata``; None if missing or unknown."""
        presented = bearer_token(metadata)
        if presented is None:
            return None
        digest = _digest(presented)
        found = None
        for expected, scope in self._tokens:  # no early exit: every token is compared
            if hmac.compare_digest(digest, expected) and found is None:
                found = scope
        return found

    def scope(self, context: grpc.ServicerContext) -> Scope:
        """The caller's scope (the interceptor already refused calls without a valid token)."""
        scope = self.identify(context.invocation_metadata())
        if scope is None:  # not reached through the interceptor; refuse all the same
            context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)
        return scope


UNAUTHENTICATED_MESSAGE = ("this server needs a token: send metadata 'authorization: Bearer <token>' "
                           "(RemoteDataLoader(token=...), or the BATCHD_TOKEN environment variable)")
INVALID_TOKEN_MESSAGE = "the token sent is not valid on this server"


def bearer_token(metadata) -> str | None:
    """The token of the first ``authorization`` entry of the form ``Bearer <token>``."""
    for item in metadata or ():
        key, value = item[0], item[1]
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        scheme, _, token = value.partition(" ")
        if scheme.lower() == "bearer" and token.strip():
            return token.strip()
        return ""
    return None


class _RateLimitedWarning:
    """At most one warning per ``every`` seconds; the ones in between are counted in the next."""

    def __init__(self, every: float = 60.0):
        self.every, self.last, self.suppressed = every, -float("inf"), 0
        self._lock = threading.Lock()

    def __call__(self, msg: str, *args) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self.last < self.every:
                self.suppressed += 1
                return
            suppressed, self.suppressed, self.last = self.suppressed, 0, now
        log.warning(msg + (f" (and {suppressed} more since the last warning)" if suppressed else ""), *args)


class AuthInterceptor(grpc.ServerInterceptor):
    """Refuses calls without a valid bearer token (UNAUTHENTICATED); the health service is open."""

    def __init__(self, authenticator: Authenticator):
        self.authenticator = authenticator
        self._warn = _RateLimitedWarning()

    def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method or ""
        if method.startswith(OPEN_PREFIXES):
            return continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        if self.authenticator.identify(metadata) is not None:
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None  # an unknown method: UNIMPLEMENTED, as without auth
        message = UNAUTHENTICATED_MESSAGE if bearer_token(metadata) is None else INVALID_TOKEN_MESSAGE

        def deny(request, context):
            self._warn("refused %s from %s: %s", method, context.peer(),
                       "no token" if message is UNAUTHENTICATED_MESSAGE else "invalid token")
            context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        # the same kind of handler, fed raw bytes: an unauthenticated request is never parsed
        if handler.request_streaming and handler.response_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.request_streaming:
            return grpc.stream_unary_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


def is_loopback(address: str) -> bool:
    """True for ``unix:`` addresses and loopback hosts (127.0.0.0/8, ::1, localhost)."""
    if address.startswith("unix:"):
        return True
    host = address.rpartition(":")[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Redactor:
    """Removes server paths and tracebacks from messages meant for clients."""

    def __init__(self, config: ServerConfig):
        paths: set[str] = set()

        def add(p) -> None:
            if p is None:
                return
            p = pathlib.Path(p).expanduser()
            for q in (p, p.resolve() if p.is_absolute() else p.absolute()):
                text = str(q).rstrip("/")
                if text.count("/") >= 2 or (text.count("/") == 1 and len(text) > 4):  # not "/" or "/tmp"-short
                    paths.add(text)

        add(config.cache_dir)
        for ds in config.datasets.values():
            root = getattr(ds, "root", None)
            add(root)
            path = getattr(ds, "path", None)
            if path is not None:
                add(path)
                add(pathlib.Path(path).parent)
        for p in (sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(os.path.dirname(__file__))):
            add(p)
        # where operator code is imported from (kind python, python pipelines): its tracebacks name files there
        for p in (*config.python_path, *(p for p in sys.path if p and os.path.isabs(p))):
            add(p)
        if config.tls is not None:
            for p in (config.tls.cert, config.tls.key, config.tls.client_ca):
                if p is not None:
                    add(p)
                    add(pathlib.Path(p).parent)
        self.paths = sorted(paths, key=len, reverse=True)  # longest first: a root inside the cache dir

    def __call__(self, message: str, keep: tuple[str, ...] = ()) -> str:
        """``message`` without server paths or tracebacks; the texts in ``keep`` stay as they are.

        keep: what the client itself sent (a dataset or preset name), echoed verbatim so that the
        answer to a name that happens to be a server path reads like any other name's (redacting
        it would tell the caller which paths the server has). Use it only for messages whose own
        text holds no server path (NOT_FOUND for a name): a kept text inside a path shields it.
        """
        texts = {form for text in keep if text for form in (text, repr(text)[1:-1])}  # as sent, as quoted
        kept = {f"\ue000{i}\ue001": text for i, text in enumerate(sorted(texts, key=len, reverse=True))}
        for token, text in kept.items():
            message = message.replace(text, token)
        for marker in ("\n\nWorker traceback:", "Worker traceback:", "Traceback (most recent call last)"):
            message = message.split(marker)[0]
        for p in self.paths:
            if p in message:
                message = message.replace(p, "<server path>")
        for token, text in kept.items():
            message = message.replace(token, text)
        return message.rstrip()
