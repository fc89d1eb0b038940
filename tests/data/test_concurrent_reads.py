"""Batches carry each sample's global position; workers read samples concurrently; a worker
killed for a task timeout is reaped before its slot is used again.

Real servers on 127.0.0.1:0 over a small image folder of PNGs (each image's colour encodes its
index, so a wrong byte or a wrong order shows).
"""

from __future__ import annotations

import errno
import os
import pathlib
import threading
import time

import albumentations as A
import cv2
import numpy as np
import pytest
from helpers import digest, wait_until, write_png

import batchd
from batchd.sampler import global_positions, shard_indices, shard_size

pytestmark = pytest.mark.timeout(180)

N = 50
BAD = (3, 17, 18, 41)  # sample indices (sorted file order) that are not images


def rgb(i: int) -> np.ndarray:
    """Image i: uint8 [8 + i % 5, 9, 3], its pixels naming i."""
    return np.full((8 + i % 5, 9, 3), (i, 255 - i, (7 * i) % 256), np.uint8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> dict:
    """Dataset configs: ``ok`` (N good PNGs) and ``skip`` (the same with BAD replaced by junk, on_error skip)."""
    base = tmp_path_factory.mktemp("reads")
    for i in range(N):
        write_png(base / "ok" / "c0" / f"{i:03d}.png", rgb(i))
        path = base / "skip" / "c0" / f"{i:03d}.png"
        if i in BAD:
            path.write_bytes(b"not an image")
        else:
            write_png(path, rgb(i))
    resize = {"kind": "imagefolder", "max_skipped_fraction": 0.5}
    return {
        "ok": {**resize, "root": str(base / "ok")},
        "skip": {**resize, "root": str(base / "skip"), "on_error": "skip"},
    }


def epoch(address: str, dataset: str, **kwargs) -> list[dict]:
    """One epoch as numpy arrays per batch (transform: a Resize, so shapes agree)."""
    kwargs.setdefault("transform", A.Compose([A.Resize(8, 8)]))
    out = []
    with batchd.RemoteDataLoader(address, dataset, connect_timeout=10, timeout=60, **kwargs) as ld:
        for batch in ld:
            out.append({k: v.numpy().copy() for k, v in batch.items()} | {"digest": digest(batch)})
    return out


# --- 1. position ---------------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 3])
def test_position_is_the_global_position_whatever_the_workers(make_server, folder, world_size):
    """batch["position"] is int64 [B], global_positions of the shard, the same with 1 and 2 workers."""
    kw = dict(batch_size=7, shuffle=True, seed=11, world_size=world_size)
    runs = {}
    for workers in (1, 2):
        server = make_server(workers=workers, datasets=folder)
        runs[workers] = [epoch(server.address, "ok", rank=rank, **kw) for rank in range(world_size)]
    for rank in range(world_size):
        one, two = runs[1][rank], runs[2][rank]
        assert [b["digest"] for b in one] == [b["digest"] for b in two]
        assert all(a["position"].tolist() == b["position"].tolist() for a, b in zip(one, two))
        position = np.concatenate([b["position"] for b in one])
        index = np.concatenate([b["index"] for b in one])
        assert one[0]["position"].dtype == np.int64
        size = shard_size(N, world_size, False)
        np.testing.assert_array_equal(position, global_positions(0, size, rank=rank, world_size=world_size))
        np.testing.assert_array_equal(index, shard_indices(N, shuffle=True, seed=11, epoch=0, rank=rank,
                                                           world_size=world_size, drop_last=False))
    if world_size > 1:  # the ranks' positions tile the padded global order
        every = np.concatenate([b["position"] for r in runs[2] for b in r])
        assert sorted(every.tolist()) == list(range(world_size * shard_size(N, world_size, False)))


def test_skipped_samples_leave_position_aligned_with_index(make_server, folder):
    """A skipped sample leaves index and position alike: position p is the sample order[p]."""
    server = make_server(workers=2, datasets=folder)
    batches = epoch(server.address, "skip", batch_size=6, shuffle=True, seed=3)
    order = shard_indices(N, shuffle=True, seed=3, epoch=0, rank=0, world_size=1, drop_last=False)
    skipped = []
    for b in batches:
        assert b["position"].shape == b["index"].shape
        np.testing.assert_array_equal(order[b["position"]], b["index"])
        skipped += b["skipped"].tolist() if "skipped" in b else []
        for image, i in zip(b["image"], b["index"]):
            assert image[0, 0].tolist() == rgb(int(i))[0, 0].tolist()
    assert sorted(skipped) == list(BAD)
    position = np.concatenate([b["position"] for b in batches])
    assert sorted(set(range(N)) - set(position.tolist())) == sorted(np.flatnonzero(np.isin(order, BAD)).tolist())


# --- 2. concurrent reads -------------------------------------------------------------------------


def png_bytes(i: int) -> bytes:
    ok, buf = cv2.imencode(".png", cv2.cvtColor(rgb(i)[:8, :8], cv2.COLOR_RGB2BGR))
    assert ok
    return buf.tobytes()


def fifo_folder(base: pathlib.Path, n: int) -> list[pathlib.Path]:
    """An image folder whose n "images" are named pipes: reading one blocks until the test writes it."""
    paths = [base / "c0" / f"{i:03d}.png" for i in range(n)]
    paths[0].parent.mkdir(parents=True)
    for p in paths:
        os.mkfifo(p)
    return paths


class Writers:
    """The test's ends of the named pipes: ``open_readers()`` opens (without blocking) those
    that a reader has open right now; ``feed(i)`` writes image i and closes its pipe."""

    def __init__(self, paths: list[pathlib.Path]):
        self.paths, self.fds = paths, {}

    def open_readers(self) -> int:
        for i, p in enumerate(self.paths):
            if i not in self.fds:
                try:
                    self.fds[i] = os.open(p, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO: no reader yet
                except OSError as e:
                    if e.errno != errno.ENXIO:
                        raise
        return len(self.fds)

    def feed(self, i: int) -> None:
        fd = self.fds.pop(i)
        os.set_blocking(fd, True)
        os.write(fd, png_bytes(i))
        os.close(fd)

    def unblock(self, timeout: float = 5.0) -> None:
        """Feed every pipe a reader opens within ``timeout`` (so nothing stays blocked on a failure)."""
        deadline = time.monotonic() + timeout
        fed: set[int] = set()
        while len(fed) < len(self.paths) and time.monotonic() < deadline:
            self.open_readers()
            for i in list(self.fds):
                self.feed(i)
                fed.add(i)
            time.sleep(0.02)


def test_reads_of_the_running_and_queued_batches_overlap(make_server, tmp_path):
    """1 worker, reads_in_flight 8, 2 batches of 4 in flight: all 8 files are open for reading at
    once while the test has written none of them, so neither the reads of one batch nor those of
    the batch queued behind it wait for each other (a sequential worker opens one file and waits)."""
    writers = Writers(fifo_folder(tmp_path / "fifo", 8))
    server = make_server(workers=1, reads_in_flight=8, datasets={"fifo": {"kind": "imagefolder", "root": str(tmp_path / "fifo")}})
    batches: list[dict] = []
    errors: list[BaseException] = []

    def consume():
        try:
            with batchd.RemoteDataLoader(server.address, "fifo", batch_size=4, prefetch=2, connect_timeout=10, timeout=60) as ld:
                batches.extend({k: v.numpy().copy() for k, v in b.items()} for b in ld)
        except BaseException as e:
            errors.append(e)

    consumer = threading.Thread(target=consume, daemon=True)
    consumer.start()
    try:
        assert wait_until(lambda: writers.open_readers() == 8, timeout=30), \
            f"only {len(writers.fds)} of 8 files were being read at once: {sorted(writers.fds)}"
        for i in reversed(range(8)):  # the order the reads finish in does not change the batches
            writers.feed(i)
        consumer.join(60)
    finally:
        writers.unblock()
        consumer.join(10)
    assert not errors, errors
    assert [b["index"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for b in batches:
        for image, i in zip(b["image"], b["index"].tolist()):
            np.testing.assert_array_equal(image, rgb(i)[:8, :8])


def test_read_errors_name_dataset_sample_and_path(make_server, tmp_path):
    """A file that cannot be read (deleted after the index was built) fails its batch with
    SampleError naming dataset, index and path, as a sequential read did."""
    root = tmp_path / "broken"
    for i in range(6):
        write_png(root / "c0" / f"{i:03d}.png", rgb(i)[:8, :8])
    server = make_server(workers=1, datasets={"broken": {"kind": "imagefolder", "root": str(root)}})
    (root / "c0" / "003.png").unlink()
    with batchd.RemoteDataLoader(server.address, "broken", batch_size=2, connect_timeout=10, timeout=60) as ld:
        it = iter(ld)
        assert next(it)["index"].tolist() == [0, 1]
        with pytest.raises(batchd.SampleError) as e:
            next(it)
    assert (e.value.dataset, e.value.index, e.value.path) == ("broken", 3, "c0/003.png")
    assert "cannot read file" in e.value.reason and "No such file" in e.value.reason, e.value.reason


# --- 3. a worker killed for a task timeout is reaped before its slot is used again ---------------


def test_timed_out_worker_is_reaped_before_its_slot_is_released(make_server, tmp_path):
    """Sample 0 is a pipe nobody writes, so batch 0 runs past worker_timeout_s; the worker is
    killed, and the batch's shared-memory slot goes back to the pool (where the next task may
    take it) only once the process is gone, never while it could still write into it."""
    writers = Writers(fifo_folder(tmp_path / "hang", 1))
    write_png(tmp_path / "hang" / "c0" / "001.png", rgb(1)[:8, :8])
    server = make_server(workers=1, worker_timeout_s=1.0,
                         datasets={"hang": {"kind": "imagefolder", "root": str(tmp_path / "hang")}})
    pool = server.loader.pool
    (pid,) = pool.worker_pids
    released: list[tuple[str, bool]] = []  # (slot name, the worker's process still exists)
    release = pool.slots.release

    def watched_release(slot):
        released.append((slot.name, os.path.exists(f"/proc/{pid}")))
        return release(slot)

    pool.slots.release = watched_release
    try:
        with batchd.RemoteDataLoader(server.address, "hang", batch_size=1, prefetch=1, connect_timeout=10, timeout=60) as ld:
            with pytest.raises(batchd.WorkerError, match=r"batch 0 .* took longer than worker_timeout_s=1 s"):
                next(iter(ld))
        assert wait_until(lambda: pool.restarts == 1 and pid not in pool.worker_pids, timeout=30)
        assert wait_until(lambda: pool.slots.in_use == 0, timeout=10), "the timed-out batch's slot leaked"
    finally:
        pool.slots.release = release
        writers.unblock(timeout=0.5)
    assert released, "the timed-out batch's slot was never released"
    assert not [name for name, alive in released if alive], \
        f"slots released while the killed worker (pid {pid}) still existed: {released}"


class _Clock:
    """A clock the test moves: ``now`` seconds, advanced by hand (thread-safe enough for reads)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_stalled_read_does_not_shrink_the_reads_kept_outstanding():
    """The reader sizes its read-ahead from read latency / the worker's work per sample. Time the
    worker spends waiting for a late read is not work: counted as work (as before), one stall
    made the reader keep fewer reads outstanding exactly when reads fell behind. A fake clock:
    each read takes 10 ms, the worker works 1 ms per sample; then one read stalls for 2 s."""
    from batchd.server.data.reader import SampleReader

    clock = _Clock()
    gates = {i: threading.Event() for i in range(40)}

    def read(i: int) -> bytes:
        gates[i].wait(30)
        return bytes([i])

    reader = SampleReader(reads_in_flight=16, read_ahead=32, clock=clock)
    try:
        reader.add(1, read, list(range(40)))
        for i in range(20):  # steady state: reads done before they are needed
            clock.now += 0.010
            gates[i].set()
            assert reader.take(1, i, lambda: None) == bytes([i])
            clock.now += 0.001  # the worker decodes
        steady = reader.target
        assert steady >= 30, f"10 ms reads behind 1 ms of work need many reads in flight, got {steady}"

        def stall():  # called every 20 ms while take waits for read 20: 2 s pass, then it arrives
            clock.now += 0.5
            if clock.now - start >= 2.0:
                gates[20].set()

        start = clock.now
        assert reader.take(1, 20, stall) == bytes([20])
        clock.now += 0.001
        for i in range(21, 25):
            gates[i].set()
            assert reader.take(1, i, lambda: None) == bytes([i])
            clock.now += 0.001
        assert reader.target >= steady, f"a stall shrank the reads kept outstanding: {steady} -> {reader.target}"
    finally:
        for g in gates.values():
            g.set()
        reader.close()
