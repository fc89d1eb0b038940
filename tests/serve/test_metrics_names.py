"""The Prometheus families of issue 21, on a real server with a client mid-epoch: names and types as
the README's Monitoring table gives them (seconds in `_seconds`, shares as `_ratio` in [0, 1]), the
wait a client reports reaching the per-stream and aggregate gauges, and `promtool check metrics`
where promtool is installed."""

from __future__ import annotations

import shutil
import subprocess
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

import batchd
from batchd.client.transport.server_stats import get_stats
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)

FAMILIES = {  # name (without _total) -> type
    "batchd_trainer_data_wait_ratio": "gauge",
    "batchd_stream_data_wait_ratio": "gauge",
    "batchd_workers_busy_ratio": "gauge",
    "batchd_worker_busy_ratio": "gauge",
    "batchd_workers_min": "gauge",
    "batchd_workers_max": "gauge",
    "batchd_workers_cpu_quota": "gauge",
    "batchd_worker_scaling": "counter",
    "batchd_batch_stage_seconds": "counter",
    "batchd_worker_busy_seconds": "counter",
}


def scrape_text(address: str) -> str:
    return urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()


def test_the_wait_clients_report_and_the_workers_figures_are_exported(make_server, fmnist_root):
    server = make_server(metrics_port=0, workers={"min": 1, "max": 2, "cool_down_s": 60},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=100, prefetch=2) as loader:
        it = iter(loader)
        for _ in range(20):
            next(it)
            time.sleep(0.03)
        assert wait_until(lambda: get_stats(server.address).streams[0].reports_wait, timeout=5)
        stream = get_stats(server.address).streams[0]
        text = scrape_text(server.metrics_address)
        it.close()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in FAMILIES.items():
        assert name in families and families[name].type == kind, name
    for name, family in families.items():
        if name.endswith("_ratio"):
            assert all(0.0 <= s.value <= 1.0 for s in family.samples), name
    # the stream's gauge carries the stream's labels and what its client reported
    (sample,) = families["batchd_stream_data_wait_ratio"].samples
    assert sample.labels["stream"] == str(stream.id) and sample.labels["dataset"] == "fmnist"
    assert sample.value == pytest.approx(stream.wait_ratio, abs=0.05) and sample.value < 0.5
    (aggregate,) = families["batchd_trainer_data_wait_ratio"].samples
    assert aggregate.value == pytest.approx(sample.value, abs=0.05)  # one stream: its own
    stages = {s.labels["stage"]: s.value for s in families["batchd_batch_stage_seconds"].samples}
    assert set(stages) == {"queued", "read", "decode", "pipeline", "cache", "write", "reorder", "send", "read_io"}
    assert stages["decode"] > 0 and stages["reorder"] > 0 and all(v >= 0 for v in stages.values())
    bounds = {n: families[n].samples[0].value for n in ("batchd_workers_min", "batchd_workers_max")}
    assert bounds == {"batchd_workers_min": 1, "batchd_workers_max": 2}
    assert families["batchd_workers_cpu_quota"].samples[0].value >= 1
    scaling = {(s.labels["direction"], s.labels["reason"]) for s in families["batchd_worker_scaling"].samples}
    assert scaling == {("up", "clients_waiting"), ("down", "idle")}
    # with nobody reporting, the aggregate is 0 and the per-stream series are gone
    assert wait_until(lambda: not get_stats(server.address).streams, timeout=10)
    after = {f.name: f for f in text_string_to_metric_families(scrape_text(server.metrics_address))}
    assert after["batchd_trainer_data_wait_ratio"].samples[0].value == 0
    assert not after["batchd_stream_data_wait_ratio"].samples


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_accepts_the_exposition(make_server, fmnist_root):
    server = make_server(metrics_port=0,
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=1000) as loader:
        next(iter(loader))
        text = scrape_text(server.metrics_address)
    res = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def test_what_a_client_reports_is_checked(make_server, fmnist_root):
    """A report's wait ratio is clipped to [0, 1] (NaN: 0) and its verdict kept only if it is one of
    the five: a client cannot put arbitrary text into Stats or the metrics."""
    from batchd.server.compute.protocol import StreamRequest
    from batchd.server.serve.stats import snapshot
    from batchd.v1 import loader_pb2 as pb

    server = make_server(datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    loader = server.loader
    stream = loader.open_stream(StreamRequest(dataset="fmnist", batch_size=100, stream_tag="t1"))
    try:
        for ratio, verdict, want in ((0.25, "cpu-bound", (0.25, "cpu-bound")), (7.0, "<script>", (1.0, "")),
                                     (float("nan"), "storage-bound", (0.0, "storage-bound")),
                                     (-1.0, "trainer-bound", (0.0, "trainer-bound"))):
            loader.transport.release(pb.ReleaseLeasesRequest(progress=[pb.StreamProgress(
                stream_tag="t1", batches_taken=1, samples_taken=100, wait_ratio=ratio, verdict=verdict)]))
            (st,) = snapshot(loader).streams
            assert (st.wait_ratio, st.verdict, st.reports_wait) == (*want, True)
    finally:
        loader.close_stream(stream, "test")
