"""``batchd.server_process``: the one helper that starts ``batchd serve`` for the tests, the
benchmarks and the examples. A real server on 127.0.0.1:0 (the bound address parsed, the log
kept, SIGTERM on exit); and, with stand-in processes, each way a start can go wrong, none hanging."""

from __future__ import annotations

import signal
import sys
import time

import pytest
import yaml

import batchd
from batchd.server_process import ServerExited, ServerProcess, serve_command

pytestmark = pytest.mark.timeout(120)


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_a_real_server_on_port_0_gives_its_bound_address_and_stops_on_exit(fmnist_root, tmp_path):
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"workers": 1, "cache_dir": str(tmp_path / "cache"), "datasets": {
        "fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}}))
    seen = []
    with ServerProcess(serve_command("--config", config, "--address", "127.0.0.1:0"), on_line=seen.append) as server:
        host, port = server.address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0, server.address
        assert any("listening on" in line for line in seen), "on_line saw the line before start() returned"
        assert f"listening on {server.address}" in server.log and server.startup_s > 0
        assert [d.name for d in batchd.list_datasets(server.address)] == ["fmnist"]
    assert server.proc.returncode == 0, server.log  # SIGTERM on exit: a clean stop


def test_a_server_that_exits_before_listening_raises_with_its_code_and_log():
    server = ServerProcess(_python("import sys; print('cannot open the data'); sys.exit(3)"), timeout=30)
    with pytest.raises(ServerExited) as caught:
        server.start()
    assert caught.value.returncode == 3 and "cannot open the data" in caught.value.log
    assert isinstance(caught.value, RuntimeError)


def test_a_server_that_never_listens_is_killed_after_the_timeout():
    server = ServerProcess(_python("import time; print('loading', flush=True); time.sleep(60)"), timeout=1.0)
    t0 = time.monotonic()
    with pytest.raises(batchd.TimeoutError, match="not listening within 1 s") as caught:
        server.start()
    assert time.monotonic() - t0 < 10 and server.proc.poll() is not None, "killed, not left running"
    assert "loading" in str(caught.value)


def test_stop_kills_a_server_that_ignores_sigterm():
    ignores = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
               "print('listening on 127.0.0.1:1 (1 workers)', flush=True); time.sleep(60)")
    server = ServerProcess(_python(ignores), timeout=30).start()
    assert server.address == "127.0.0.1:1"
    t0 = time.monotonic()
    assert server.stop(timeout=0.5) == -signal.SIGKILL
    assert time.monotonic() - t0 < 10
    assert server.stop() == -signal.SIGKILL  # idempotent


def test_it_restarts_with_the_same_command():
    server = ServerProcess(_python("print('listening on 127.0.0.1:2', flush=True)"), timeout=30)
    first = server.start().pid
    assert server.wait(10) == 0
    assert server.start().pid != first and server.wait(10) == 0
    assert server.log.count("listening on 127.0.0.1:2") == 2
