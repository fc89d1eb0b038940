"""Batches carry each sample's global position; workers read samples concurrently; a worker
killed for a task timeout is reaped before its slot is used again.

Real servers on 127.0.0.1:0 over a small image folder of PNGs (each image's colour encodes its
index, so a wrong byte or a wrong order shows).
"""

from __future__ import annotations

import albumentations as A
import numpy as np
import pytest
from helpers import digest, write_png

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
