"""Live stats: the Stats RPC, `batchd status`, the Prometheus endpoint, and the stream logs."""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import batchd
from batchd.client.transport.server_stats import get_stats, stats_dict
from batchd.server.serve import lag as lag_mod, sending as service_mod
from batchd.server.compute.protocol import StreamRequest
from batchd.server.compute.rates import RateMeter
from batchd.server.serve.stats import snapshot
from batchd.server_process import ServerProcess, serve_command
from helpers import free_port

pytestmark = pytest.mark.timeout(120)

REPO = pathlib.Path(__file__).resolve().parents[2]
BATCH = 100  # Fashion-MNIST test split: 10,000 samples -> 100 batches


@pytest.fixture
def server(make_server, fmnist_root):
    return make_server(
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
        metrics_port=0,
    )


def batchd_cli(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "batchd.cli", *args], capture_output=True, text=True, timeout=timeout,
        stdin=subprocess.DEVNULL, cwd=REPO,
    )


def scrape(metrics_address: str) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from the /metrics endpoint."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


def wait_for(predicate, timeout: float = 10.0, what: str = "condition", show=None):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}" + (f": {show()}" if show is not None else ""))
        time.sleep(0.05)


# ---- the figures themselves ------------------------------------------------------------------------


def test_rate_meter_reads_a_steady_rate_and_decays():
    m = RateMeter(window=10.0, now=0.0)
    for i in range(1, 201):  # 100 images every 0.1 s for 20 s: 1000 images/s
        m.add(100, now=i * 0.1)
    assert m.rate(now=20.0) == pytest.approx(1000, rel=0.06)
    young = RateMeter(window=10.0, now=0.0)
    young.add(500, now=0.5)
    young.add(500, now=1.0)
    assert young.rate(now=1.0) == pytest.approx(1000, rel=0.05)  # a 1-second-old meter: its average
    assert m.rate(now=60.0) < 0.05 * m.rate(now=20.0)  # stopped 40 s ago


def test_snapshot_counts_exactly_what_a_stream_took(server):
    """Straight on the Loader (no gRPC buffering in between): exact counts."""
    loader = server.loader
    stream = loader.open_stream(StreamRequest(dataset="fmnist-test", batch_size=BATCH, prefetch=3))
    try:
        for _ in range(5):
            batch = wait_for(lambda: stream.next(0.1), what="a batch")
            stream.release(batch)
        s = snapshot(loader)
        (st,) = s.streams
        assert (st.id, st.dataset, st.batch_size, st.pipeline, st.transport) == (
            stream.id, "fmnist-test", BATCH, "none", "inline")
        assert (st.batches_sent, st.samples_sent, st.next_batch, st.num_batches) == (5, 5 * BATCH, 5, 100)
        assert 0 <= st.batches_ahead <= 3 and st.prefetch == 3
        assert st.images_per_second_sent > 0 and st.samples_skipped == 0 and not st.shared
        assert s.totals.streams_started >= 1 and s.totals.batches_sent >= 5
        assert s.pool.workers == 2 and s.pool.ready == 2 and s.pool.restarts == 0 and s.pool.batches_rebuilt == 0
        assert 0.0 <= s.pool.utilization <= 1.0 and s.pool.busy_seconds > 0
        before = s.totals
    finally:
        loader.close_stream(stream, "cancelled by the test")
    after = snapshot(loader).totals
    assert snapshot(loader).streams == ()
    assert after.streams_cancelled == before.streams_cancelled + 1
    assert after.batches_sent == before.batches_sent and after.samples_sent == before.samples_sent


# ---- the Stats RPC, `batchd status` and /metrics on a real server and client ------------------------


def test_stats_status_and_metrics_while_a_loader_is_mid_epoch(server):
    loader = batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, prefetch=2)
    it = iter(loader)
    taken = [next(it) for _ in range(3)]
    assert len(taken) == 3

    reply = get_stats(server.address)
    assert len(reply.streams) == 1, reply
    st = reply.streams[0]
    assert (st.dataset, st.batch_size, st.pipeline, st.epoch, st.rank, st.world_size) == (
        "fmnist-test", BATCH, "none", 0, 0, 1)
    assert st.num_batches == 100
    # The client reads ahead of what the loop took (the batches it granted), never behind; a
    # Batches call's next batch is the lowest granted and not sent.
    assert 3 <= st.batches_sent <= 100 and st.next_batch >= 3 and st.call == "Batches"
    assert st.samples_sent == st.batches_sent * BATCH
    assert st.bytes_sent > 0 and st.transport in ("shm", "inline")
    assert st.peer.startswith("ipv4:127.0.0.1:") or st.peer.startswith("ipv6:")
    assert st.batches_in_flight + st.batches_ready <= st.granted
    assert reply.totals.streams_started == 1 and reply.pool.workers == 2
    assert reply.uptime_seconds > 0

    # The per-stream series carry the stream's labels while it is open.
    labels = (("dataset", "fmnist-test"), ("pipeline", "none"), ("rank", "0"), ("stream", str(st.id)),
              ("transport", st.transport))
    metrics = scrape(server.metrics_address)
    assert metrics[("batchd_streams", ())] == 1
    assert metrics[("batchd_stream_batches_sent_total", labels)] >= 3
    assert ("batchd_stream_images_per_second", labels) in metrics

    res = batchd_cli("status", server.address)
    assert res.returncode == 0, res.stderr
    assert "fmnist-test" in res.stdout and "STREAM" in res.stdout, res.stdout
    res = batchd_cli("status", server.address, "--json")
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert [s["dataset"] for s in data["streams"]] == ["fmnist-test"]
    assert data["streams"][0]["batch_size"] == BATCH and isinstance(data["streams"][0]["batches_sent"], int)

    rest = sum(1 for _ in it)
    assert rest == 97
    loader.close()

    # Finished: no open stream, the totals count it, /metrics agrees with Stats.
    reply = wait_for(lambda: (r := get_stats(server.address)).totals.streams_finished == 1 and r,
                     what="the stream to be counted as finished")
    assert list(reply.streams) == []
    t = reply.totals
    assert (t.streams_started, t.streams_failed, t.streams_cancelled) == (1, 0, 0)
    assert (t.batches_sent, t.samples_sent) == (100, 10_000)
    assert stats_dict(reply)["totals"]["batches_sent"] == 100
    metrics = scrape(server.metrics_address)
    assert metrics[("batchd_batches_sent_total", ())] == 100
    assert metrics[("batchd_samples_sent_total", ())] == 10_000
    assert metrics[("batchd_bytes_sent_total", ())] == t.bytes_sent
    assert metrics[("batchd_streams_ended_total", (("outcome", "finished"),))] == 1
    assert metrics[("batchd_streams", ())] == 0
    assert not any(name.startswith("batchd_stream_") for name, _ in metrics)  # the stream's series are gone
    for name in ("batchd_workers", "batchd_worker_restarts_total", "batchd_batches_rebuilt_total",
                 "batchd_worker_utilization_ratio", "batchd_tasks_in_flight", "batchd_shm_slots_in_use",
                 "batchd_shm_bytes", "batchd_leases_held", "batchd_uptime_seconds", "batchd_worker_busy_seconds_total"):
        assert (name, ()) in metrics, name
    assert metrics[("batchd_workers", ())] == 2
    assert 0 <= metrics[("batchd_worker_utilization_ratio", ())] <= 1


def test_a_client_that_goes_away_counts_as_cancelled(server):
    # (the module's server: count from what earlier tests' streams left, once they are all gone)
    before = wait_for(lambda: not (r := get_stats(server.address)).streams and r, what="earlier streams to end").totals
    loader = batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, prefetch=2, transport="inline")
    it = iter(loader)
    next(it)
    wait_for(lambda: len(get_stats(server.address).streams) == 1, what="the stream to show")
    loader.close()
    del it
    reply = wait_for(lambda: (r := get_stats(server.address)).totals.streams_cancelled == before.streams_cancelled + 1
                     and r, what="the stream to be counted as cancelled", show=lambda: get_stats(server.address).totals)
    assert reply.totals.streams_finished == before.streams_finished and not reply.streams


def test_metrics_endpoint_stops_with_the_server(fmnist_root, cache_dir):
    from conftest import running_server

    with running_server(cache_dir=cache_dir, metrics_port=0,
                        datasets={"t": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}) as srv:
        host, _, port = srv.metrics_address.rpartition(":")
        assert host == "127.0.0.1" and int(port) > 0
        assert scrape(srv.metrics_address)[("batchd_streams", ())] == 0
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(f"http://{srv.metrics_address}/metrics", timeout=5)


def test_no_metrics_endpoint_unless_asked(make_server, fmnist_root):
    srv = make_server(datasets={"t": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    assert srv.metrics_address is None


def test_status_of_an_address_without_a_server_fails_quickly_and_plainly():
    start = time.monotonic()
    res = batchd_cli("status", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert res.returncode != 0
    assert "no batchd server answered" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert time.monotonic() - start < 15


# ---- logs --------------------------------------------------------------------------------------------


def test_logs_say_when_a_stream_starts_falls_behind_catches_up_and_finishes(server, monkeypatch, caplog):
    # Make every wait for a batch count as falling behind, and wait in tiny slices.
    monkeypatch.setattr(lag_mod, "BEHIND_S", 0.0)
    monkeypatch.setattr(service_mod, "_POLL_S", 0.0005)
    caplog.set_level(logging.INFO, logger="batchd")
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, prefetch=1,
                                 transport="inline") as loader:
        assert sum(1 for _ in loader) == 100
    wait_for(lambda: "finished after" in caplog.text, what="the finish log")
    text = caplog.text
    assert re.search(r"stream \d+ started: dataset=fmnist-test .*client=ipv[46]:", text), text
    assert re.search(r"stream \d+ \(dataset fmnist-test, pipeline none\) is falling behind: its client has waited", text), text
    assert re.search(r"stream \d+ caught up: batch \d+ came after", text), text
    assert re.search(r"stream \d+ finished after 100 of 100 batches \(10000 samples, [\d.]+ MB sent", text), text
    assert text.count("is falling behind") == 1  # at most one warning a minute per stream


# ---- `batchd serve --metrics-port` --------------------------------------------------------------------


def test_serve_metrics_port_flag(fmnist_root, tmp_path):
    serve = serve_command("--config", REPO / "examples" / "fashion_mnist.yaml", "--address", "127.0.0.1:0",
                          "--metrics-port", "0", "--workers", "1")
    with ServerProcess(serve, cwd=REPO, env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)}, timeout=60) as server:
        m = re.search(r"Prometheus metrics on http://(\S+)/metrics", server.log)  # (logged before "listening on")
        metrics = m and m.group(1)
        assert metrics and not metrics.endswith(":0"), server.log
        assert scrape(metrics)[("batchd_workers", ())] == 1
        res = batchd_cli("status", server.address)
        assert res.returncode == 0 and "no open streams" in res.stdout, res.stdout + res.stderr
        server.send_signal(signal.SIGTERM)
        assert server.wait(timeout=30) == 0, server.log
