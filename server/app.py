"""A running batchd server: the loader, a gRPC server and the standard health service.

Start order matters: the ``Loader`` starts the worker processes (and their forkserver) before
``grpc.server()`` is created, so nothing is forked from a process with gRPC threads.

Threads. Every RPC runs on one of ``grpc_threads`` threads, and a StreamBatches, Batches or
OpenSession call holds its thread while it is open (a Batches call also reads its client's
messages on a thread of its own, outside the pool: server/serve/control.py). So that a burst of streams can never refuse Stats,
ReleaseLeases (which returns shared memory) or a health check, those long-lived calls are
admitted up to ``grpc_threads - control_threads(grpc_threads)`` (the servicer refuses more with
RESOURCE_EXHAUSTED) and the rest of the threads stay free for short calls. gRPC's own
``maximum_concurrent_rpcs`` counts every RPC, running or queued for a thread, whatever its kind:
set equal to the thread count (as before), a full house of streams made every short call refuse;
it is now twice the thread count, only to bound the queue. (grpcio cannot give some methods a
pool of their own on one port, hence the admission count.)
"""

from __future__ import annotations

import ctypes
import logging
import os
import pathlib
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from batchd.server.config import ServerConfig
from batchd.server.loader import Loader
from batchd.server.serve.dataplane import DataPlane, listen_host, tls_context
from batchd.server.serve.handlers import SERVICE, add_to_server
from batchd.server.serve.metrics import MetricsServer, metrics_host
from batchd.server.serve.security import AuthInterceptor, is_loopback
from batchd.server.serve.service import BatchLoaderService

log = logging.getLogger("batchd.server")

_SIGNAL_POLL_S = 0.1  # how often ``serve`` looks whether SIGINT/SIGTERM came
FD_MARGIN = 4096  # open files beside the data plane's pending handshakes: calls, slots, workers, caches


def raise_fd_limit(want: int) -> int:
    """Raise this process's soft limit on open files (RLIMIT_NOFILE) to ``want``, within its hard
    limit (never lowered); returns the soft limit now. A flood of idle data connections then
    meets the data plane's ``max_handshakes`` (the oldest evicted), not EMFILE."""
    try:
        import resource
    except ImportError:  # (not POSIX)
        return want
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, target, e)
    return soft


def grpc_options(max_message_bytes: int, max_request_bytes: int | None = None) -> list[tuple[str, int]]:
    """Send up to ``max_message_bytes`` (batches); receive up to ``max_request_bytes`` (requests are small)."""
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_request_bytes or max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials from ``config.tls`` (None: plaintext). Raises RuntimeError naming an unreadable file."""
    tls = config.tls
    if tls is None:
        return None

    def read(field: str, path) -> bytes:
        try:
            return pathlib.Path(path).read_bytes()
        except OSError as e:
            raise RuntimeError(f"tls.{field}: cannot read {path}: {e.strerror}") from None

    return grpc.ssl_server_credentials(
        [(read("key", tls.key), read("cert", tls.cert))],
        root_certificates=read("client_ca", tls.client_ca) if tls.client_ca is not None else None,
        require_client_auth=tls.require_client_cert,
    )


def control_threads(grpc_threads: int) -> int:
    """Server threads kept for short calls (Stats, ReleaseLeases, DescribeDataset, health): an eighth,
    at least 2, leaving at least one for streams and sessions."""
    return max(1, min(max(2, grpc_threads // 8), grpc_threads - 1))


def name_os_thread() -> None:
    """Give the calling thread's OS name (``/proc/PID/task/TID/comm``, ``top -H``, ``ps -L``; at most
    15 bytes) its Python name, which Python before 3.14 does not: the RPC pool's threads read
    ``batchd-rpc_N`` from outside the process. Linux ``prctl(PR_SET_NAME)``; elsewhere nothing."""
    try:
        ctypes.CDLL(None).prctl(15, threading.current_thread().name.encode()[:15], 0, 0, 0)  # (15: PR_SET_NAME)
    except (OSError, AttributeError):
        pass  # (no prctl: not Linux)


class Server:
    """Loader + gRPC server on ``config.address``. ``address`` is the bound one (port 0 resolved).

    With ``config.metrics_port`` set, ``start()`` also serves Prometheus metrics;
    ``metrics_address`` is then its bound ``HOST:PORT`` (else None).

    Raises RuntimeError if the address cannot be bound, and what ``Loader`` raises.
    Use ``start()``, then ``stop()`` (or ``with``).
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.loader = Loader(config)
        try:
            threads = config.grpc_threads
            service = self.service = BatchLoaderService(self.loader, max_long_calls=threads - control_threads(threads))
            self.grpc_server = grpc.server(
                futures.ThreadPoolExecutor(threads, thread_name_prefix="batchd-rpc", initializer=name_os_thread),
                options=grpc_options(config.max_message_bytes, config.max_request_bytes),
                maximum_concurrent_rpcs=2 * threads,  # bounds the queue; see the module doc
                interceptors=[AuthInterceptor(service.auth)] if service.auth is not None else None,
            )
            add_to_server(service, self.grpc_server)
            self.health = health.HealthServicer(experimental_non_blocking=True)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
            self.address = self._bind(config.address)
            # every address it listens on, bound (config also_listen: e.g. TCP for probes beside a unix socket)
            self.addresses = [self.address, *(self._bind(a) for a in config.also_listen)]
            self.data_plane = service.data_plane = self.loader.data_plane = self._data_plane()
        except BaseException:
            self.loader.close()
            raise
        self._stopped = threading.Event()
        self.metrics: MetricsServer | None = None
        self.metrics_address: str | None = None

    def _data_plane(self) -> DataPlane | None:
        """The data plane (``config.data_plane``) on the host of the first TCP address, on its
        port (by default the gRPC port + 1: ``DataPlaneConfig.port_for``), with the gRPC port's
        TLS settings; None if disabled or the server listens on unix: sockets only. Raises
        the process's open-file limit to what its pending handshakes may take (``raise_fd_limit``).
        Raises RuntimeError if its port cannot be bound."""
        cfg = self.config.data_plane
        host = listen_host(self.addresses)
        if not cfg.enabled or host is None:
            return None
        configured = [self.config.address, *self.config.also_listen][
            next(i for i, a in enumerate(self.addresses) if not a.startswith("unix:"))]
        try:
            port = cfg.port_for(int(configured.rpartition(":")[2]))
        except ValueError as e:
            raise RuntimeError(str(e)) from None
        raise_fd_limit(cfg.max_handshakes + FD_MARGIN)
        ctx = tls_context(self.config.tls) if self.config.tls is not None else None
        try:
            return DataPlane(host, port, ssl_context=ctx, token_ttl_s=cfg.token_ttl_s,
                             first_byte_timeout_s=cfg.first_byte_timeout_s,
                             handshake_timeout_s=cfg.handshake_timeout_s, max_handshakes=cfg.max_handshakes,
                             max_handshakes_per_source=cfg.max_handshakes_per_source)
        except RuntimeError as e:
            if cfg.port is None and port:
                raise RuntimeError(f"{e} (data_plane.port is the gRPC port + 1 unless set: set it to a free port, "
                                   f"or 0 for any)") from None
            raise

    @property
    def data_address(self) -> str | None:
        """``HOST:PORT`` of the data plane (its port resolved), or None without one."""
        if self.data_plane is None:
            return None
        host = self.data_plane.host
        return f"[{host}]:{self.data_plane.port}" if ":" in host else f"{host}:{self.data_plane.port}"

    def _bind(self, address: str) -> str:
        unix = address.startswith("unix:")
        # TLS on TCP listeners; a unix socket is protected by its file mode (tokens still apply)
        credentials = None if unix else server_credentials(self.config)
        if unix:  # the socket file: parent made if missing (0700), created 0600 and chmod'ed to unix_socket_mode
            path = pathlib.Path(address[len("unix:"):].removeprefix("//"))
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            umask = os.umask(0o177)
        try:
            if credentials is not None:
                port = self.grpc_server.add_secure_port(address, credentials)
            else:
                port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {address}: {e}") from None
        finally:
            if unix:
                os.umask(umask)
        if unix:
            try:
                os.chmod(path, self.config.unix_socket_mode)
            except OSError as e:
                raise RuntimeError(f"cannot set the mode of {path}: {e.strerror}") from None
            return address
        if port == 0:
            raise RuntimeError(f"cannot listen on {address} (in use, or not an address of this host)")
        host = address.rpartition(":")[0]
        return f"{host}:{port}"

    def start(self) -> "Server":
        if self.config.metrics_port is not None:
            try:
                self.metrics = MetricsServer(self.loader, metrics_host(self.address), self.config.metrics_port)
            except BaseException:
                self.stop(grace=0)
                raise
            self.metrics_address = self.metrics.address
            log.info("serving Prometheus metrics on http://%s/metrics", self.metrics_address)
        self.grpc_server.start()
        for service in ("", SERVICE):
            self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        workers = self.config.workers
        workers = str(workers) if isinstance(workers, int) else f"{workers.min}-{self.loader.pool.max_workers}"
        log.info("listening on %s (%s workers, datasets: %s)%s", self.address, workers,
                 ", ".join(sorted(self.loader.datasets)) or "none",
                 "; also on " + ", ".join(self.addresses[1:]) if len(self.addresses) > 1 else "")
        self._log_security()
        return self

    def _log_security(self) -> None:
        cfg = self.config
        tls = "off" if cfg.tls is None else ("mutual TLS" if cfg.tls.require_client_cert else "TLS")
        auth = "off" if cfg.auth is None else "tokens " + ", ".join(t.name for t in cfg.auth.tokens)
        log.info("security: tls %s, auth %s, max_streams %d", tls, auth, cfg.max_streams)
        if self.data_plane is not None:
            log.info("data plane on %s (%s): batch bytes for remote clients beside their calls", self.data_address,
                     "TLS" if self.data_plane.tls else "plain TCP")
            if not self.data_plane.tls and not is_loopback(self.data_address):
                log.warning("data plane on %s is plain TCP: anyone on the network path can read every batch and the "
                            "one-time tokens, race a client for its connection with its token, and alter batches or "
                            "inject grants; add a tls section to the config (it covers both ports), set "
                            "data_plane.enabled: false, or listen on 127.0.0.1 or unix:", self.data_address)
        for address in getattr(self, "addresses", [self.address]):
            if is_loopback(address):
                continue
            if cfg.auth is None and not (cfg.tls is not None and cfg.tls.require_client_cert):
                log.warning("listening on %s without authentication: anyone who can reach this port can read every "
                            "dataset; add an auth section (and tls) to the config, or listen on 127.0.0.1 or unix:",
                            address)
            elif cfg.auth is not None and cfg.tls is None:
                log.warning("listening on %s with tokens but without TLS: tokens cross the network in clear text; "
                            "add a tls section to the config", address)

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING, refuse new RPCs, give open ones ``grace`` seconds, then close the data
        plane, the metrics endpoint and the loader: the loader (its worker processes, shared
        memory) whatever the steps before it raised (their error is raised after)."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        try:
            self.health.enter_graceful_shutdown()
            self.service.drain()  # open streams end with UNAVAILABLE, idle sessions end now
            self.grpc_server.stop(grace).wait()
        finally:
            try:
                if self.data_plane is not None:
                    self.data_plane.close()  # after the calls: a payload in flight was sent or its call cancelled
                if self.metrics is not None:
                    self.metrics.close()
            finally:
                self.loader.close()  # whatever the data plane or the metrics raised
        log.info("stopped")

    def wait(self) -> None:
        self._stopped.wait()


def serve(config: ServerConfig) -> int:
    """Run until SIGINT or SIGTERM; returns the process exit code (0 on a clean stop)."""
    received: list[int] = []

    def on_signal(signum, _frame):
        # only a plain append here: the handler runs in the main thread between two bytecodes, and
        # taking a lock the main thread may hold (Event.set() while it sat in Event.wait()) hung
        # the server on SIGTERM in 2 of 15 tries (tests/serve/test_signals.py)
        received.append(signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server = Server(config).start()
    try:
        while not received:
            time.sleep(_SIGNAL_POLL_S)
        log.info("received %s, shutting down", signal.Signals(received[0]).name)
    finally:
        server.stop()
    return 0
