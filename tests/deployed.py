"""Run a command of a deployment file (compose service, Kubernetes container) on this machine.

No container engine runs here, so the container's paths are mapped onto the host first: each
``(container_prefix, host_prefix)`` pair of ``paths`` rewrites arguments (and the config file
the command reads) that start with the container path, and ``0.0.0.0:PORT`` becomes
``127.0.0.1:<free port>``. Everything else of the command line runs as written.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import re

import pytest
from helpers import free_port

from batchd.server_process import ServerExited, ServerProcess


class Mapping:
    """Container paths -> host paths, and the container's TCP ports -> free loopback ports."""

    def __init__(self, paths: dict[str, str]):
        # longest prefix first, so /run/batchd/x wins over /run
        self.paths = dict(sorted(paths.items(), key=lambda kv: -len(kv[0])))
        self.ports: dict[str, int] = {}

    def path(self, value: str) -> str:
        for inside, outside in self.paths.items():
            if value == inside or value.startswith(inside.rstrip("/") + "/"):
                return outside + value[len(inside):]
        return value

    def port(self, container_port: int | str) -> int:
        return self.ports.setdefault(str(container_port), free_port())

    def arg(self, value: str) -> str:
        """One command-line argument: an address (unix:PATH, 0.0.0.0:PORT, 127.0.0.1:PORT) or a path."""
        if value.startswith("unix:"):
            return "unix:" + self.path(value[len("unix:"):])
        m = re.fullmatch(r"(0\.0\.0\.0|127\.0\.0\.1|localhost):(\d+)", value)
        if m:
            return f"127.0.0.1:{self.port(m.group(2))}"
        return self.path(value)

    def text(self, text: str) -> str:
        """A config file's text with container paths replaced (whole path-like tokens only)."""
        for inside, outside in self.paths.items():
            text = re.sub(rf"(?<![\w/]){re.escape(inside)}(?=[/\s,}}\]]|$)", outside, text, flags=re.M)
        return text


@contextlib.contextmanager
def running(argv: list[str], *, cwd: pathlib.Path, env: dict | None = None, timeout: float = 60.0):
    """Start ``argv`` (a ``batchd serve`` command; ``batchd.server_process``); yields (process, log
    lines) once it logs ``listening on`` (the lines read so far, growing while it runs); SIGTERMs
    it on exit if it is still running (then SIGKILL after 20 s)."""
    server = ServerProcess(argv, cwd=cwd, env={**os.environ, **(env or {})}, timeout=timeout)
    try:
        server.start()
    except ServerExited as e:
        pytest.fail(f"{argv[:2]} exited ({e.returncode}) before listening:\n{e.log}")
    except TimeoutError:
        pytest.fail(f"no 'listening on' line within {timeout:g} s:\n{server.log}")
    try:
        yield server.proc, server.lines
    finally:
        server.stop(20)
