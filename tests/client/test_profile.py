"""loader.profile(): each verdict built for real (a sleeping training step, a heavy pipeline on one
worker, a slow S3 store behind a latency proxy, a throttled link), the profiler range around the
loop's wait, and what the client reports to the server on the progress channel."""

from __future__ import annotations

import time

import albumentations as A
import pytest
import torch

import batchd
from batchd.client.loader.profile import COPY_SHARE, GROUPS, READ_SHARE, TRAINER_BOUND_WAIT, WORKERS_BUSY, judge
from batchd.client.transport.server_stats import get_stats
from batchd.client.loader.timings import LoopTimings
from helpers import ThrottledProxy, write_class_tree
from seaweed import seaweed  # noqa: F401  (the session fixture)

from s3proxy import DelayProxy

pytestmark = pytest.mark.timeout(180)

FMNIST = {"kind": "fashion-mnist", "root": "/usr/share/datasets/fashion-mnist", "split": "test"}


def fmnist(fmnist_root) -> dict:
    return {"fmnist": {**FMNIST, "root": str(fmnist_root)}}


def read(loader, batches: int, step_s: float = 0.0) -> None:
    for i, _ in enumerate(loader):
        if step_s:
            time.sleep(step_s)
        if i + 1 == batches:
            break


def assert_consistent(p: dict, batches: int) -> None:
    """What every profile promises: its keys, seconds >= 0, shares in [0, 1] adding up to 1 per group."""
    assert {"verdict", "advice", "wait_ratio", "stages"} <= set(p)
    assert p["batches"] == batches
    assert 0 <= p["wait_ratio"] <= 1 and 0 <= p["workers_busy_ratio"] <= 1
    assert all(v >= 0 for v in p["stages"].values())
    for members in GROUPS.values():
        assert all(0 <= p["shares"][s] <= 1 for s in members)
        assert sum(p["shares"][s] for s in members) == pytest.approx(1.0) or not any(p["stages"][s] for s in members)
    assert p["advice"].endswith(".") and p["verdict"] in str(p)  # one sentence; the table names the verdict


def test_a_sleeping_training_step_is_trainer_bound(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root))
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=100, prefetch=4) as loader:
        it = iter(loader)
        steps = 0.0  # from a batch in hand to the next call: what the loader counts as step
        t0 = time.perf_counter()
        for i in range(30):
            next(it)
            got = time.perf_counter()
            time.sleep(0.03)
            asked_next = time.perf_counter()
            if i < 29:
                steps += asked_next - got
        p = loader.profile()
        assert p["verdict"] == "trainer-bound", p.table()
        assert p["wait_ratio"] < TRAINER_BOUND_WAIT
        # the loop's step is the sleeps between batches (and the loader's own accounting, under 1 ms a
        # batch); from the first call to the 30th batch: its waits (the first one is startup) and steps
        assert steps <= p["stages"]["step"] <= steps + 0.03 and steps >= 29 * 0.03
        assert p["stages"]["wait"] + p["stages"]["step"] + p["startup_seconds"] == pytest.approx(got - t0, abs=0.01)
        # the server was ahead of this loop: after the first batch the loop hardly waited (built
        # batches wait in the loader's lookahead now, granted a window at a time, not in the
        # server's reorder buffer)
        assert p["stages"]["wait"] < 0.1 * p["stages"]["step"], p.table()
        assert_consistent(p, 30)
        # the client reports its wait and verdict to the server with its progress (every 0.5 s)
        for _ in range(60):
            next(it)
            time.sleep(0.03)
            st = get_stats(server.address).streams[0]
            if st.verdict == "trainer-bound":
                break
        assert st.verdict == "trainer-bound" and st.reports_wait and 0 <= st.wait_ratio < 0.2, st
        it.close()


def test_a_heavy_pipeline_on_one_worker_is_cpu_bound(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root), workers=1)
    heavy = A.Compose([A.Resize(96, 96), A.GaussianBlur(blur_limit=(7, 7), p=1.0), A.MedianBlur(blur_limit=7, p=1.0)])
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=8, transform=heavy, prefetch=2) as loader:
        read(loader, 20)
        p = loader.profile()
    assert p["verdict"] == "cpu-bound", p.table()
    assert p["workers_busy_ratio"] >= WORKERS_BUSY and p["wait_ratio"] > 0.5
    worker = {s: p["stages"][s] for s in ("read", "decode", "pipeline", "cache", "write")}
    assert max(worker, key=worker.get) == "pipeline" and "pipeline" in p["evidence"]
    assert p["stages"]["read"] / sum(worker.values()) < READ_SHARE
    assert_consistent(p, 20)


def test_a_slow_s3_store_is_storage_bound(make_server, seaweed, tmp_path):  # noqa: F811
    write_class_tree(tmp_path / "photos", {"cat": 12, "dog": 12})
    seaweed.upload_tree(tmp_path / "photos", "profile-photos")
    with DelayProxy(int(seaweed.endpoint.rsplit(":", 1)[1]), latency_ms=40) as proxy:
        options = {**seaweed.storage_options, "endpoint_url": proxy.url}
        server = make_server(workers=1, reads_in_flight=1, datasets={
            "s3": {"kind": "imagefolder", "root": f"s3://{seaweed.bucket}/profile-photos", "storage_options": options}})
        with batchd.RemoteDataLoader(server.address, "s3", batch_size=4, prefetch=2) as loader:
            read(loader, 6)
            p = loader.profile()
    assert p["verdict"] == "storage-bound", p.table()
    worker = sum(p["stages"][s] for s in ("read", "decode", "pipeline", "cache", "write"))
    assert p["stages"]["read"] / worker >= READ_SHARE
    # one read at a time, 40 ms each: the stall is at least most of 4 x 40 ms per batch
    assert p["stages"]["read"] / p["batches"] > 0.1
    assert_consistent(p, 6)


def test_a_throttled_link_is_transport_bound(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root))
    proxy = ThrottledProxy(server.address, bytes_per_second=2_000_000)  # 2 MB/s; a batch is 200 kB
    try:
        with batchd.RemoteDataLoader(proxy.address, "fmnist", batch_size=256, transport="inline",
                                     prefetch=2) as loader:
            read(loader, 16)
            p = loader.profile()
    finally:
        proxy.close()
    assert p["verdict"] == "transport-bound", p.table()
    assert p["workers_busy_ratio"] < WORKERS_BUSY and p["wait_ratio"] > 0.5
    # the server had the batches ready; the loop got them late, waiting on the network
    assert p["stages"]["reorder"] + p["stages"]["receive"] > 10 * (p["stages"]["pipeline"] + p["stages"]["decode"])
    assert_consistent(p, 16)


def test_the_wait_shows_in_a_pytorch_profiler_trace(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root))
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=500) as loader:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            n = sum(1 for _ in loader)
        waits = [e for e in prof.events() if e.name == "batchd.wait"]
        assert len(waits) == n + 1  # one per batch, and the one that found the end
        # the ranges hold the waits the profile counts (its first batch is startup)
        total = sum(e.cpu_time_total for e in waits) / 1e6
        p = loader.profile()
        assert total == pytest.approx(p["stages"]["wait"] + p["startup_seconds"], rel=0.2, abs=0.02)


def test_a_new_epoch_starts_a_new_profile(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root))
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=2500) as loader:
        list(loader)
        assert loader.profile()["batches"] == 4 and loader.profile()["epoch"] == 0
        it = iter(loader)
        next(it)
        assert (loader.profile()["batches"], loader.profile()["epoch"]) == (1, 1)
        assert loader.profile()["verdict"] == "unknown"
        it.close()


def _timings(batches: int, **seconds) -> LoopTimings:
    t = LoopTimings(epoch=0, batches=batches)
    t.totals.update(seconds)
    return t


@pytest.mark.parametrize("wait, busy, read, copy, verdict", [
    (0.049, 1.0, 1.0, 0.0, "trainer-bound"),  # just under the wait threshold: nothing else matters
    (0.05, WORKERS_BUSY, READ_SHARE, 0.0, "storage-bound"),  # at both thresholds
    (0.05, WORKERS_BUSY, READ_SHARE - 0.01, 0.0, "cpu-bound"),
    (0.5, WORKERS_BUSY - 0.01, 0.9, COPY_SHARE, "copy-bound"),  # workers not busy: the copy decides
    (0.5, WORKERS_BUSY - 0.01, 0.9, COPY_SHARE - 0.01, "transport-bound"),
])
def test_the_rules_and_their_thresholds(wait, busy, read, copy, verdict):
    # one batch-second of loop per batch (wait + step = 1 s), one second of worker time per batch
    n = 10
    t = _timings(n, wait=wait * n, step=(1 - wait) * n, read=read * n, pipeline=(1 - read) * n, copy=copy * n)
    t.busy = {1: busy}
    assert judge(t)[0] == verdict
