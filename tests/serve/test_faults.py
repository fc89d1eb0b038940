"""Reliability: poison batches, bad files, exact resume, server restarts and signals, vanishing
and slow clients, timeouts.

Everything is real: servers (in this process, or ``python -m batchd.cli serve`` subprocesses),
worker processes killed or stopped with real signals, image files written by OpenCV (and cut,
emptied or faked), client processes that die. Durations are never asserted except for the
generous bounds the reliability issue states; everything else polls with a deadline.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import threading
import time

import albumentations as A
import cv2
import grpc
import numpy as np
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import batchd
from helpers import digest, free_port, wait_until, write_png
from batchd.sampler import shard_indices
from batchd.server import shm as server_shm
from procs import (N_TEST, RANDOM_AUG, SLOW, ServerProcess, _stat, alive, cmdline, descendants, fmnist_test_config,  # noqa: F401
                   health_status, loader, segments_of, write_server_config)

pytestmark = pytest.mark.timeout(180)

# --- 1. a poison batch --------------------------------------------------------------------------


class BatchKiller(threading.Thread):
    """SIGKILLs whichever worker holds batch ``k`` of the first stream that reaches it, every time
    the batch is (re)dispatched, until ``stop`` is set."""

    def __init__(self, pool, k: int):
        super().__init__(name="batch-killer", daemon=True)
        self.pool, self.k = pool, k
        self.stop = threading.Event()
        self.stream = None
        self.killed: list[int] = []  # pids
        self._seen: set[int] = set()  # task ids already killed

    def run(self) -> None:
        while not self.stop.is_set():
            for task_id, job in dict(self.pool._in_flight).items():  # dict(): one atomic copy
                if job.batch_index != self.k or task_id in self._seen:
                    continue
                if self.stream is None:
                    self.stream = job.stream
                if job.stream is not self.stream:
                    continue
                handle = self.pool._workers.get(job.worker_id)
                if handle is None:
                    continue
                self._seen.add(task_id)
                try:
                    os.kill(handle.process.pid, signal.SIGKILL)
                    self.killed.append(handle.process.pid)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)


def test_poison_batch_fails_with_worker_error_after_retries(make_server, fmnist_root):
    retries, k, bs = 2, 2, 16
    server = make_server(workers=2, max_task_retries=retries, datasets=fmnist_test_config(fmnist_root))
    pool = server.loader.pool
    kw = dict(batch_size=bs, shuffle=True, seed=21, transform=SLOW, prefetch=1)
    killer = BatchKiller(pool, k)
    killer.start()
    delivered = []
    try:
        with loader(server, **kw) as ld:
            with pytest.raises(batchd.WorkerError) as e:
                for b in ld:
                    delivered.append((b["index"].numpy().copy(), digest(b)))
    finally:
        killer.stop.set()
        killer.join(5)

    # prefetch=1: batch k was alone in flight, so each death was its own; it was built
    # 1 + max_task_retries times, every time on a worker that was then killed
    assert len(killer.killed) == retries + 1, f"killed {killer.killed}; log: {server.loader.pool.restarts} restarts"
    want = shard_indices(N_TEST, shuffle=True, seed=21, epoch=0, rank=0, world_size=1, drop_last=False)
    msg = str(e.value)
    assert "fmnist-test" in msg, msg
    assert str(want[k * bs:(k + 1) * bs].tolist()) in msg, f"the samples of batch {k} are not named: {msg}"
    assert re.search(rf"\bbatch {k}\b", msg), msg

    # every batch before k arrived, in order, intact (equal to a clean run below)
    assert [idx.tolist() for idx, _ in delivered] == [want[b * bs:(b + 1) * bs].tolist() for b in range(k)]

    # the dead workers were replaced and a new stream works, batch k included
    assert wait_until(lambda: len(pool.worker_pids) == 2 and all(w.process.is_alive() for w in pool._workers.values()))
    assert not set(killer.killed) & set(pool.worker_pids)
    assert pool.restarts >= retries + 1
    with loader(server, **kw) as ld:
        it = iter(ld)
        clean = [digest(next(it)) for _ in range(k + 1)]
    assert clean[:k] == [d for _, d in delivered], "batches before the poison one differ from a clean run"
    assert wait_until(lambda: not server.loader.streams, 10)


# --- 2. bad files -----------------------------------------------------------------------------

BAD_KINDS = {
    # name: (file name, reason pattern)
    "truncated": ("bad.jpg", r"truncated JPEG"),
    "empty": ("bad.jpg", r"empty file"),
    "text": ("bad.jpg", r"not a decodable image"),
    "huge": ("bad.png", r"image too large: 200x200 = 40000 pixels > max_pixels 10000"),
}
MAX_PIXELS = 100 * 100


def write_bad(path: pathlib.Path, kind: str, rng: np.random.Generator) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "truncated":
        ok, enc = cv2.imencode(".jpg", rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
        assert ok and enc[:2].tobytes() == b"\xff\xd8"
        path.write_bytes(enc.tobytes()[: len(enc) // 2])
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("this is not an image, whatever its name says\n" * 20)
    elif kind == "huge":
        write_png(path, rng.integers(0, 256, (200, 200, 3), dtype=np.uint8))
    else:
        raise AssertionError(kind)


# The skip folder: 12 samples, sorted by (class, name); the bad ones are 2, 3, 7 and 9
SKIP_LAYOUT = [
    ("a/00.png", None), ("a/01.png", None), ("a/02.jpg", "truncated"), ("a/03.jpg", "empty"),
    ("a/04.png", None), ("a/05.png", None), ("b/00.png", None), ("b/01.jpg", "text"),
    ("b/02.png", None), ("b/03.png", "huge"), ("b/04.png", None), ("b/05.png", None),
]
SKIP_BAD = {i for i, (_, kind) in enumerate(SKIP_LAYOUT) if kind}


@pytest.fixture(scope="module")
def bad_files_server(tmp_path_factory):
    """One server (1 worker) with a raise-dataset per kind of bad file and two skip datasets.

    Yields (server, {skip sample index: rgb} for the good samples of the skip folder).
    """
    from conftest import running_server

    rng = np.random.default_rng(0)
    base = tmp_path_factory.mktemp("bad-files")
    datasets = {}
    for kind, (name, _) in BAD_KINDS.items():
        root = base / f"raise-{kind}"
        for rel in ("a/00.png", "a/01.png", "a/02.png", "b/00.png", "b/z.png"):  # bad: b/bad.* = index 4
            write_png(root / rel, rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
        write_bad(root / "b" / name, kind, rng)
        datasets[f"raise-{kind}"] = {"kind": "imagefolder", "root": str(root), "max_pixels": MAX_PIXELS}

    good = {}
    root = base / "skip"
    for i, (rel, kind) in enumerate(SKIP_LAYOUT):
        if kind:
            write_bad(root / rel, kind, rng)
        else:
            good[i] = rng.integers(0, 256, (8, 8, 3), dtype=np.uint8)
            write_png(root / rel, good[i])
    # batches of 3 x 512 x 512 x 3 outgrow the default 1 MiB slot: the worker grows a segment,
    # then fails on the empty file
    big = base / "big-then-bad"
    write_png(big / "a" / "0.png", rng.integers(0, 256, (512, 512, 3), dtype=np.uint8))
    write_bad(big / "a" / "1.jpg", "empty", rng)
    write_png(big / "a" / "2.png", rng.integers(0, 256, (512, 512, 3), dtype=np.uint8))
    datasets["big-then-bad"] = {"kind": "imagefolder", "root": str(big)}

    common = {"kind": "imagefolder", "root": str(root), "max_pixels": MAX_PIXELS, "on_error": "skip"}
    datasets["skip-half"] = {**common, "max_skipped_fraction": 0.5}
    datasets["skip-none"] = {**common, "max_skipped_fraction": 0.0}
    with running_server(workers=1, cache_dir=base / "cache", datasets=datasets) as server:
        yield server, good


@pytest.mark.parametrize("kind", sorted(BAD_KINDS))
def test_bad_file_raises_sample_error(bad_files_server, kind):
    server, _ = bad_files_server
    name, reason = BAD_KINDS[kind]
    dataset = f"raise-{kind}"
    delivered = []
    with loader(server, dataset=dataset, batch_size=2) as ld:
        with pytest.raises(batchd.SampleError) as e:
            for b in ld:
                delivered.append(b["index"].tolist())
    assert delivered == [[0, 1], [2, 3]], "the batches before the bad sample were not delivered"
    err = e.value
    assert (err.dataset, err.index, err.path) == (dataset, 4, f"b/{name}")
    assert re.search(reason, err.reason), err.reason
    for part in (dataset, "4", f"b/{name}"):
        assert part in str(err), f"{part!r} not in {str(err)!r}"
    assert re.search(reason, str(err)), str(err)


def test_failed_batches_leave_no_shared_memory_behind(bad_files_server):
    """A worker that grew a segment for a batch, then failed on a bad sample, must remove it:
    no one adopts it, so it would stay in /dev/shm (even after the server stops) per failure."""
    server, _ = bad_files_server
    prefix = server.loader.owner.prefix
    before = sorted(p.name for p in server_shm.SHM_DIR.glob(prefix + "*"))
    for _ in range(3):
        with loader(server, dataset="big-then-bad", batch_size=3) as ld:
            with pytest.raises(batchd.SampleError, match="empty file"):
                next(iter(ld))
    after = sorted(p.name for p in server_shm.SHM_DIR.glob(prefix + "*"))
    assert after == before, f"segments left by failed batches: {sorted(set(after) - set(before))}"


@pytest.mark.parametrize("batch_size, shuffle", [(2, False), (5, True)])
def test_bad_files_skipped_every_good_sample_once(bad_files_server, batch_size, shuffle):
    """batch_size=2 in file order includes a batch of two bad samples (an empty batch)."""
    server, good = bad_files_server
    order = shard_indices(len(SKIP_LAYOUT), shuffle=shuffle, seed=5, epoch=0, rank=0, world_size=1, drop_last=False)
    seen, skipped_seen = [], []
    with loader(server, dataset="skip-half", batch_size=batch_size, shuffle=shuffle, seed=5) as ld:
        batches = list(ld)
        assert len(batches) == len(ld)
    for b, batch in enumerate(batches):
        want = order[b * batch_size:(b + 1) * batch_size].tolist()
        want_kept = [i for i in want if i not in SKIP_BAD]
        want_skipped = [i for i in want if i in SKIP_BAD]
        got = batch["index"].tolist()
        assert got == want_kept, f"batch {b}: indices {got}, expected {want_kept} (of {want})"
        assert (batch["skipped"].tolist() if "skipped" in batch else []) == want_skipped, f"batch {b}"
        assert batch["image"].shape[0] == batch["label"].shape[0] == len(want_kept)
        for row, i in enumerate(got):
            np.testing.assert_array_equal(batch["image"][row].numpy(), good[i])
            assert batch["label"][row].item() == (0 if SKIP_LAYOUT[i][0].startswith("a/") else 1)
        seen += got
        skipped_seen += want_skipped
    assert sorted(seen) == sorted(good), "a good sample was lost or repeated"
    assert sorted(skipped_seen) == sorted(SKIP_BAD)


def test_too_many_skipped_samples_fail_the_stream(bad_files_server):
    server, _ = bad_files_server
    with loader(server, dataset="skip-none", batch_size=4) as ld:
        with pytest.raises(batchd.SampleError, match="too many bad samples") as e:
            for _ in ld:
                pass
    assert e.value.dataset == "skip-none"
    assert e.value.index in SKIP_BAD
    # the server is fine, and a lenient dataset over the same files still works
    with loader(server, dataset="skip-half", batch_size=4) as ld:
        assert sum(len(b["index"]) for b in ld) == len(SKIP_LAYOUT) - len(SKIP_BAD)


# --- 3. exact resume --------------------------------------------------------------------------


def test_resume_from_state_dict_mid_epoch(fmnist_server, make_server, fmnist_root):
    kw = dict(batch_size=500, shuffle=True, seed=77, transform="flip")
    with loader(fmnist_server, **kw) as ld:
        ld.set_epoch(2)
        clean = [digest(b) for b in ld]
    assert len(clean) == 20

    k = 7
    with loader(fmnist_server, **kw) as ld:
        ld.set_epoch(2)
        it = iter(ld)
        first = [digest(next(it)) for _ in range(k)]
        state = json.loads(json.dumps(ld.state_dict()))  # it must survive a checkpoint file
    assert first == clean[:k]
    assert (state["epoch"], state["next_batch"]) == (2, k)

    # resumed on a fresh server (as after a restart): no computation of the old loader to join, so
    # batches k.. are computed from start_batch, and nothing before them
    fresh = make_server(workers=2, datasets=fmnist_test_config(fmnist_root),
                        pipelines={"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))})
    with loader(fresh, **kw) as ld:
        ld.load_state_dict(state)
        rest = [digest(b) for b in ld]
        assert ld.epoch == 3, "finishing the resumed epoch did not advance the epoch"
    assert rest == clean[k:], "the resumed loader did not continue with exactly the remaining batches"
    assert fresh.loader.pool.batches_built == len(clean) - k, "the resumed epoch computed batches before start_batch"

    # a state saved by a loader with other settings is refused, naming the setting (another
    # batch_size or world_size resumes elastically: tests/client/test_elastic.py)
    for other, key in [(dict(kw, seed=78), "seed"), (dict(kw, drop_last=True), "drop_last"),
                       (dict(kw, transform=None), "pipeline"), (dict(kw, shuffle=False), "shuffle")]:
        with loader(fmnist_server, **other) as ld:
            with pytest.raises(ValueError, match=key):
                ld.load_state_dict(state)
    with loader(fmnist_server, dataset="fmnist-train", **kw) as ld:
        with pytest.raises(ValueError, match="dataset"):
            ld.load_state_dict(state)


def test_join_after_batches_were_lent_elsewhere(fmnist_server):
    """A stream that joins a shared computation at a batch another stream has taken (and lent over
    shared memory) still gets it, also once that stream has left: e.g. a loader resumed from a
    state_dict right after the old one closed, whose stream the server has not dropped yet.
    (Before the fix, Computation.claim removed lent batches from the history, so the joiner
    waited forever.)"""
    kw = dict(batch_size=50, shuffle=True, seed=4242, transform=SLOW)  # 0.5 s a batch: the claimer stays near
    ours = lambda: [s for s in list(fmnist_server.loader.streams.values()) if s.request.seed == 4242]  # noqa: E731
    got: list = []
    counters = fmnist_server.loader.counters
    with loader(fmnist_server, transport="shm", **kw) as a, loader(fmnist_server, transport="inline", timeout=5, **kw) as b:
        it_a = iter(a)
        first = digest(next(it_a))  # batch 0, lent to a's client: claimed out of the computation
        started = counters["streams_started"]
        reader = threading.Thread(target=lambda: got.append(_next_or_error(b)), daemon=True)
        reader.start()  # b asks for batch 0 of the same computation
        # (b's stream may be over already: when batch 0 is still kept as history it is served at once)
        assert wait_until(lambda: len(ours()) == 2 or counters["streams_started"] > started or got), \
            "the second stream did not start"
        a.close()  # the claimer leaves; b is alone, at batch 0
        reader.join(30)
    assert got, "the reader thread did not finish"
    if isinstance(got[0], BaseException):
        raise got[0]
    assert got[0] == first


def _next_or_error(ld):
    try:
        return digest(next(iter(ld)))
    except BaseException as e:  # handed to the test's thread
        return e


# --- 4. the server restarts mid-stream --------------------------------------------------------


def test_server_restart_mid_stream_resumes_byte_identical(server_procs, fmnist_root, tmp_path, caplog):
    address = f"127.0.0.1:{free_port()}"
    cfg = write_server_config(tmp_path, fmnist_root)
    first = server_procs(cfg, address).start()
    kw = dict(batch_size=250, shuffle=True, seed=13, transform=RANDOM_AUG, reconnect_timeout=60)

    with loader(address, **kw) as ld:
        clean = [digest(b) for b in ld]
    assert len(clean) == 40

    got, indices, restarted = [], [], None
    caplog.set_level(logging.INFO, logger="batchd.client.loader.loader")
    with loader(address, **kw) as ld:
        for i, b in enumerate(ld):
            got.append(digest(b))
            indices.append(b["index"].numpy().copy())
            if i == 9:
                first.signal(signal.SIGTERM)
                assert first.wait(30) == 0, first.log
                restarted = server_procs(cfg, address).start()
        assert ld.epoch == 1
    assert restarted is not None and restarted.pid != first.pid
    # the stream really broke and was resumed on the new server (not all sent before the signal)
    resumed = [r.getMessage() for r in caplog.records if "resumed the stream" in r.getMessage()]
    assert len(resumed) == 1 and re.search(r"batch (1\d|[2-3]\d)\b", resumed[0]), resumed
    assert (np.bincount(np.concatenate(indices), minlength=N_TEST) == 1).all(), "a sample is missing or repeated"
    assert got == clean, "the epoch across a server restart differs from a clean run"
    restarted.signal(signal.SIGTERM)
    assert restarted.wait(30) == 0, restarted.log


# --- 5. SIGTERM with streams open -------------------------------------------------------------


def test_sigterm_with_open_streams(server_procs, fmnist_root, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    srv = server_procs(write_server_config(tmp_path, fmnist_root), address).start()
    health_cli = [sys.executable, "-m", "batchd.cli", "health", address]
    assert subprocess.run(health_cli, capture_output=True, timeout=60).returncode == 0

    # watch the health status: the server must report NOT_SERVING before it goes away
    statuses: list[str] = []
    channel = grpc.insecure_channel(address)
    watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=""))

    def follow():
        try:
            for reply in watch:
                statuses.append(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
                if statuses[-1] == "NOT_SERVING":
                    watch.cancel()  # an open Watch would hold the server's shutdown for its whole grace period
        except grpc.RpcError:
            pass

    watcher = threading.Thread(target=follow, daemon=True)
    watcher.start()
    assert wait_until(lambda: statuses == ["SERVING"]), statuses

    # two streams in progress (SLOW: far from their end when the signal comes, whatever gRPC
    # buffers ahead): one that gives up at once, one that retries for 2 s
    no_retry = loader(address, batch_size=10, transform=SLOW, reconnect_timeout=0)
    retry = loader(address, batch_size=10, transform=SLOW, reconnect_timeout=2, transport="inline")
    it_no_retry, it_retry = iter(no_retry), iter(retry)
    next(it_no_retry), next(it_retry)
    tree = descendants(srv.pid)
    workers = [p for p in tree if (_stat(p) or ("", srv.pid, 0))[1] != srv.pid]  # grandchildren (via the forkserver)
    assert len(workers) >= 2, {p: cmdline(p) for p in tree}
    segments = segments_of(srv.pid)
    assert segments, "the server has no shared-memory segments"

    srv.signal(signal.SIGTERM)
    try:
        with pytest.raises(ConnectionError, match="unavailable") as e:
            for _ in it_no_retry:
                pass
        with pytest.raises(ConnectionError, match=r"reconnect_timeout=2\b") as e2:
            for _ in it_retry:
                pass
        assert address in str(e.value) and address in str(e2.value)
        assert re.search(r"within reconnect_timeout=2 s", str(e2.value)), str(e2.value)
    finally:
        no_retry.close()
        retry.close()

    assert srv.wait(30) == 0, srv.log
    watcher.join(10)
    channel.close()
    assert "NOT_SERVING" in statuses, f"health went {statuses}, never NOT_SERVING"
    assert statuses.index("NOT_SERVING") > statuses.index("SERVING")
    assert wait_until(lambda: not any(alive(p, s) for p, s in tree.items()), 10), (
        "processes of the server left behind: " + str({p: cmdline(p) for p, s in tree.items() if alive(p, s)})
    )
    assert not segments_of(srv.pid), f"shared memory left behind: {segments_of(srv.pid)}"
    assert subprocess.run(health_cli + ["--timeout", "1"], capture_output=True, timeout=60).returncode != 0


# --- 6. SIGKILL of the server -----------------------------------------------------------------


def test_sigkill_of_server_workers_exit_by_themselves(server_procs, make_server, fmnist_root, tmp_path):
    address = f"127.0.0.1:{free_port()}"
    srv = server_procs(write_server_config(tmp_path, fmnist_root), address).start()
    ld = loader(address, batch_size=100, transform=SLOW, reconnect_timeout=0, prefetch=4)
    it = iter(ld)
    next(it)  # workers busy building the batches ahead
    tree = descendants(srv.pid)
    names = {p: cmdline(p) for p in tree}
    assert any("forkserver" in c for c in names.values()), names
    assert len(tree) >= 3, names
    segments = segments_of(srv.pid)
    assert segments

    srv.signal(signal.SIGKILL)
    assert srv.wait(10) == -signal.SIGKILL
    try:
        assert wait_until(lambda: not any(alive(p, s) for p, s in tree.items()), 10), (
            "still running 10 s after the server was SIGKILLed: "
            + str({p: names[p] for p, s in tree.items() if alive(p, s)})
        )
        with pytest.raises(ConnectionError):
            for _ in it:
                pass
    finally:
        ld.close()

    # its shared memory stays behind until the next server starts and removes it (a server of
    # another test run on this machine may do that first)
    make_server(workers=1, datasets=fmnist_test_config(fmnist_root))
    assert not segments_of(srv.pid), f"stale segments not removed: {segments_of(srv.pid)}"


# --- 7. one stream cancelled while another runs -----------------------------------------------


def test_cancel_one_stream_while_another_runs(fmnist_server):
    streams = fmnist_server.loader.streams

    def ours(seed):
        return [s for s in list(streams.values()) if s.request.seed == seed]

    # Both streams must outlast what gRPC buffers ahead of a reader (megabytes): A is slow to
    # build, B's batches are 400 kB (a resize to 64 x 64), 40 MB per epoch.
    a = loader(fmnist_server, batch_size=10, shuffle=True, seed=1001, transform=SLOW)
    b = loader(fmnist_server, batch_size=100, shuffle=True, seed=1002, transform=A.Resize(64, 64))
    try:
        it_b = iter(b)
        got_b = [next(it_b)["index"].numpy().copy()]
        it_a = iter(a)  # held: a dropped iterator (a `break` out of `for`) cancels its call by itself
        for _ in range(2):
            next(it_a)
            got_b.append(next(it_b)["index"].numpy().copy())
        assert ours(1001) and ours(1002)
        a.close()
        assert wait_until(lambda: not ours(1001), 5), "the cancelled stream is still open on the server"
        assert ours(1002), "the other stream was closed too"
        for batch in it_b:
            got_b.append(batch["index"].numpy().copy())
    finally:
        a.close()
        b.close()
    assert len(got_b) == 100
    np.testing.assert_array_equal(
        np.concatenate(got_b),
        shard_indices(N_TEST, shuffle=True, seed=1002, epoch=0, rank=0, world_size=1, drop_last=False),
    )
    assert wait_until(lambda: not ours(1002), 5)


# --- 8. a client process vanishes -------------------------------------------------------------

CHILD = r"""
import os, sys, time
import albumentations as A
import batchd
slow = A.Compose([A.Resize(512, 512), A.MedianBlur(blur_limit=(15, 15), p=1.0), A.Resize(28, 28)])  # the stream lasts
ld = batchd.RemoteDataLoader(sys.argv[1], "fmnist-test", batch_size=50, transport="shm", prefetch=4,
                             transform=slow, connect_timeout=30)
it = iter(ld)  # kept: a dropped generator would cancel the stream at once
batch = next(it)
print(ld._shm.session, flush=True)
if sys.argv[2] == "exit":
    os._exit(0)
time.sleep(600)
"""


def test_vanishing_client_process_frees_stream_and_leases(make_server, fmnist_root):
    server = make_server(workers=1, datasets=fmnist_test_config(fmnist_root))
    loader_ = server.loader
    assert loader_.leases.sessions == 0 and not loader_.streams
    for how in ("exit", "sigkill"):
        child = subprocess.Popen([sys.executable, "-c", CHILD, server.address, how], stdout=subprocess.PIPE,
                                 text=True, env=dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1"))
        try:
            ready, _, _ = select.select([child.stdout], [], [], 120)
            assert ready, "the client process printed nothing"
            session = child.stdout.readline().strip()
            assert re.fullmatch(r"[0-9a-f]{32}", session), session
            if how == "sigkill":
                assert loader_.leases.held(session) >= 1, "the client holds a batch but no lease"
                assert loader_.streams, "no stream for the client's iteration"
                child.send_signal(signal.SIGKILL)
            child.wait(60)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()
        assert wait_until(lambda: not loader_.streams, 10), f"{how}: stream left open: {list(loader_.streams)}"
        assert wait_until(lambda: loader_.leases.sessions == 0, 10), f"{how}: session {session} still open"
        assert wait_until(lambda: loader_.slots.in_use == 0, 10), f"{how}: {loader_.slots.in_use} slots in use"
    # and the server serves the next client
    with loader(server, batch_size=1000) as ld:
        assert sum(len(b["index"]) for b in ld) == N_TEST


# --- 9. a slow client keeps server memory flat ------------------------------------------------


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_slow_client_bounded_server_slots(make_server, fmnist_root, transport):
    """A client that stalls after its first batch holds the server to what its config allows, every
    slot counted (``SlotPool.holding``: the server's and those only leases hold): ahead of the
    reader, ``prefetch`` batches built or being built; behind it, ``share_window`` sent batches
    kept for late joiners; and, over shared memory, up to ``max_leases_per_session`` sent batches
    the client holds beyond those (the stream then waits for a lease, and sends inline)."""
    prefetch, window, max_leases = 3, 2, 4
    server = make_server(workers=2, datasets=fmnist_test_config(fmnist_root), share_window=window,
                         max_leases_per_session=max_leases)
    slots, leases = server.loader.slots, server.loader.leases
    bound = prefetch + window + (max_leases if transport == "shm" else 0)
    with loader(server, batch_size=100, prefetch=prefetch, transport=transport) as ld:
        it = iter(ld)
        next(it)
        peak_slots = peak_leases = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:  # the client "trains" for 3 s
            peak_slots = max(peak_slots, slots.holding)
            if ld._shm is not None:
                peak_leases = max(peak_leases, leases.held(ld._shm.session))
            time.sleep(0.002)
        # (at least what the server keeps: a Batches client takes what is built at once, and an
        # inline batch's slot goes back once sent; its history of `window` stays)
        assert min(prefetch, window) <= peak_slots <= bound, f"{peak_slots} slots held (bound {bound})"
        assert peak_leases <= max_leases
        assert (peak_leases > 0) == (transport == "shm")
        assert sum(1 for _ in it) == 99


# --- 10. timeouts -----------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_timeout_when_workers_are_stopped(make_server, fmnist_root):
    server = make_server(workers=2, datasets=fmnist_test_config(fmnist_root))
    pids = list(server.loader.pool.worker_pids)
    stopped = []
    try:
        with loader(server, batch_size=100, prefetch=2, timeout=1, reconnect_timeout=0) as ld:
            it = iter(ld)
            read = sum(1 for _ in zip(range(3), it))
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
                stopped.append(pid)
            with pytest.raises(TimeoutError) as e:
                for _ in it:
                    read += 1
            assert read < 100
        msg = str(e.value)
        assert re.search(rf"\bbatch {read}\b", msg), f"read {read} batches; {msg}"
        assert "fmnist-test" in msg and server.address in msg, msg
    finally:
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
    # the workers carry on once continued
    with loader(server, batch_size=1000) as ld:
        assert sum(len(b["index"]) for b in ld) == N_TEST
