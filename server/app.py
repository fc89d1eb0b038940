"""A running batchd server: the loader, a gRPC server and the standard health service.

Start order matters: the ``Loader`` starts the worker processes (and their forkserver) before
``grpc.server()`` is created, so nothing is forked from a process with gRPC threads.
"""

from __future__ import annotations

import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from batchd.server.config import ServerConfig
from batchd.server.loader import Loader
from batchd.server.metrics import MetricsServer, metrics_host
from batchd.server.service import SERVICE, BatchLoaderService, add_to_server

log = logging.getLogger("batchd.server")


def grpc_options(max_message_bytes: int) -> list[tuple[str, int]]:
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.so_reuseport", 0),
    ]


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
            self.grpc_server = grpc.server(
                futures.ThreadPoolExecutor(config.grpc_threads, thread_name_prefix="batchd-rpc"),
                options=grpc_options(config.max_message_bytes),
                maximum_concurrent_rpcs=config.grpc_threads,
            )
            add_to_server(BatchLoaderService(self.loader), self.grpc_server)
            self.health = health.HealthServicer(experimental_non_blocking=True)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.grpc_server)
            self.address = self._bind(config.address)
        except BaseException:
            self.loader.close()
            raise
        self._stopped = threading.Event()
        self.metrics: MetricsServer | None = None
        self.metrics_address: str | None = None

    def _bind(self, address: str) -> str:
        try:
            port = self.grpc_server.add_insecure_port(address)
        except RuntimeError as e:
            raise RuntimeError(f"cannot listen on {address}: {e}") from None
        if address.startswith("unix:"):
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
        log.info("listening on %s (%d workers, datasets: %s)", self.address, self.config.workers,
                 ", ".join(sorted(self.loader.datasets)) or "none")
        return self

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self, grace: float = 5.0) -> None:
        """Health NOT_SERVING, refuse new RPCs, give open ones ``grace`` seconds, then close the loader."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.health.enter_graceful_shutdown()
        self.loader.draining = True
        self.grpc_server.stop(grace).wait()
        if self.metrics is not None:
            self.metrics.close()
        self.loader.close()
        log.info("stopped")

    def wait(self) -> None:
        self._stopped.wait()


def serve(config: ServerConfig) -> int:
    """Run until SIGINT or SIGTERM; returns the process exit code (0 on a clean stop)."""
    stop = threading.Event()

    def on_signal(signum, _frame):
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    server = Server(config).start()
    try:
        while not stop.wait(1.0):
            pass
    finally:
        server.stop()
    return 0
