"""A TCP proxy for HTTP/1.1 (an S3 endpoint) that adds latency to every request: slow object storage, simulated.

    python tests/s3proxy.py TARGET_PORT [--delay-ms X]      # prints "listening on PORT", then reads commands

It listens on 127.0.0.1 (a free port) and forwards every connection to 127.0.0.1:TARGET_PORT.
On the way in it parses the HTTP requests of each connection (request line and headers up to the
blank line, then a ``Content-Length`` or chunked body), and holds each request until ``X`` ms
after it arrived before passing it on, in order: every request's first response byte comes
``X`` ms later than it would, what an object store's time to first byte costs. Keep-alive
connections get the delay on every request, not once per connection; pipelined requests each
get ``X`` ms from their own arrival. Responses are streamed back untouched (bandwidth is not
limited). Connections are served concurrently (asyncio), so 64 requests in flight all wait
``X`` ms together.

Commands on stdin, one per line, each answered with one line on stdout: ``delay MS`` (the delay
for requests arriving from now on) -> ``ok``; ``stats`` -> JSON ``{"requests": N, "connections":
N, "bytes_down": N}`` (totals so far). End of stdin stops the proxy.

``DelayProxy`` runs it as a subprocess for a benchmark (its CPU is then its own process's, not
the benchmark's, and it counts in the benchmark's process tree).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

_HEAD_LIMIT = 1 << 20
_LINGER_S = 10.0  # after the client closed, how long the server may take to finish and close


class _Proxy:
    """The asyncio side: ``serve()`` forwards connections, ``control()`` reads stdin commands."""

    def __init__(self, target_port: int, delay_ms: float):
        self.target_port = target_port
        self.delay_s = delay_ms / 1000.0
        self.requests = self.connections = self.bytes_down = 0
        self._tasks: set[asyncio.Task] = set()  # asyncio keeps only weak references to tasks

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        me = asyncio.current_task()
        self._tasks.add(me)
        up_w = down = None
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target_port, limit=_HEAD_LIMIT)
            self.connections += 1
            down = asyncio.create_task(self._responses(up_r, client_w))  # referenced by this frame
            try:
                await self._requests(client_r, up_w)
            except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
                pass
            try:
                up_w.write_eof()  # the client closed: let the server finish its response and close
            except OSError:
                pass
            await asyncio.wait_for(down, _LINGER_S)
        except (OSError, asyncio.TimeoutError, asyncio.CancelledError):  # cannot connect; server lingers; stopping
            if down is not None:
                down.cancel()
        finally:
            for w in (up_w, client_w):
                if w is not None:
                    w.close()
            self._tasks.discard(me)

    async def _requests(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        """Pass on each request ``delay`` after its head arrived (never before the previous one)."""
        release = 0.0
        while True:
            try:
                head = await src.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:
                if e.partial:
                    dst.write(e.partial)
                return
            arrived = time.monotonic()
            self.requests += 1
            release = max(release, arrived + self.delay_s)
            wait = release - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            dst.write(head)
            headers = _headers(head)
            if "chunked" in headers.get("transfer-encoding", ""):
                await self._chunked(src, dst)
            else:
                left = int(headers.get("content-length", "0") or 0)
                while left > 0:
                    data = await src.read(min(left, 1 << 16))
                    if not data:
                        return
                    dst.write(data)
                    left -= len(data)
                    await dst.drain()
            await dst.drain()

    @staticmethod
    async def _chunked(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while True:
            line = await src.readuntil(b"\r\n")
            dst.write(line)
            size = int(line.split(b";", 1)[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers up to the blank line
                    trailer = await src.readuntil(b"\r\n")
                    dst.write(trailer)
                    if trailer == b"\r\n":
                        return
            dst.write(await src.readexactly(size + 2))
            await dst.drain()

    async def _responses(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        try:
            while data := await src.read(1 << 16):
                self.bytes_down += len(data)
                dst.write(data)
                await dst.drain()
        except OSError:
            pass
        finally:
            try:
                dst.write_eof()
            except OSError:
                pass

    async def run(self, on_listening) -> None:
        server = await asyncio.start_server(self._handle, "127.0.0.1", 0, limit=_HEAD_LIMIT, backlog=1024)
        on_listening(server.sockets[0].getsockname()[1])
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        async with server:
            while line := await reader.readline():
                cmd = line.decode().split()
                if cmd[:1] == ["delay"] and len(cmd) == 2:
                    self.delay_s = float(cmd[1]) / 1000.0
                    _say("ok")
                elif cmd == ["stats"]:
                    _say(json.dumps({"requests": self.requests, "connections": self.connections,
                                     "bytes_down": self.bytes_down}))
                else:
                    _say(f"error: unknown command {line.decode().strip()!r} (delay MS | stats)")


def _headers(head: bytes) -> dict[str, str]:
    """Lower-case header name -> value of a request head (request line first, ends with a blank line)."""
    out = {}
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip().lower()
    return out


def _say(text: str) -> None:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class DelayProxy:
    """``python tests/s3proxy.py`` as a subprocess in front of 127.0.0.1:``target_port``.

    ``url`` (``http://127.0.0.1:PORT``) is the endpoint to give clients; ``set_latency(ms)``
    changes the delay per request for requests arriving from then on; ``stats()`` -> dict of
    totals (requests, connections, bytes_down); ``close()`` stops it (also a context manager).
    Raises RuntimeError if the proxy does not start within ``timeout`` seconds or a command is
    not acknowledged.
    """

    def __init__(self, target_port: int, latency_ms: float = 0.0, *, timeout: float = 30.0):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), str(int(target_port)),
                                      "--delay-ms", str(float(latency_ms))],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)
        line = self._line(timeout)
        if not line.startswith("listening on "):
            self.close()
            raise RuntimeError(f"tests/s3proxy.py did not start: {line!r}")
        self.port = int(line.split()[-1])
        self.url = f"http://127.0.0.1:{self.port}"

    def _line(self, timeout: float) -> str:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout):
                raise RuntimeError(f"tests/s3proxy.py did not answer in {timeout:.0f} s")
        return self.proc.stdout.readline().strip()

    def _ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._line(10.0)

    def set_latency(self, latency_ms: float) -> None:
        """Requests arriving from now on wait ``latency_ms`` ms (>= 0) before being passed on."""
        if latency_ms < 0:
            raise ValueError(f"latency_ms must be >= 0, got {latency_ms}")
        answer = self._ask(f"delay {float(latency_ms)}")
        if answer != "ok":
            raise RuntimeError(f"tests/s3proxy.py refused 'delay {latency_ms}': {answer}")

    def stats(self) -> dict:
        """Totals so far: requests, connections, bytes_down (response bytes)."""
        return json.loads(self._ask("stats"))

    def close(self) -> None:
        """End of stdin stops the proxy; terminate/kill if it lingers."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(5)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(5)
        if self.proc.stdout:
            self.proc.stdout.close()

    def __enter__(self) -> "DelayProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("target_port", type=int, help="the server's port on 127.0.0.1")
    p.add_argument("--delay-ms", type=float, default=0.0, help="delay per request, ms")
    args = p.parse_args(argv)
    asyncio.run(_Proxy(args.target_port, args.delay_ms).run(lambda port: _say(f"listening on {port}")))


if __name__ == "__main__":
    main()
