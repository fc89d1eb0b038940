"""`batchd top ADDRESS`: one frame (--once) of a real server with a client mid-epoch, and the usual
errors for a wrong address or a missing token."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import time

import pytest

import batchd
from batchd.client.transport.server_stats import get_stats
from helpers import free_port, wait_until

pytestmark = pytest.mark.timeout(120)

REPO = pathlib.Path(__file__).resolve().parents[2]
TOKEN = "top-test-token-0123456789abcdef"


def top(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "batchd.cli", "top", *args], capture_output=True, text=True,
                          timeout=60, stdin=subprocess.DEVNULL, cwd=REPO, env=env)


def test_one_frame_shows_streams_workers_cache_and_slots(make_server, fmnist_root, tmp_path):
    server = make_server(workers=2, cache={"memory_bytes": 1 << 20},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=100, prefetch=2) as loader:
        it = iter(loader)
        for _ in range(8):
            next(it)
            time.sleep(0.05)  # a training step: trainer-bound
        assert wait_until(lambda: get_stats(server.address).streams[0].verdict == "trainer-bound", timeout=5)
        reply = get_stats(server.address)
        res = top(server.address, "--once")
        it.close()
    assert res.returncode == 0, res.stderr
    out = res.stdout
    (s,) = reply.streams
    # the stream's row: id, dataset, client, batches/s, the wait it reports, its verdict, epoch, batch
    row = next(line for line in out.splitlines() if "fmnist" in line and "trainer-bound" in line)
    cells = [c.strip() for c in re.split(r"[│┃|]", row) if c.strip()]
    assert cells[:3] == [str(s.id), "fmnist", s.peer.split(":", 1)[1]]
    assert re.fullmatch(r"\d+%", cells[4]) and int(cells[4][:-1]) < 20
    assert cells[5] == "trainer-bound" and cells[6] == "0"
    # one row per worker with its pid, busy ratio and stage now
    for w in reply.pool.worker_stats:
        assert re.search(rf"│\s*{w.id}\s*│\s*{w.pid}\s*│\s*\d+%\s*│\s*(idle|read|decode|pipeline|cache|write)\s*│", out), out
    assert re.search(r"slots \d+/64 in use", out) and "sent" in out
    assert "cache hit rate" in out and "streams" in out and "workers" in out


def test_a_wrong_address_fails_plainly():
    start = time.monotonic()
    res = top(f"127.0.0.1:{free_port()}", "--once", "--timeout", "2")
    assert res.returncode == 1
    assert "no batchd server answered" in res.stderr and "Traceback" not in res.stderr
    assert time.monotonic() - start < 20


def test_a_missing_or_wrong_token_is_refused(make_server, tmp_path, fmnist_root):
    server = make_server(workers=1, auth={"tokens": [{"name": "t", "token": TOKEN, "datasets": ["*"]}]},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    env = {k: v for k, v in __import__("os").environ.items() if k != "BATCHD_TOKEN"}
    res = top(server.address, "--once", env=env)
    assert res.returncode == 1 and "token" in res.stderr.lower() and "Traceback" not in res.stderr
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-token-0123456789abcdef\n")
    res = top(server.address, "--once", "--token-file", str(wrong), env=env)
    assert res.returncode == 1 and "token" in res.stderr.lower()
    right = tmp_path / "right"
    right.write_text(TOKEN + "\n")
    res = top(server.address, "--once", "--token-file", str(right), env=env)
    assert res.returncode == 0 and "no open streams" in res.stdout, res.stderr
