"""An adversary on a batchd server's data port (issue 37), for tests/serve/test_adversary.py (beside
real training) and bench/tables/table_dataplane.py (images/s against idle connections).

Each part is a thread of its own (``start``, ``stop``; a context manager) that counts what it did
and every byte the server sent it (``bytes_received``: a server that refuses a connection writes
nothing to it, so these must stay 0):

* ``IdleFlood``: ``n`` connections that never send a byte, held open; each one the server closes
  (its first-byte deadline, an eviction) is opened again at once, at most ``rate`` new
  connections a second in all (the attack that denied every trainer on main was 64 of them, 14
  new a second), from ``sources`` (local addresses, in turn);
* ``SlowDrip``: ``n`` connections that send one random byte every ``every`` seconds: a token
  that never ends;
* ``RandomBytes``: connection after connection sending random bytes where a token (or a TLS
  ClientHello) is due;
* ``TokenAbuse``: an authenticated client of its own (a bearer token of its own, as another
  tenant of a shared server) that opens ``Batches`` calls over the data plane, presents each
  call's one-time token, replays it on more connections (``replays``; each must be refused
  without a byte), and then sends an oversized control frame (a length of 2**32 - 1) or garbage
  on its own connection (``frames``; each must end its call, never the server).
"""

from __future__ import annotations

import os
import selectors
import socket
import threading
import time
from typing import Any

TICK_S = 0.02


class _Part(threading.Thread):
    def __init__(self, name: str):
        super().__init__(name=name, daemon=True)
        self._stop_event = threading.Event()
        self.bytes_received = 0
        self.errors: list[str] = []

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)

    def __enter__(self):
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # (reported by the test: an attacker that broke attacks nothing)
            self.errors.append(f"{type(e).__name__}: {e}")

    def _run(self) -> None:
        raise NotImplementedError


class IdleFlood(_Part):
    """``n`` idle connections to ``port`` on 127.0.0.1, re-opened as the server closes them, at most
    ``rate`` a second. Counters: ``opened``, ``closed`` (by the server), ``peak`` (open at once)."""

    def __init__(self, port: int, n: int, *, rate: float = 1000.0, sources: tuple[str, ...] = ("127.0.0.1",)):
        super().__init__("adversary-idle")
        self.port, self.n, self.rate, self.sources = port, n, rate, sources
        self.opened = self.closed = self.peak = 0

    def _run(self) -> None:
        sel = selectors.DefaultSelector()
        live: set[socket.socket] = set()
        budget, last = 0.0, time.monotonic()
        try:
            while not self._stop_event.is_set():
                now = time.monotonic()
                budget = min(self.rate * 0.1, budget + (now - last) * self.rate)  # (at most 0.1 s of burst)
                last = now
                while len(live) < self.n and budget >= 1:
                    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                    try:
                        s.bind((self.sources[self.opened % len(self.sources)], 0))
                        s.setblocking(False)
                        s.connect_ex(("127.0.0.1", self.port))
                    except OSError as e:  # (out of descriptors or ports: the attacker's limit, not the server's)
                        s.close()
                        self.errors.append(f"open: {e}")
                        break
                    sel.register(s, selectors.EVENT_READ)
                    live.add(s)
                    self.opened += 1
                    budget -= 1
                self.peak = max(self.peak, len(live))
                for key, _ in sel.select(TICK_S):
                    s = key.fileobj
                    try:
                        data = s.recv(4096)
                    except BlockingIOError:
                        continue
                    except OSError:
                        data = b""
                    if data:
                        self.bytes_received += len(data)
                        continue
                    sel.unregister(s)
                    s.close()
                    live.discard(s)
                    self.closed += 1
        finally:
            for s in live:
                s.close()
            sel.close()


class SlowDrip(_Part):
    """``n`` connections to ``port`` that send one random byte every ``every`` seconds, re-opened
    when closed. Counters: ``opened``, ``sent`` (bytes)."""

    def __init__(self, port: int, n: int = 8, *, every: float = 0.25):
        super().__init__("adversary-drip")
        self.port, self.n, self.every = port, n, every
        self.opened = self.sent = 0

    def _run(self) -> None:
        conns: list[socket.socket | None] = [None] * self.n
        try:
            while not self._stop_event.wait(self.every):
                for i, s in enumerate(conns):
                    if s is None:
                        s = conns[i] = socket.create_connection(("127.0.0.1", self.port), timeout=5)
                        s.setblocking(False)
                        self.opened += 1
                    try:
                        data = s.recv(4096)
                        if data:
                            self.bytes_received += len(data)
                        else:
                            raise ConnectionResetError
                    except BlockingIOError:
                        pass
                    except OSError:
                        s.close()
                        conns[i] = None
                        continue
                    try:
                        self.sent += s.send(os.urandom(1))
                    except OSError:
                        s.close()
                        conns[i] = None
        finally:
            for s in conns:
                if s is not None:
                    s.close()


class RandomBytes(_Part):
    """Connection after connection to ``port`` sending 1 to 4096 random bytes, each read until the
    server closes it. Counters: ``opened``."""

    def __init__(self, port: int, *, pause: float = 0.01):
        super().__init__("adversary-random")
        self.port, self.pause = port, pause
        self.opened = 0

    def _run(self) -> None:
        while not self._stop_event.wait(self.pause):
            with socket.create_connection(("127.0.0.1", self.port), timeout=10) as s:
                self.opened += 1
                try:
                    s.sendall(os.urandom(1 + int.from_bytes(os.urandom(2), "little") % 4096))
                    while data := s.recv(65536):
                        self.bytes_received += len(data)
                except OSError:
                    pass  # (reset: the server closed it with our bytes unread)


class TokenAbuse(_Part):
    """An authenticated client's abuse of its own calls' tokens (module docstring). address: the
    gRPC address; bearer: its token (None: no auth); request: the ``pb.StreamBatchesRequest`` to
    open (TRANSPORT_SOCKET, its Batch messages on the call). Each call grants batch 0; once its
    payload came on the call's data connection (the token is claimed), the token is replayed on
    two more connections, then a bad frame goes on the claimed one. Counters: ``calls``,
    ``replays`` (refused without a byte), ``accepted_replays`` (must stay 0), ``frames`` (bad
    frames sent), ``endings`` ({status code name: calls}), ``lost`` (calls whose own connection
    was refused: evicted by the flood beside it; nothing replayed)."""

    def __init__(self, address: str, request: Any, *, bearer: str | None = None, pause: float = 0.05):
        super().__init__("adversary-tokens")
        self.address, self.request, self.bearer, self.pause = address, request, bearer, pause
        self.calls = self.replays = self.frames = self.accepted_replays = self.lost = 0
        self.endings: dict[str, int] = {}

    def _run(self) -> None:
        import grpc

        from batchd.v1 import loader_pb2_grpc

        metadata = (("authorization", f"Bearer {self.bearer}"),) if self.bearer else ()
        with grpc.insecure_channel(self.address) as channel:
            stub = loader_pb2_grpc.BatchLoaderStub(channel)
            while not self._stop_event.wait(self.pause):
                code = self._abuse(stub, metadata)
                self.endings[code] = self.endings.get(code, 0) + 1

    def _abuse(self, stub, metadata) -> str:
        """One call's abuse; its status code's name."""
        import grpc

        from batchd import datawire

        try:
            from rawclient import RawBatches
        except ImportError:  # (outside the tests' path: the bench)
            from tests.rawclient import RawBatches

        host = self.address.rpartition(":")[0]
        call = RawBatches(stub, self.request, grant=[0], metadata=metadata, timeout=30)
        self.calls += 1
        try:
            port, token = datawire.offered(call.call.initial_metadata())
            with socket.create_connection((host, port), timeout=10) as own:
                own.sendall(token)
                header = _read_exactly(own, datawire.HEADER.size)
                if header is None:  # refused (evicted amid the flood): nothing to replay
                    self.lost += 1
                    return "LOST"
                _, _, length = datawire.unpack_header(header)
                if _read_exactly(own, length) is None:
                    self.lost += 1
                    return "LOST"
                for _ in range(2):  # the same token, claimed already: refused without a byte
                    with socket.create_connection((host, port), timeout=10) as again:
                        again.sendall(token)
                        got = _read_to_end(again)
                    self.bytes_received += got
                    self.replays += 1
                    self.accepted_replays += got > 0
                own.sendall(datawire.CONTROL.pack(datawire.CONTROL_MAGIC, 0xFFFF_FFFF) if self.calls % 2
                            else os.urandom(64))  # an oversized frame, or garbage
                self.frames += 1
                for _ in call:  # (batch 0's message, then the call's end)
                    pass
                return "OK"
        except grpc.RpcError as e:
            return e.code().name
        finally:
            call.cancel()


def _read_exactly(s: socket.socket, n: int, timeout: float = 10.0) -> bytes | None:
    """``n`` bytes from ``s``; None if it closes (or breaks, or is silent for ``timeout`` s) first."""
    s.settimeout(timeout)
    out = bytearray()
    try:
        while len(out) < n:
            data = s.recv(min(n - len(out), 1 << 20))
            if not data:
                return None
            out += data
    except OSError:
        return None
    return bytes(out)


def _read_to_end(s: socket.socket, timeout: float = 10.0) -> int:
    """Bytes ``s`` brings until the server closes it (a refused connection: 0)."""
    s.settimeout(timeout)
    n = 0
    try:
        while data := s.recv(65536):
            n += len(data)
    except OSError:
        pass
    return n


def process_counts(pid: int) -> tuple[int, int]:
    """(threads, open file descriptors) of process ``pid``, read from /proc (from outside it)."""
    return len(os.listdir(f"/proc/{pid}/task")), len(os.listdir(f"/proc/{pid}/fd"))


def open_files(pid: int) -> dict[int, str]:
    """Process ``pid``'s descriptors: fd -> what it is (a TCP socket as "tcp LOCAL -> REMOTE STATE",
    from /proc/PID/net/tcp), for a message naming what a leak left open."""
    sockets = {}
    for table in ("tcp", "tcp6"):
        try:
            lines = open(f"/proc/{pid}/net/{table}").read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            sockets[f[9]] = f"{table} {_endpoint(f[1])} -> {_endpoint(f[2])} state {f[3]}"
    out = {}
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
        out[int(fd)] = sockets.get(inode, target) if inode else target
    return out


def _endpoint(hex_address: str) -> str:
    host, port = hex_address.split(":")
    if len(host) == 8:
        host = ".".join(str(b) for b in bytes.fromhex(host)[::-1])
    return f"{host}:{int(port, 16)}"


def main(argv: list[str] | None = None) -> int:
    """``python -m tests.adversary PORT N [--rate R] [--sources A,B,...]``: an ``IdleFlood`` of ``N``
    connections in a process of its own (its open-file limit raised for them, within the hard
    limit) until its stdin closes; then its counters as one JSON line on stdout."""
    import argparse
    import json
    import resource
    import sys

    p = argparse.ArgumentParser(description=main.__doc__.split("\n\n")[0])
    p.add_argument("port", type=int)
    p.add_argument("n", type=int)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--sources", default="127.0.0.1")
    args = p.parse_args(argv)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = args.n + 256
    if soft != resource.RLIM_INFINITY and soft < want:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want if hard == resource.RLIM_INFINITY else min(want, hard), hard))
    flood = IdleFlood(args.port, args.n, rate=args.rate, sources=tuple(args.sources.split(",")))
    t0 = time.monotonic()
    with flood:
        sys.stdin.read()  # (until the parent closes it)
    seconds = time.monotonic() - t0
    print(json.dumps({"opened": flood.opened, "closed": flood.closed, "peak": flood.peak, "seconds": seconds,
                      "bytes_received": flood.bytes_received, "errors": flood.errors[:5]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
