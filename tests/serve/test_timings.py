"""Each batch's BatchTimings, measured by a real server: what each stage counts, straight on the
Loader (no gRPC buffering in between) and through a real loader; the workers' stages on the board."""

from __future__ import annotations

import json
import time

import albumentations as A
import pytest

import batchd
from batchd import wire
from batchd.client.transport.server_stats import get_stats
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.stats import snapshot
from helpers import wait_until, write_class_tree

pytestmark = pytest.mark.timeout(120)

HEAVY = json.dumps(A.to_dict(A.Compose([A.Resize(96, 96), A.GaussianBlur(blur_limit=(7, 7), p=1.0),
                                         A.MedianBlur(blur_limit=7, p=1.0)])))
WORKER_STAGES = ("read", "decode", "pipeline", "cache", "write")


def fmnist(fmnist_root) -> dict:
    return {"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}


def take(loader, stream, timeout: float = 30.0) -> wire.WireTimings:
    """The next batch of ``stream``, sent as the servicer sends it; its timings."""
    batch = stream.next(timeout)
    assert batch is not None
    try:
        return wire.decode_batch(loader.transport.encode(stream, batch)).timings
    finally:
        stream.release(batch)


def work(t: wire.WireTimings) -> float:
    return sum(getattr(t, f"{s}_seconds") for s in WORKER_STAGES)


def test_a_batch_that_waits_for_its_reader_counts_reorder(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root))
    loader = server.loader
    stream = loader.open_stream(StreamRequest(dataset="fmnist", batch_size=100, prefetch=2))
    try:
        first = take(loader, stream)
        time.sleep(0.5)  # batch 1 is built in milliseconds, then waits for us in the reorder buffer
        t = take(loader, stream)
        assert 0.4 <= t.reorder_seconds <= 0.6 + first.reorder_seconds
        assert work(t) < 0.1 and t.send_seconds > 0 and t.queued_seconds >= 0
        assert t.read_io_seconds == 0  # Fashion-MNIST is in memory: nothing is read on I/O threads
        assert t.worker in (0, 1) and 0 <= t.workers_busy_ratio <= 1
    finally:
        loader.close_stream(stream, "test")


def test_a_batch_behind_another_on_its_worker_counts_queued(make_server, fmnist_root):
    server = make_server(datasets=fmnist(fmnist_root), workers=1)
    loader = server.loader
    stream = loader.open_stream(StreamRequest(dataset="fmnist", batch_size=8, prefetch=3, albumentations_json=HEAVY))
    try:
        t0, t1, t2 = (take(loader, stream) for _ in range(3))
        # one worker is sent two tasks at once: the second waits while the first is built
        # (t0 may wait too, on a loaded machine: for the worker's pipe; t1 waits that and t0's work)
        assert t1.queued_seconds >= 0.8 * work(t0) and t1.queued_seconds > t0.queued_seconds
        assert t0.pipeline_seconds > 0.5 * work(t0)  # the blurs are the work
        # every batch: its worker's stages add up to what the pool counted as worker time
        busy = snapshot(loader).pool.busy_seconds
        assert busy >= sum(work(t) for t in (t0, t1, t2)) - 1e-9
    finally:
        loader.close_stream(stream, "test")


def test_worker_seconds_in_the_batches_are_the_pools_busy_seconds(make_server, fmnist_root):
    # two independent paths: the stages each batch carries to the client (summed by its profile),
    # and the worker seconds the pool counted (Stats); nothing else ran on this server
    server = make_server(datasets=fmnist(fmnist_root))
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=500) as loader:
        assert len(list(loader)) == 20
        totals = loader.profile()["stages"]
    pool = get_stats(server.address).pool
    assert sum(totals[s] for s in WORKER_STAGES) == pytest.approx(pool.busy_seconds, rel=1e-6)


def test_the_cache_stage_and_its_hits(make_server, tmp_path):
    write_class_tree(tmp_path / "photos", {"cat": 6, "dog": 6})
    server = make_server(datasets={"photos": {"kind": "imagefolder", "root": str(tmp_path / "photos")}},
                         cache={"memory_bytes": 1 << 20}, reads_in_flight=4)
    loader = server.loader
    pipeline = json.dumps(A.to_dict(A.Compose([A.Resize(8, 8), A.HorizontalFlip()])))
    for epoch, expect_hits in ((0, 0), (1, 12)):
        stream = loader.open_stream(StreamRequest(dataset="photos", batch_size=12, epoch=epoch,
                                                  albumentations_json=pipeline))
        try:
            t = take(loader, stream)
        finally:
            loader.close_stream(stream, "test")
        assert t.cache_hits == expect_hits
        assert t.cache_seconds > 0
        if expect_hits:  # every sample from the cache: nothing decoded (the I/O threads only looked them up)
            assert t.decode_seconds == 0
        else:  # computed: read from the files (on I/O threads) and decoded
            assert t.decode_seconds > 0 and t.read_io_seconds > 0


def test_the_board_shows_what_each_worker_is_doing(make_server, fmnist_root):
    # the train split (7,500 batches of 8): the epoch outlasts the reads that keep the worker busy below
    server = make_server(datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "train"}},
                         workers=1)
    loader = server.loader
    stages = snapshot(loader).pool.worker_stats
    assert [(w.id, w.stage, w.tasks) for w in stages] == [(0, "idle", 0)]
    # prefetch 16: the worker builds for a while before anyone reads (with 2, a fast machine built
    # both batches between two polls and the board was seen only idle, then writing)
    stream = loader.open_stream(StreamRequest(dataset="fmnist", batch_size=8, prefetch=16, albumentations_json=HEAVY))
    try:
        seen = set()

        def pipeline_now():
            (w,) = snapshot(loader).pool.worker_stats
            seen.add(w.stage)
            if w.stage == "idle" and "write" in seen:  # built its window unseen (a loaded machine):
                take(loader, stream)  # one batch read lets it build one more
            return w.stage == "pipeline" and w.tasks > 0

        assert wait_until(pipeline_now, timeout=20, interval=0.01), seen
        (w,) = snapshot(loader).pool.worker_stats
        assert w.pid == loader.pool.worker_pids[0]

        # a reader that keeps up keeps the worker's window full, so it always has a batch to build and
        # its moving busy ratio climbs past the idle time before the stream opened (on a loaded
        # machine the worker was ready seconds earlier: one batch read and a wait never got there)
        def busy_now():
            take(loader, stream)
            return snapshot(loader).pool.worker_stats[0].busy_ratio > 0.5

        assert wait_until(busy_now, timeout=40, interval=0), snapshot(loader).pool.worker_stats[0]
    finally:
        loader.close_stream(stream, "test")
    assert wait_until(lambda: snapshot(loader).pool.worker_stats[0].stage == "idle", timeout=20)
