"""``batchd serve`` stops on SIGTERM whenever it comes, even the instant it starts listening.

The handler once called ``threading.Event.set()``. A Python signal handler runs in the main
thread between two bytecodes, and the main thread sat in ``Event.wait()`` on that same event, so
a signal arriving while it held the event's lock (entering a wait, once a second and right after
"listening on") deadlocked the server: 2 of 15 SIGTERMs sent at "listening on" hung it for good.
The handler now only records the signal, and the main thread polls for it (server/app.py).
"""

from __future__ import annotations

import pathlib
import signal
import subprocess
import threading
import time

import pytest
import yaml

from batchd.server_process import ServerProcess, serve_command
from helpers import free_port

pytestmark = pytest.mark.timeout(180)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
TRIES = 15  # the old handler hung the server in 1-2 of 15 tries (failed 2 runs of 2)


def _sigterm_at_listening(argv: list[str], cwd) -> ServerProcess:
    """A server that gets SIGTERM the moment its "listening on" line is read (on the thread reading
    its log), once."""
    sent = threading.Event()

    def at_listening(line: str) -> None:
        if "listening on" in line and not sent.is_set():
            sent.set()
            server.send_signal(signal.SIGTERM)

    server = ServerProcess(argv, cwd=cwd, on_line=at_listening)
    return server


def test_sigterm_the_instant_the_server_listens_always_stops_it(tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"workers": 1, "cache_dir": str(tmp_path / "cache"),
                                      "datasets": {"mine": {"kind": "python", "factory": "batchd_testdata:Mixed",
                                                            "args": {"only": ["image"]}}}}))
    hung = []
    for i in range(TRIES):
        server = _sigterm_at_listening(serve_command("--config", config, "--address", f"127.0.0.1:{free_port()}",
                                                     "--python-path", PYDATA), cwd=tmp_path)
        try:
            server.start()
            t0 = time.monotonic()
            try:
                code = server.wait(timeout=15)
            except subprocess.TimeoutExpired:
                hung.append(i)
                continue
            assert code == 0, f"try {i}: exit code {code}"
            assert time.monotonic() - t0 < 15
        finally:
            server.kill()
    assert not hung, f"SIGTERM at 'listening on' left the server running in tries {hung} of {TRIES}"
