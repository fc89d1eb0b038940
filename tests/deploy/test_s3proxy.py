"""tests/s3proxy.py, the latency-adding HTTP proxy of Table 9's S3 rows: it must pass requests and
responses through byte for byte and count (so delay) every request of a keep-alive connection,
bodies with Content-Length or chunked included. Against a real HTTP/1.1 server on 127.0.0.1.
"""

from __future__ import annotations

import hashlib
import http.client
import http.server
import threading

import pytest

from s3proxy import DelayProxy

pytestmark = pytest.mark.timeout(60)


class _Echo(http.server.BaseHTTPRequestHandler):
    """GET /N -> N pseudo-random bytes; POST -> SHA-256 of the body (Content-Length or chunked)."""

    protocol_version = "HTTP/1.1"  # keep-alive

    def log_message(self, *args) -> None:
        pass

    def _reply(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        n = int(self.path.strip("/"))
        self._reply((hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1))[:n])

    def do_POST(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = b""
            while size := int(self.rfile.readline().strip(), 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b""):
                pass
        else:
            body = self.rfile.read(int(self.headers["Content-Length"]))
        self._reply(hashlib.sha256(body).hexdigest().encode())


@pytest.fixture
def echo():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_every_request_of_a_keep_alive_connection_is_passed_on_and_counted(echo):
    sizes = [0, 1, 70_000, 333_333]
    with DelayProxy(echo, latency_ms=1) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        for n in sizes:
            conn.request("GET", f"/{n}")
            resp = conn.getresponse()
            assert resp.read() == (hashlib.sha256(str(n).encode()).digest() * (n // 32 + 1))[:n]
        body = bytes(range(256)) * 1000
        conn.request("POST", "/", body=body)
        assert conn.getresponse().read() == hashlib.sha256(body).hexdigest().encode()
        conn.request("POST", "/", body=iter([b"abc", b"", b"defgh" * 5000]), encode_chunked=True)
        assert conn.getresponse().read() == hashlib.sha256(b"abc" + b"defgh" * 5000).hexdigest().encode()
        conn.request("GET", "/5")
        assert len(conn.getresponse().read()) == 5
        conn.close()
        stats = proxy.stats()
    # one connection, and each of its 7 requests seen (so delayed) once, chunked body not mistaken for requests
    assert stats["connections"] == 1
    assert stats["requests"] == len(sizes) + 3


def test_latency_changes_are_acknowledged_and_bad_values_refused(echo):
    with DelayProxy(echo) as proxy:
        proxy.set_latency(0)
        proxy.set_latency(2.5)
        with pytest.raises(ValueError, match="latency_ms must be >= 0"):
            proxy.set_latency(-1)
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=20)
        conn.request("GET", "/10")
        assert len(conn.getresponse().read()) == 10
        conn.close()
        assert proxy.stats()["requests"] == 1
    assert proxy.proc.poll() is not None  # stopped by close()
