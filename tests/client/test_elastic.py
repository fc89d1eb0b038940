"""Elastic resume (issue 20 §1): a state saved at one world size and batch size continues the same
epoch at others, every remaining sample once, each with the bytes the uninterrupted run gave it.

The sampler part is checked exhaustively on small cases; the loader part through a real server
over a real image folder with random augmentations, sample by sample.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import json

import albumentations as A
import numpy as np
import pytest
from torch.utils.data import DistributedSampler

import batchd
from batchd.client.iteration import elastic
from batchd.sampler import epoch_order, global_positions, num_batches, shard_indices, shard_size
from helpers import write_png

pytestmark = pytest.mark.timeout(120)

N = 203  # not a multiple of any world size used: the padding is exercised
AUG = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-30, 30), p=0.8), A.RandomBrightnessContrast(p=0.8)])
KW = dict(shuffle=True, seed=5, transform=AUG, transport="inline", connect_timeout=10, timeout=60)


# --- the sampler: the remainder of an epoch, sharded again ---------------------------------------------


def served(n, world_size, batch_size, drop_last, start_position=0, steps=None):
    """{global position: sample index} that ``steps`` steps (all, if None) of every rank read."""
    out = {}
    total = num_batches(n, batch_size, world_size=world_size, drop_last=drop_last, start_position=start_position)
    steps = total if steps is None else steps
    for rank in range(world_size):
        take = min(shard_size(n, world_size, drop_last, start_position), steps * batch_size)
        idx = shard_indices(n, shuffle=True, seed=3, epoch=1, rank=rank, world_size=world_size, drop_last=drop_last,
                            start_position=start_position)[:take]
        pos = global_positions(0, take, rank=rank, world_size=world_size, start_position=start_position)
        for p, i in zip(pos.tolist(), idx.tolist()):
            assert p not in out, f"position {p} served twice"
            out[p] = i
    return out


@pytest.mark.parametrize("drop_last", [False, True])
def test_the_remainder_is_served_once_at_any_world_size_and_batch_size(drop_last):
    order = epoch_order(N, shuffle=True, seed=3, epoch=1)
    cases = 0
    for (w, b), (w2, b2) in itertools.product([(4, 8), (3, 5), (1, 7)], [(3, 8), (2, 16), (6, 4), (1, 7), (5, 3)]):
        for k in range(num_batches(N, b, world_size=w, drop_last=drop_last)):
            first = served(N, w, b, drop_last, steps=k)
            at = elastic.resume_from({"version": 2, "epoch": 1, "next_batch": k, "start_position": 0, "batch_size": b,
                                      "world_size": w}, num_samples=N, batch_size=b2, world_size=w2,
                                     drop_last=drop_last)
            rest = {}
            if at.epoch == 1:  # batches next_batch.. of the reading from start_position (same topology: batch k)
                skipped = served(N, w2, b2, drop_last, at.start_position, steps=at.next_batch)
                rest = {p: i for p, i in served(N, w2, b2, drop_last, at.start_position).items() if p not in skipped}
            assert not first.keys() & rest.keys()
            every = {**first, **rest}
            # a position always holds the same sample: order[p % N] (padding >= N wraps to the start)
            assert all(i == order[p % N] for p, i in every.items())
            real = sorted(p for p in every if p < N)
            if not drop_last:
                assert real == list(range(N)), (w, b, k, w2, b2)
                assert at.start_position + at.next_batch * b * w == k * b * w and all(p < N + w2 for p in every)
            else:  # the cut: fewer samples than one step of the new ranks are left out, at the end
                assert real == list(range(len(real))) and N - len(real) < w2 * b2
            cases += 1
    assert cases == 250 if not drop_last else cases > 200


def test_from_position_zero_the_rule_is_distributed_samplers():
    """start_position 0 is DistributedSampler (tests/client/test_sampler_oracle.py); from P > 0 the
    remainder is DistributedSampler over order[P:] for its real samples."""
    order = epoch_order(N, shuffle=True, seed=3, epoch=1)
    for start, w, drop_last in itertools.product((0, 32, 96, 200), (1, 3, 6), (False, True)):
        rest = order[start:].tolist()
        for rank in range(w):
            got = shard_indices(N, shuffle=True, seed=3, epoch=1, rank=rank, world_size=w, drop_last=drop_last,
                                start_position=start).tolist()
            want = [rest[i] for i in DistributedSampler(rest, num_replicas=w, rank=rank, shuffle=False,
                                                        drop_last=drop_last)]
            m = len(rest)
            real = shard_size(N, w, True, start) if drop_last else -(-(m - rank) // w)
            assert got[:real] == want[:real], (start, w, rank, drop_last)
            assert len(got) == len(want)  # padded (or cut) to as many per rank


def test_resume_from_checks_the_position():
    state = {"version": 2, "epoch": 0, "next_batch": 3, "start_position": 0, "batch_size": 8, "world_size": 4}
    assert elastic.resume_from(state, num_samples=N, batch_size=8, world_size=4, drop_last=False) == elastic.Resume(0, 0, 3)
    assert elastic.resume_from(state, num_samples=N, batch_size=8, world_size=3, drop_last=False) == elastic.Resume(0, 96, 0)
    v1 = {k: v for k, v in state.items() if k != "start_position"} | {"version": 1}
    assert elastic.resume_from(v1, num_samples=N, batch_size=4, world_size=6, drop_last=False) == elastic.Resume(0, 96, 0)
    done = dict(state, next_batch=7)  # 7 = len at W=4, B=8: the epoch is over
    assert elastic.resume_from(done, num_samples=N, batch_size=5, world_size=2, drop_last=False) == elastic.Resume(1, 0, 0)
    # drop_last: less than one step of the new ranks is left, so the epoch is over
    late = dict(state, next_batch=6)  # position 192, 11 samples left
    assert elastic.resume_from(late, num_samples=N, batch_size=8, world_size=2, drop_last=True) == elastic.Resume(1, 0, 0)
    for bad in (dict(state, next_batch=8), dict(state, next_batch=-1), dict(state, start_position=N),
                dict(state, epoch="1"), dict(state, batch_size=0)):
        with pytest.raises(ValueError, match="invalid position"):
            elastic.resume_from(bad, num_samples=N, batch_size=8, world_size=4, drop_last=False)


# --- through a server -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pics(tmp_path_factory):
    """The image folder of N random PNGs both servers serve."""
    root = tmp_path_factory.mktemp("elastic")
    rng = np.random.default_rng(0)
    for i in range(N):
        write_png(root / f"c{i % 3}" / f"{i:03d}.png", rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
    return root


def _serve(pics, tmp_path_factory):
    from conftest import running_server

    return running_server(workers=2, cache_dir=tmp_path_factory.mktemp("elastic-cache"),
                          datasets={"pics": {"kind": "imagefolder", "root": str(pics)}},
                          pipelines={"aug": A.to_dict(AUG)})


@pytest.fixture(scope="module")
def server(pics, tmp_path_factory):
    with _serve(pics, tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def second_server(pics, tmp_path_factory):
    with _serve(pics, tmp_path_factory) as s:
        yield s


@pytest.fixture(scope="module")
def reference(server):
    """{position: (index, digest)} of the uninterrupted W=4, B=8 epoch 0 (every rank). A sample's
    bytes do not depend on drop_last, so it is the reference of both."""
    out = {}
    for rank in range(4):
        with loader(server, 4, rank, 8) as ld:
            for p, i, h in samples(ld):
                assert p not in out
                out[p] = (i, h)
    assert len(out) == 4 * 51
    return out


def samples(ld, steps=None):
    """[(position, index, sha256 of the sample's image)] of the next ``steps`` batches (all if None)."""
    out = []
    for step, batch in enumerate(ld):
        for p, i, image in zip(batch["position"].tolist(), batch["index"].tolist(), batch["image"]):
            out.append((p, i, hashlib.sha256(image.numpy().tobytes()).hexdigest()))
        if steps is not None and step + 1 == steps:
            break
    return out


def loader(server, world_size, rank, batch_size, **kw):
    return batchd.RemoteDataLoader(server.address, "pics", world_size=world_size, rank=rank, batch_size=batch_size,
                                   **{**KW, **kw})


@pytest.mark.parametrize("drop_last", [False, True])
def test_resume_at_another_world_size_and_batch_size(server, reference, drop_last):
    """W=4, B=8 for k steps, then (3, 8), (2, 16), (6, 4), (1, 7) from rank 0's state: the epoch's
    samples once, each with the bytes of the uninterrupted W=4 run."""
    k = 3
    first = {p: v for p, v in reference.items() if (p // 4) < k * 8}  # what k steps of every rank read
    with loader(server, 4, 0, 8, drop_last=drop_last) as ld:
        assert [(p, i, h) for p, i, h in samples(ld, k)] == [(p, *reference[p]) for p in range(0, 4 * 8 * k, 4)]
        state = json.loads(json.dumps(ld.state_dict()))
    assert (state["version"], state["next_batch"], state["position"]) == (2, k, k * 8 * 4)

    order = epoch_order(N, shuffle=True, seed=KW["seed"], epoch=0)
    for world, batch_size in ((3, 8), (2, 16), (6, 4), (1, 7)):
        rest: dict[int, tuple[int, str]] = {}
        lengths = []
        for rank in range(world):
            with loader(server, world, rank, batch_size, drop_last=drop_last) as ld:
                ld.load_state_dict(state)  # every new rank loads rank 0's state
                lengths.append(len(ld))
                got = samples(ld)
                assert ld.epoch == 1
                assert len(got) <= len(ld) * batch_size
            for p, i, h in got:
                assert p not in rest and p not in first, f"position {p} served twice (W={world}, B={batch_size})"
                rest[p] = (i, h)
        assert len(set(lengths)) == 1, lengths  # every rank steps together
        every = {**first, **rest}
        real = sorted(p for p in every if p < N)
        if drop_last:  # fewer samples than one step of the new ranks are left out, at the end
            assert real == list(range(len(real))) and N - len(real) < world * batch_size
        else:
            assert real == list(range(N)), f"W={world}, B={batch_size}: not every sample once"
        for p, (i, h) in rest.items():
            assert i == order[p % N], f"position {p} holds sample {i}, not {order[p % N]}"
            if p in reference:  # every real sample, and the padding the W=4 run also had
                assert (i, h) == reference[p], f"W={world}, B={batch_size}: sample {i} (position {p}) differs"
    # the augmentation is random: the same image under two positions differs
    assert len({h for _, h in reference.values()}) == len(reference)


def test_resume_at_another_world_size_over_two_servers(server, second_server, reference):
    """W=4, B=8 for 3 steps on one server, then W=3, B=8 and W=2, B=16 over two servers (each
    batch built by whichever has room): the epoch's samples once each, with the bytes of the
    uninterrupted one-server run, and both servers built some of them."""
    k = 3
    first = {p for p in reference if (p // 4) < k * 8}
    with loader(server, 4, 0, 8) as ld:
        samples(ld, k)
        state = json.loads(json.dumps(ld.state_dict()))
    pools = [s.loader.pool for s in (server, second_server)]
    built = [p.batches_built for p in pools]
    for world, batch_size in ((3, 8), (2, 16)):
        rest: dict[int, tuple[int, str]] = {}
        for rank in range(world):
            with batchd.RemoteDataLoader([server.address, second_server.address], "pics", world_size=world,
                                         rank=rank, batch_size=batch_size, **KW) as ld:
                ld.load_state_dict(state)
                for p, i, h in samples(ld):
                    assert p not in rest and p not in first, f"position {p} served twice (W={world}, B={batch_size})"
                    rest[p] = (i, h)
        assert sorted(p for p in {*first, *rest} if p < N) == list(range(N)), f"W={world}: not every sample once"
        for p, (i, h) in rest.items():
            if p in reference:
                assert (i, h) == reference[p], f"W={world}, B={batch_size}: sample {i} (position {p}) differs"
    assert all(p.batches_built > b for p, b in zip(pools, built)), "a server built none of the resumed batches"


def test_a_resumed_epoch_resumes_again_and_a_version_1_state_loads(server, reference):
    """Chained: W=4 for 2 steps -> W=3 for 2 steps -> W=2 to the end; and a version-1 state."""
    with loader(server, 4, 0, 8) as ld:
        samples(ld, 2)
        state = ld.state_dict()
    seen = {p for p in reference if p // 4 < 16}
    mid = None
    for rank in range(3):
        with loader(server, 3, rank, 8) as ld:
            ld.load_state_dict(state)
            got = samples(ld, 2)
            assert all(reference[p] == (i, h) for p, i, h in got)
            seen |= {p for p, _, _ in got}
            if rank == 0:
                mid = ld.state_dict()
    assert (mid["start_position"], mid["next_batch"], mid["position"]) == (64, 2, 64 + 48)
    for rank in range(2):
        with loader(server, 2, rank, 8) as ld:
            ld.load_state_dict(mid)
            got = samples(ld)
            assert all(reference[p] == (i, h) for p, i, h in got if p in reference)
            assert not seen & {p for p, _, _ in got}
            seen |= {p for p, _, _ in got}
    assert set(range(N)) <= seen

    v1 = {k: v for k, v in state.items() if k not in ("start_position", "position")} | {"version": 1}
    with loader(server, 2, 1, 5) as ld:
        ld.load_state_dict(v1)
        assert len(ld) == num_batches(N, 5, world_size=2, start_position=64)
        got = samples(ld, 1)
        assert [p for p, _, _ in got] == [65, 67, 69, 71, 73]
        assert all(reference[p] == (i, h) for p, i, h in got)
    with loader(server, 2, 1, 5, seed=6) as ld, pytest.raises(ValueError, match="seed"):
        ld.load_state_dict(v1)  # only world_size, rank and batch_size may change


def test_a_resumed_stream_is_shared_only_with_the_same_remainder(server):
    base = dict(dataset="pics", batch_size=4, shuffle=True, seed=1, world_size=2)
    from batchd.server.compute.protocol import StreamRequest

    streams = [server.loader.open_stream(StreamRequest(**base, start_position=p)) for p in (40, 40, 0, 44)]
    try:
        a, same, whole, other = streams
        assert same.computation is a.computation
        assert whole.computation is not a.computation and other.computation is not a.computation
        assert a.num_batches == num_batches(N, 4, world_size=2, start_position=40)
        with pytest.raises(ValueError, match="start_position 203 is past"):
            server.loader.open_stream(StreamRequest(**base, start_position=N))
    finally:
        for s in streams:
            server.loader.close_stream(s, "cancelled by the test")


# --- the example: torchrun on the CPU, 4 processes then 3 ------------------------------------------


@pytest.mark.slow
def test_elastic_resume_example_with_torchrun(server, tmp_path):
    """examples/elastic_resume.py: 4 gloo processes train 3 steps and checkpoint, then 3 resume
    the epoch from rank 0's checkpoint; together they read every sample once."""
    import pathlib
    import subprocess
    import sys

    example = pathlib.Path(__file__).resolve().parents[2] / "examples" / "elastic_resume.py"
    ckpt = tmp_path / "ckpt.pt"

    def torchrun(nproc, *args):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(example), "--address", server.address, "--dataset", "pics", "--transform", "aug",
               "--batch-size", "8",
               "--checkpoint", str(ckpt), *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, stdin=subprocess.DEVNULL,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "NO_ALBUMENTATIONS_UPDATE": "1"})
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    torchrun(4, "--steps", "3", "--record", str(tmp_path / "first"))
    assert ckpt.exists()
    out = torchrun(3, "--resume", "--record", str(tmp_path / "second"))
    assert out.count("loader at epoch 1, position 0") == 3, out
    runs = {}
    for name, world in (("first", 4), ("second", 3)):
        records = [json.loads((tmp_path / name / f"{r}.json").read_text()) for r in range(world)]
        assert all(r["world_size"] == world for r in records)
        runs[name] = [tuple(pair) for r in records for pair in r["seen"]]
    assert len(runs["first"]) == 4 * 3 * 8
    order = epoch_order(N, shuffle=True, seed=0, epoch=0)
    every = runs["first"] + runs["second"]
    assert all(index == order[p % N] for p, index in every)
    real = sorted(p for p, _ in every if p < N)
    assert real == list(range(N)), "not every sample once across the two jobs"
