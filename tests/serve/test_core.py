"""End-to-end tests of batchd through RemoteDataLoader against real servers on 127.0.0.1:0.

Everything here runs a real server (worker processes, shared memory, gRPC) over real files:
the Fashion-MNIST IDX files in /usr/share/datasets/fashion-mnist and image folders written
into tmp_path. Reference values come from independent parses of those files.
"""

from __future__ import annotations

import collections
import gzip
import hashlib
import os
import pathlib
import re
import signal
import threading
import time

import albumentations as A
import numpy as np
import pytest
import torch

import batchd
from batchd.sampler import shard_indices
from helpers import free_port, wait_until, write_png

pytestmark = pytest.mark.timeout(120)

N_TEST = 10_000


# --- helpers ---------------------------------------------------------------------------------


def _idx(path: pathlib.Path, offset: int) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), dtype=np.uint8, offset=offset)


@pytest.fixture(scope="module")
def fmnist_test_ref(fmnist_root):
    """(images uint8 [10000, 28, 28], labels int64 [10000]) parsed directly from the .gz files."""
    images = _idx(fmnist_root / "t10k-images-idx3-ubyte.gz", 16).reshape(-1, 28, 28)
    labels = _idx(fmnist_root / "t10k-labels-idx1-ubyte.gz", 8).astype(np.int64)
    assert images.shape == (N_TEST, 28, 28) and labels.shape == (N_TEST,)
    return images, labels


def loader(server, dataset="fmnist-test", **kwargs) -> "batchd.RemoteDataLoader":
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("timeout", 60)
    return batchd.RemoteDataLoader(server.address, dataset, **kwargs)


def epoch_indices(ld) -> list[np.ndarray]:
    """The index tensor of every batch of one pass, as numpy arrays."""
    return [b["index"].numpy().copy() for b in ld]


def batch_digest(b) -> str:
    """A SHA-256 over a batch's image, label and index bytes (and their shapes and dtypes)."""
    h = hashlib.sha256()
    for name in ("image", "label", "index"):
        t = b[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def batch_digests(ld) -> list[str]:
    """``batch_digest`` of every batch of one pass."""
    return [batch_digest(b) for b in ld]


def rand_rgb(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    return rng.integers(0, 256, size=(h, w, 3), dtype=np.uint8)


RANDOM_AUG = A.Compose([
    A.HorizontalFlip(p=0.5),
    A.Affine(rotate=(-20, 20), p=0.7),
    A.RandomBrightnessContrast(p=0.5),
])


def fmnist_test_config(fmnist_root) -> dict:
    return {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}


# --- exactly once, raw values -----------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_every_index_exactly_once_per_epoch(fmnist_server, shuffle):
    with loader(fmnist_server, batch_size=256, shuffle=shuffle, seed=7) as ld:
        batches = epoch_indices(ld)
        assert len(ld) == len(batches) == 40  # ceil(10000 / 256)
    assert [len(b) for b in batches] == [256] * 39 + [10_000 - 39 * 256]
    got = np.concatenate(batches)
    counts = np.bincount(got, minlength=N_TEST)
    assert got.min() >= 0 and got.max() < N_TEST
    assert (counts == 1).all(), f"indices not seen exactly once: {np.flatnonzero(counts != 1)[:10]}"
    if shuffle:
        assert not np.array_equal(got, np.arange(N_TEST)), "shuffle=True gave the identity order"
    else:
        np.testing.assert_array_equal(got, np.arange(N_TEST))


def test_raw_samples_equal_the_idx_files(fmnist_server, fmnist_test_ref):
    images, labels = fmnist_test_ref
    seen = 0
    with loader(fmnist_server, batch_size=256, shuffle=True, seed=3) as ld:
        for b in ld:
            img, lab, idx = b["image"], b["label"], b["index"]
            n = idx.shape[0]
            assert img.dtype == torch.uint8 and tuple(img.shape) == (n, 28, 28, 1)
            assert lab.dtype == torch.int64 and tuple(lab.shape) == (n,)
            assert idx.dtype == torch.int64 and tuple(idx.shape) == (n,)
            i = idx.numpy()
            np.testing.assert_array_equal(img.numpy()[..., 0], images[i])
            np.testing.assert_array_equal(lab.numpy(), labels[i])
            seen += n
    assert seen == N_TEST


# --- determinism ------------------------------------------------------------------------------


def test_same_request_same_bytes_across_worker_counts_and_passes(make_server, fmnist_root, fmnist_test_ref):
    datasets = fmnist_test_config(fmnist_root)
    one = make_server(workers=1, datasets=datasets)
    two = make_server(workers=2, datasets=datasets)
    kw = dict(batch_size=100, shuffle=True, seed=1234, transform=RANDOM_AUG)

    with loader(one, **kw) as ld:
        ref = batch_digests(ld)
    with loader(two, **kw) as ld:
        got_two = batch_digests(ld)
        ld.set_epoch(0)
        got_two_again = batch_digests(ld)
    assert len(ref) == 100
    assert got_two == ref, "workers=2 gave other bytes than workers=1"
    assert got_two_again == ref, "a second pass over the same epoch gave other bytes"

    # the augmentation is not the identity, and another epoch augments differently
    images, _ = fmnist_test_ref
    with loader(two, **kw) as ld:
        changed = total = 0
        first = None
        for b in ld:
            i = b["index"].numpy()
            diff = (b["image"].numpy()[..., 0] != images[i]).reshape(len(i), -1).any(axis=1)
            changed += int(diff.sum())
            total += len(i)
            if first is None:
                first = (i.copy(), b["image"].numpy().copy())
        assert ld.epoch == 1
        second = next(iter(ld))
    assert total == N_TEST
    # P(unchanged) = 0.5 * 0.3 * 0.5 = 7.5% (minus symmetric images): far fewer than 50% are untouched
    assert changed > total // 2, f"only {changed} of {total} samples changed: is the pipeline applied?"
    assert not np.array_equal(second["index"].numpy(), first[0]) or not np.array_equal(
        second["image"].numpy(), first[1]
    )


# --- shuffle and epochs -----------------------------------------------------------------------


def test_shuffle_depends_on_seed_and_epoch_and_epochs_auto_advance(fmnist_server):
    def order(seed, epoch):
        with loader(fmnist_server, batch_size=1000, shuffle=True, seed=seed) as ld:
            ld.set_epoch(epoch)
            got = np.concatenate(epoch_indices(ld))
            assert ld.epoch == epoch + 1
            return got

    a = order(seed=5, epoch=0)
    assert np.array_equal(a, order(seed=5, epoch=0)), "same (seed, epoch) gave another order"
    b = order(seed=5, epoch=1)
    c = order(seed=6, epoch=0)
    assert not np.array_equal(a, b), "epochs 0 and 1 gave the same order"
    assert not np.array_equal(a, c), "seeds 5 and 6 gave the same order"
    for got, (seed, epoch) in ((a, (5, 0)), (b, (5, 1)), (c, (6, 0))):
        want = shard_indices(N_TEST, shuffle=True, seed=seed, epoch=epoch, rank=0, world_size=1, drop_last=False)
        np.testing.assert_array_equal(got, want)

    # a complete pass advances the epoch: passes 1, 2, 3 are epochs 0, 1, 2
    with loader(fmnist_server, batch_size=1000, shuffle=True, seed=5) as ld:
        assert ld.epoch == 0
        p0 = np.concatenate(epoch_indices(ld))
        assert ld.epoch == 1
        p1 = np.concatenate(epoch_indices(ld))
        assert ld.epoch == 2
        p2 = np.concatenate(epoch_indices(ld))
        assert ld.epoch == 3
    np.testing.assert_array_equal(p0, a)
    np.testing.assert_array_equal(p1, b)
    assert not np.array_equal(p2, p1) and not np.array_equal(p2, p0)


# --- drop_last, ranks -------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last, want", [(True, [300] * 33), (False, [300] * 33 + [100])])
def test_drop_last(fmnist_server, drop_last, want):
    with loader(fmnist_server, batch_size=300, shuffle=True, seed=2, drop_last=drop_last) as ld:
        sizes = [len(b) for b in epoch_indices(ld)]
        assert len(ld) == len(want)
    assert sizes == want


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_partition_the_epoch(fmnist_server, drop_last):
    world, bs = 3, 256
    per_rank, lengths = [], []
    for rank in range(world):
        with loader(fmnist_server, batch_size=bs, shuffle=True, seed=11, drop_last=drop_last,
                    rank=rank, world_size=world) as ld:
            batches = epoch_indices(ld)
            lengths.append((len(ld), len(batches)))
        got = np.concatenate(batches)
        want = shard_indices(N_TEST, shuffle=True, seed=11, epoch=0, rank=rank, world_size=world, drop_last=drop_last)
        if drop_last:
            want = want[: len(want) // bs * bs]
        np.testing.assert_array_equal(got, want)
        per_rank.append(got)
    assert len({n for pair in lengths for n in pair}) == 1, f"ranks got different batch counts: {lengths}"

    counts = collections.Counter(np.concatenate(per_rank).tolist())
    dupes = {i: c for i, c in counts.items() if c > 1}
    if drop_last:
        assert not dupes, f"duplicates with drop_last: {dupes}"
        # 3333 per rank, 13 full batches of 256 each
        assert lengths[0][0] == 13 and all(len(r) == 13 * 256 for r in per_rank)
    else:
        assert set(counts) == set(range(N_TEST)), "the ranks do not cover the dataset"
        # DistributedSampler pads 10000 -> 10002 by wrapping: the first two of the epoch order twice
        order = shard_indices(N_TEST, shuffle=True, seed=11, epoch=0, rank=0, world_size=1, drop_last=False)
        assert dupes == {int(order[0]): 2, int(order[1]): 2}
        for a in range(world):
            for b in range(a + 1, world):
                overlap = set(per_rank[a].tolist()) & set(per_rank[b].tolist())
                assert overlap <= set(dupes), f"ranks {a} and {b} share {overlap - set(dupes)}"


# --- errors -----------------------------------------------------------------------------------


def test_unknown_dataset(fmnist_server):
    with pytest.raises(batchd.DatasetNotFoundError, match="no-such-set") as e:
        loader(fmnist_server, dataset="no-such-set")
    assert isinstance(e.value, LookupError)


@pytest.mark.parametrize("kwargs, match", [
    (dict(batch_size=0), "batch_size"),
    (dict(rank=3, world_size=3), "rank"),
    (dict(rank=-1, world_size=2), "rank"),
])
def test_bad_arguments_fail_client_side(kwargs, match):
    # no server listens there: a ValueError proves the check happens before any connection
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ValueError, match=match):
        batchd.RemoteDataLoader(address, "fmnist-test", connect_timeout=2, **kwargs)


def test_unknown_preset(fmnist_server):
    with loader(fmnist_server, batch_size=8, transform="no-such-preset") as ld:
        with pytest.raises(ValueError, match="no-such-preset"):
            next(iter(ld))


def test_preset_is_applied(fmnist_server, fmnist_test_ref):
    images, _ = fmnist_test_ref
    with loader(fmnist_server, batch_size=500, transform="flip") as ld:
        flipped = 0
        for b in ld:
            i = b["index"].numpy()
            got = b["image"].numpy()[..., 0]
            same = (got == images[i]).reshape(len(i), -1).all(axis=1)
            mirrored = (got == images[i][:, :, ::-1]).reshape(len(i), -1).all(axis=1)
            assert (same | mirrored).all(), "the flip preset did something other than a horizontal flip"
            flipped += int((mirrored & ~same).sum())
    assert 3000 < flipped < 7000, f"{flipped} of 10000 flipped with p=0.5"


@pytest.mark.filterwarnings("ignore:Transform NoSuchTransform has no 'p' parameter")
def test_invalid_pipeline_is_a_value_error(fmnist_server):
    with loader(fmnist_server, batch_size=8, transform=A.HorizontalFlip(p=1.0)) as ld:
        ld.options.pipeline.albumentations_json = '{"transform": {"__class_fullname__": "NoSuchTransform"}}'
        with pytest.raises(ValueError, match="NoSuchTransform"):
            next(iter(ld))


@pytest.mark.timeout(30)  # connect_timeout=2: far less than this, whatever the machine's load
def test_no_server_is_a_connection_error():
    address = f"127.0.0.1:{free_port()}"
    with pytest.raises(ConnectionError, match=re.escape(address)):
        batchd.RemoteDataLoader(address, "fmnist-test", batch_size=4, connect_timeout=2)


def test_batch_size_above_server_limit(make_server, fmnist_root):
    server = make_server(workers=1, max_batch_size=64, datasets=fmnist_test_config(fmnist_root))
    with loader(server, batch_size=64) as ld:
        assert len(next(iter(ld))["index"]) == 64
    with loader(server, batch_size=65) as ld:  # the client does not know the server's limit
        with pytest.raises(ValueError, match="64"):
            next(iter(ld))


# --- bad samples ------------------------------------------------------------------------------


def test_undecodable_image_is_a_sample_error(make_server, tmp_path):
    rng = np.random.default_rng(0)
    root = tmp_path / "folder"
    write_png(root / "ant" / "a0.png", rand_rgb(rng, 8, 8))
    write_png(root / "ant" / "a1.png", rand_rgb(rng, 8, 8))
    (root / "cat").mkdir()
    (root / "cat" / "bad.jpg").write_bytes(rng.integers(0, 256, 500, dtype=np.uint8).tobytes())  # index 2
    write_png(root / "cat" / "c0.png", rand_rgb(rng, 8, 8))  # index 3
    server = make_server(workers=1, datasets={"pets": {"kind": "imagefolder", "root": str(root)}})

    delivered = []
    with loader(server, dataset="pets", batch_size=2) as ld:
        with pytest.raises(batchd.SampleError) as e:
            for b in ld:
                delivered.append(b["index"].tolist())
    assert delivered == [[0, 1]], "the batch before the bad one was not delivered"
    err = e.value
    assert (err.dataset, err.index, err.path) == ("pets", 2, "cat/bad.jpg")
    assert err.reason
    for part in ("pets", "2", "cat/bad.jpg"):
        assert part in str(err), f"{part!r} not in {str(err)!r}"


def test_pipeline_exception_names_dataset_and_sample(fmnist_server):
    with loader(fmnist_server, batch_size=16, transform=A.RandomCrop(height=100, width=100)) as ld:
        with pytest.raises((ValueError, batchd.WorkerError)) as e:
            next(iter(ld))
    msg = str(e.value)
    assert "fmnist-test" in msg, msg
    assert re.search(r"sample 0\b", msg), msg
    # the server is fine afterwards
    with loader(fmnist_server, batch_size=1000) as ld:
        assert np.array_equal(np.concatenate(epoch_indices(ld)), np.arange(N_TEST))


# --- stream lifecycle -------------------------------------------------------------------------


def test_break_early_then_full_epoch_and_streams_released(fmnist_server):
    ld = loader(fmnist_server, batch_size=100, shuffle=True, seed=9)
    try:
        for i, _ in enumerate(ld):
            if i == 1:
                break
        assert ld.epoch == 0, "an abandoned pass advanced the epoch"
        got = np.concatenate(epoch_indices(ld))
        np.testing.assert_array_equal(
            got, shard_indices(N_TEST, shuffle=True, seed=9, epoch=0, rank=0, world_size=1, drop_last=False)
        )
        assert ld.epoch == 1
        it = iter(ld)
        next(it)  # a stream left open
        assert fmnist_server.loader.streams, "the server has no stream for an iteration in progress"
    finally:
        ld.close()
    assert wait_until(lambda: not fmnist_server.loader.streams, 10.0), (
        f"streams still open after close: {list(fmnist_server.loader.streams)}"
    )


def test_list_datasets(fmnist_server):
    infos = {d.name: d for d in batchd.list_datasets(fmnist_server.address, timeout=10)}
    assert set(infos) == {"fmnist-train", "fmnist-test"}
    assert infos["fmnist-train"].num_samples == 60_000
    assert infos["fmnist-test"].num_samples == 10_000
    for d in infos.values():
        assert d.kind == "fashion-mnist"
        assert len(d.classes) == 10 and len(set(d.classes)) == 10
        assert d.sample_shape == (28, 28, 1)
        assert d.sample_dtype == "uint8"


# --- worker death -----------------------------------------------------------------------------


def test_killed_worker_epoch_still_complete_and_identical(make_server, fmnist_root):
    server = make_server(workers=2, datasets=fmnist_test_config(fmnist_root))
    slow = A.Compose([A.Resize(32, 32), A.Affine(rotate=(-20, 20), p=1.0)])  # random, and work enough to queue
    # inline: the client's grants are not held to a shared-memory session's lease cap, so a worker
    # soon holds two tasks
    kw = dict(batch_size=20, shuffle=True, seed=4, transform=slow, prefetch=8, transport="inline")
    with loader(server, **kw) as ld:
        clean = batch_digests(ld)
    assert server.loader.pool.restarts == 0

    pool = server.loader.pool
    killed = []
    armed, stop = threading.Event(), threading.Event()

    def kill_a_worker_holding_two():
        # a worker holding two tasks: one running, one queued behind it that it cannot have finished
        # yet, so at least one batch must be rebuilt on another worker. Watched while the loop keeps
        # reading: a loop that waited here would stop granting, and the workers would drain.
        armed.wait()
        while not stop.is_set():
            try:
                pid = next((w.process.pid for w in list(pool._workers.values()) if len(w.tasks) >= 2), None)
            except RuntimeError:  # the scheduler changed the dict while it was copied
                continue
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.0005)

    watcher = threading.Thread(target=kill_a_worker_holding_two, daemon=True)
    watcher.start()
    digests, indices = [], []
    try:
        with loader(server, **kw) as ld:
            for i, b in enumerate(ld):
                digests.append(batch_digest(b))
                indices.append(b["index"].numpy().copy())
                if i == 3:
                    armed.set()
    finally:
        armed.set()
        stop.set()
        watcher.join(5)
    assert killed, "no worker held two batches while the epoch ran"
    assert len(digests) == len(clean) == 500
    got = np.concatenate(indices)
    assert (np.bincount(got, minlength=N_TEST) == 1).all()
    assert digests == clean, "batches after a worker death differ from a clean run"
    assert pool.restarts == 1
    assert pool.batches_rebuilt >= 1, "the killed worker held a queued batch, yet none was rebuilt"
    assert killed[0] not in pool.worker_pids and len(pool.worker_pids) == 2
