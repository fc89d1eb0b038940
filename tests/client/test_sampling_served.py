"""Weighted and mixed epochs through real servers (issue 39): every promise of a plain epoch.

The draws a server serves are docs/sampling.md's formulas, taken from the page itself (not from
batchd.sampler); ranks split them as DistributedSampler splits an order; state_dict resumes them
at another world size and batch size with the same bytes per position; two servers, one of them
stalled (its batches regranted to the other), give one server's bytes; identical loaders share one
computation and other weights do not; a sample drawn twice gets two augmentations and one decode; weights travel once per loader
and again when a server dropped them; weights the server owns (a manifest's weight_column, a
python dataset's weights) are drawn by; bad requests are refused before anything starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import pathlib
import re
import signal
import threading
import time

import albumentations as A
import grpc
import numpy as np
import pytest
from torch.utils.data import DistributedSampler

import batchd
from batchd.server.serve.stats import snapshot
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import write_png
from rawclient import RawBatches

pytestmark = pytest.mark.timeout(300)

ROOT = pathlib.Path(__file__).resolve().parents[2]
PYDATA = ROOT / "tests" / "pydata"
AUG = A.Compose([A.Affine(rotate=(-30, 30), p=1.0), A.RandomBrightnessContrast(p=1.0)])
N_FM, N_FM2, N_BIG = 10_000, 60_000, 1_000_000
PETS_WEIGHTS = [1.0, 0.0, 2.0, 0.5, 3.0, 0.0, 1.0, 1.0, 4.0, 0.25, 1.0, 2.0]


def reference() -> dict:
    """docs/sampling.md's formulas, executed from the page's own code block."""
    page = (ROOT / "docs" / "sampling.md").read_text()
    code = next(m.group(1) for m in re.finditer(r"```python\n(.*?)```", page, re.S) if "def reference_weighted_draw" in m.group(1))
    namespace: dict = {}
    exec(compile(code, "docs/sampling.md", "exec"), namespace)  # noqa: S102
    return namespace


REF = reference()


def datasets(fmnist_root, pets: pathlib.Path) -> dict:
    return {
        "fm": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"},
        "fm2": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "train"},
        "rng": {"kind": "python", "factory": "batchd_testdata:RngFlips", "args": {"n": 50}},
        "big": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": N_BIG}},
        "own": {"kind": "python", "factory": "batchd_testdata:WeightedPaced", "args": {"n": 50}},
        "pets": {"kind": "manifest", "path": str(pets), "weight_column": "weight"},
    }


@pytest.fixture(scope="module")
def pets(tmp_path_factory) -> pathlib.Path:
    """A manifest of 12 small PNGs with a weight column (PETS_WEIGHTS)."""
    root = tmp_path_factory.mktemp("pets")
    rng = np.random.default_rng(0)
    rows = ["path,label,weight"]
    for i, w in enumerate(PETS_WEIGHTS):
        write_png(root / f"{i:02d}.png", rng.integers(0, 256, (6, 6, 3), dtype=np.uint8))
        rows.append(f"{i:02d}.png,{'cat' if i % 3 else 'dog'},{w}")
    (root / "pets.csv").write_text("\n".join(rows) + "\n")
    return root / "pets.csv"


@pytest.fixture(scope="module")
def servers(fmnist_root, pets, tmp_path_factory):
    """Two servers of the same datasets, with a decoded-sample cache (2 workers; 1 worker)."""
    from conftest import running_server

    cache = tmp_path_factory.mktemp("sampling-cache")
    common = dict(python_path=[str(PYDATA)], cache_dir=cache, datasets=datasets(fmnist_root, pets),
                  cache={"memory_bytes": "64MiB"})
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(workers=2, **common)),
               stack.enter_context(running_server(workers=1, **common))]


@pytest.fixture(scope="module")
def srv(servers):
    return servers[0]


def weights_for(n: int, seed: int = 0) -> np.ndarray:
    w = np.random.default_rng(seed).uniform(0.0, 3.0, n)
    w[np.random.default_rng(seed + 1).random(n) < 0.3] = 0.0  # zero weights too
    return w


def epoch_of(loader, epoch: int | None = None) -> dict:
    """One epoch's fields, concatenated: index, position, source (if any), and per-sample image digests."""
    if epoch is not None:
        loader.set_epoch(epoch)
    out: dict = {"index": [], "position": [], "source": [], "image": []}
    for batch in loader:
        out["index"].append(batch["index"].numpy().copy())
        out["position"].append(batch["position"].numpy().copy())
        if "source" in batch:
            out["source"].append(batch["source"].numpy().copy())
        out["image"] += [hashlib.sha256(img.numpy().tobytes()).hexdigest() for img in batch["image"]]
    return {k: (np.concatenate(v) if v and k != "image" else v) for k, v in out.items()}


# --- the draws are the documented formulas -------------------------------------------------------------


@pytest.mark.parametrize("replacement", [True, False])
def test_served_weighted_epochs_are_the_documented_draw(srv, replacement):
    w = weights_for(N_FM)
    sampler = batchd.WeightedRandomSampler(w, num_samples=300, replacement=replacement)
    with batchd.RemoteDataLoader(srv.address, "fm", batch_size=64, sampler=sampler, seed=3) as ld:
        assert len(ld) == 5
        for epoch in (0, 1):
            got = epoch_of(ld, epoch)
            expected = REF["reference_weighted_draw"](w, 300, replacement, seed=3, epoch=epoch)
            assert np.array_equal(got["position"], np.arange(300))
            assert np.array_equal(got["index"], expected), f"epoch {epoch}: not docs/sampling.md's draw"
            assert (w[got["index"]] > 0).all()
            if not replacement:
                assert len(np.unique(got["index"])) == 300


def test_served_mix_is_the_documented_draw(srv):
    mix = batchd.Mix({"fm": 1.0, "fm2": 2.0}, num_samples=300)
    with batchd.RemoteDataLoader(srv.address, mix, batch_size=64, seed=4) as ld:
        assert ld.info.kind == "mix" and [s.name for s in ld.info.sources] == ["fm", "fm2"]
        assert [s.num_samples for s in ld.info.sources] == [N_FM, N_FM2] and len(ld) == 5
        for epoch in (0, 1):
            got = epoch_of(ld, epoch)
            source, index = REF["reference_mix_draw"]([N_FM, N_FM2], [1.0, 2.0], 300, seed=4, epoch=epoch)
            assert np.array_equal(got["source"], source) and np.array_equal(got["index"], index)


def test_a_mix_takes_a_pipeline_per_source_and_names_sources_that_do_not_collate(srv):
    rgb = A.Compose([A.Resize(28, 28), A.ToGray(num_output_channels=1, p=1.0)])
    mix = batchd.Mix({"fm": 1.0, "pets": 1.0}, num_samples=40)
    with batchd.RemoteDataLoader(srv.address, mix, batch_size=20, transform={"pets": rgb}) as ld:
        batch = next(iter(ld))
        assert tuple(batch["image"].shape) == (20, 28, 28, 1) and set(batch["source"].tolist()) == {0, 1}
    with batchd.RemoteDataLoader(srv.address, mix, batch_size=20) as ld:  # 28x28x1 and 6x6x3: a list, not an error
        batch = next(iter(ld))
        assert isinstance(batch["image"], list)
    with pytest.raises(ValueError, match="not a source of the mix"):
        batchd.RemoteDataLoader(srv.address, mix, transform={"photos": rgb})


# --- ranks, resume ------------------------------------------------------------------------------------


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("kind", ["weighted", "mix"])
def test_ranks_split_the_draw_as_distributed_sampler_splits_an_order(srv, kind, drop_last):
    n, world = 100, 3
    if kind == "weighted":
        w = weights_for(N_FM, 5)
        args = ("fm",), dict(sampler=batchd.WeightedRandomSampler(w, n))
        draw = REF["reference_weighted_draw"](w, n, True, seed=9, epoch=0)
    else:
        args = (batchd.Mix({"fm": 3.0, "fm2": 1.0}, num_samples=n),), {}
        source, index = REF["reference_mix_draw"]([N_FM, N_FM2], [3.0, 1.0], n, seed=9, epoch=0)
        draw = source * 1_000_000 + index
    covered = []
    for rank in range(world):
        with batchd.RemoteDataLoader(srv.address, *args[0], batch_size=7, seed=9, rank=rank, world_size=world,
                                     drop_last=drop_last, **args[1]) as ld:
            got = epoch_of(ld)
        theirs = list(DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=False, drop_last=drop_last))
        if drop_last:  # DataLoader then drops the last partial batch too
            theirs = theirs[: len(theirs) // 7 * 7]
        assert np.array_equal(got["position"] % n, theirs), f"rank {rank}: other positions than DistributedSampler's"
        served = got["index"] if kind == "weighted" else got["source"] * 1_000_000 + got["index"]
        assert np.array_equal(served, draw[theirs])
        covered += got["position"].tolist()
    if not drop_last:  # the union of the ranks is the world_size-1 draw (padded by wrapping)
        assert sorted(p % n for p in covered if p < n) == list(range(n))


@pytest.mark.parametrize("kind", ["weighted", "mix"])
def test_state_dict_resumes_exactly_also_at_another_world_size_and_batch_size(srv, kind):
    n = 90
    if kind == "weighted":
        first, kw = "fm", dict(sampler=batchd.WeightedRandomSampler(weights_for(N_FM, 2), n))
    else:
        first, kw = batchd.Mix({"fm": 1.0, "fm2": 1.0}, num_samples=n), {}
    kw.update(seed=6, transform=AUG)

    def per_position(world, batch, state=None, steps=None) -> tuple[dict, list]:
        out, states = {}, []
        for rank in range(world):
            with batchd.RemoteDataLoader(srv.address, first, batch_size=batch, rank=rank, world_size=world, **kw) as ld:
                if state is not None:
                    ld.load_state_dict(state)
                for step, b in enumerate(ld):
                    for k, p in enumerate(b["position"].tolist()):
                        if p < n:
                            src = b["source"][k].item() if "source" in b else -1
                            assert p not in out, f"position {p} served twice"
                            out[p] = (src, b["index"][k].item(), b["image"][k].numpy().tobytes())
                    if steps is not None and step + 1 == steps:
                        break
                states.append(ld.state_dict())
        return out, states

    whole, _ = per_position(2, 8)
    assert sorted(whole) == list(range(n))
    head, states = per_position(2, 8, steps=3)
    assert states[0]["position"] == 3 * 8 * 2 and states[0]["sampler" if kind == "weighted" else "mix"]
    same, _ = per_position(2, 8, state=states[0])  # the same topology: the saved batch comes next
    tail, _ = per_position(3, 5, state=states[0])  # another: the remainder from the position reached
    for rest in (same, tail):
        assert not (head.keys() & rest.keys()) and sorted(head.keys() | rest.keys()) == list(range(n))
        merged = {**head, **rest}
        assert all(merged[p] == whole[p] for p in range(n)), "a position got other bytes after the resume"
    other = dict(kw)
    if kind == "weighted":
        other["sampler"] = batchd.WeightedRandomSampler(weights_for(N_FM, 3), n)
    else:
        first = batchd.Mix({"fm": 2.0, "fm2": 1.0}, num_samples=n)
    with batchd.RemoteDataLoader(srv.address, first, batch_size=8, **other) as ld:
        with pytest.raises(ValueError, match="sampler|mix|dataset"):
            ld.load_state_dict(states[0])


# --- a sample drawn twice ------------------------------------------------------------------------------


def test_a_sample_drawn_twice_gets_two_augmentations_and_one_decode(srv):
    """By construction: every draw is sample 5 (one non-zero weight)."""
    w = np.zeros(N_FM)
    w[5] = 1.0
    before = {c.dataset: c for c in snapshot(srv.loader).cache}["fm"]
    with batchd.RemoteDataLoader(srv.address, "fm", batch_size=16, sampler=batchd.WeightedRandomSampler(w, 32),
                                 transform=AUG, seed=1) as ld:
        got = epoch_of(ld)
    assert (got["index"] == 5).all() and len(got["image"]) == 32
    assert len(set(got["image"])) == 32, "a sample drawn twice got the same augmentation"
    after = {c.dataset: c for c in snapshot(srv.loader).cache}["fm"]
    misses, hits = after.misses - before.misses, after.hits - before.hits
    assert misses <= 2 and hits >= 30, (misses, hits)  # decoded once per worker at most, then served by the cache


def test_a_python_datasets_own_randomness_is_keyed_by_position_in_a_drawn_epoch(srv):
    """RngFlips draws two flips from its rng in __getitem__: 32 copies of sample 7 do not all agree
    (they would, keyed by the index: probability 4 * 4**-32 that they agree by chance)."""
    w = np.zeros(50)
    w[7] = 1.0
    with batchd.RemoteDataLoader(srv.address, "rng", batch_size=16, sampler=batchd.WeightedRandomSampler(w, 32),
                                 seed=2) as ld:
        flips = np.concatenate([b["flips"].numpy() for b in ld])
    assert len({tuple(f) for f in flips.tolist()}) > 1
    with batchd.RemoteDataLoader(srv.address, "rng", batch_size=50, seed=2) as ld:  # a plain epoch: as before
        plain = next(iter(ld))
    from batchd.server.data.datasets._keyed import sample_rng
    from batchd.sampler import sample_key

    rng = sample_rng(sample_key(seed=2, epoch=0), 7)
    assert plain["flips"][7].tolist() == [rng.random() < 0.5, rng.random() < 0.5]


# --- several servers, a stalled one, sharing ------------------------------------------------------------------


def test_two_servers_and_a_stalled_one_give_the_bytes_of_one(servers):
    addresses = [s.address for s in servers]
    w = weights_for(N_FM, 7)
    kw = dict(batch_size=8, seed=5, transform=AUG, timeout=60, probe_interval=60)
    sampler = batchd.WeightedRandomSampler(w, 400)
    with batchd.RemoteDataLoader(addresses[0], "fm", sampler=sampler, **kw) as ld:
        one = epoch_of(ld)
    [worker] = servers[1].loader.pool.worker_pids
    resume = threading.Timer(3.0, os.kill, (worker, signal.SIGCONT))
    try:
        with batchd.RemoteDataLoader(addresses, "fm", sampler=sampler, **kw) as ld:
            out: dict = {"index": [], "image": []}
            os.kill(worker, signal.SIGSTOP)  # server 1 builds nothing for 3 s: stalled, its batches go to server 0
            resume.start()
            for batch in ld:
                out["index"].append(batch["index"].numpy().copy())
                out["image"] += [hashlib.sha256(img.numpy().tobytes()).hexdigest() for img in batch["image"]]
                time.sleep(0.01)
            stats = ld.stats()
    finally:
        resume.cancel()
        os.kill(worker, signal.SIGCONT)
    assert np.array_equal(np.concatenate(out["index"]), one["index"]) and out["image"] == one["image"]
    assert stats["stalls"] >= 1, stats
    mix = batchd.Mix({"fm": 1.0, "fm2": 1.0, "rng": 0.0}, num_samples=200)
    kw["transform"] = {"fm": AUG, "fm2": AUG}
    with batchd.RemoteDataLoader(addresses[0], mix, **kw) as ld:
        alone = epoch_of(ld)
    with batchd.RemoteDataLoader(addresses, mix, **kw) as ld:
        both = epoch_of(ld)
        assert sum(s["batches"] > 0 for s in ld.server_stats()) == 2
    assert all(np.array_equal(alone[k], both[k]) for k in ("index", "source")) and alone["image"] == both["image"]


def test_identical_loaders_are_computed_once_other_weights_are_not(srv):
    loader = srv.loader
    w = weights_for(N_FM, 11)
    other = w.copy()
    other[[0, 1]] = other[[1, 0]] + 1.0  # two weights differ: another digest, another computation
    specs = [("fm", batchd.WeightedRandomSampler(w, 400)), ("fm", batchd.WeightedRandomSampler(w, 400)),
             ("fm", batchd.WeightedRandomSampler(other, 400)),
             (batchd.Mix({"fm": 1.0, "fm2": 1.0}, num_samples=400), None),
             (batchd.Mix({"fm": 1.0, "fm2": 1.0}, num_samples=400), None),
             (batchd.Mix({"fm": 1.0, "fm2": 1.5}, num_samples=400), None)]
    barrier = threading.Barrier(len(specs))
    results: list = [None] * len(specs)
    errors: list = []

    def read(i: int) -> None:
        dataset, sampler = specs[i]
        try:
            with batchd.RemoteDataLoader(srv.address, dataset, batch_size=100, sampler=sampler, seed=1,
                                         transport="inline", timeout=60) as ld:
                len(ld)
                barrier.wait(30)
                results[i] = [b["index"].numpy().tobytes() for b in ld]
        except BaseException as e:
            errors.append(e)
            barrier.abort()

    before = snapshot(loader).computations_started
    threads = [threading.Thread(target=read, args=(i,)) for i in range(len(specs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert results[0] == results[1] != results[2] and results[3] == results[4] != results[5]
    assert snapshot(loader).computations_started - before == 4  # 6 loaders, 4 distinct requests


# --- weights on the wire ------------------------------------------------------------------------------


def test_a_million_weights_travel_once_per_loader(srv):
    w = weights_for(N_BIG, 13)
    totals = lambda: snapshot(srv.loader).totals  # noqa: E731
    before = totals()
    with batchd.RemoteDataLoader(srv.address, "big", batch_size=64, sampler=batchd.WeightedRandomSampler(w, 128),
                                 seed=1) as ld:
        for epoch in range(3):
            got = epoch_of(ld, epoch)
            assert np.array_equal(got["index"], REF["reference_weighted_draw"](w, 128, True, seed=1, epoch=epoch))
    after = totals()
    assert after.put_weights_calls - before.put_weights_calls == 1
    assert after.weights_bytes_received - before.weights_bytes_received == 8 * N_BIG
    assert srv.loader.weights.bytes >= 8 * N_BIG


def test_a_server_that_dropped_the_weights_gets_them_again(fmnist_root, tmp_path, caplog):
    """max_weights_bytes 1 MiB holds one vector of 100,000 weights: loader B's evicts loader A's;
    A's next epoch is refused (WeightsNotFound), sends them again and reads on, same draw."""
    from conftest import running_server

    n = 100_000
    wa, wb = weights_for(n, 20), weights_for(n, 21)
    with running_server(python_path=[str(PYDATA)], workers=1, cache_dir=tmp_path, max_weights_bytes=1 << 20,
                        datasets={"p": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": n}}}) as s, \
            batchd.RemoteDataLoader(s.address, "p", batch_size=32, sampler=batchd.WeightedRandomSampler(wa, 64)) as a, \
            batchd.RemoteDataLoader(s.address, "p", batch_size=32, sampler=batchd.WeightedRandomSampler(wb, 64)) as b:
        epoch_of(a, 0)
        epoch_of(b, 0)
        assert a.sampler.digest not in s.loader.weights and b.sampler.digest in s.loader.weights
        got = epoch_of(a, 1)
        assert np.array_equal(got["index"], REF["reference_weighted_draw"](wa, 64, True, seed=0, epoch=1))
        assert snapshot(s.loader).totals.put_weights_calls == 3
        assert any("WeightsNotFound" in r.getMessage() or "does not hold the weights" in r.getMessage()
                   for r in caplog.records)


# --- weights the server owns -----------------------------------------------------------------------------


@pytest.mark.parametrize("name, weights", [("pets", PETS_WEIGHTS), ("own", (np.arange(50) % 5).tolist())])
def test_weights_the_server_owns_are_drawn_by(srv, name, weights):
    from batchd.sampler import weights_digest

    sampler = batchd.WeightedRandomSampler("dataset", num_samples=200)
    with batchd.RemoteDataLoader(srv.address, name, batch_size=50, sampler=sampler, seed=8) as ld:
        assert ld.info.weights_digest == weights_digest(np.asarray(weights, np.float64))
        got = epoch_of(ld)
    assert np.array_equal(got["index"], REF["reference_weighted_draw"](weights, 200, True, seed=8, epoch=0))
    assert ld.state_dict()["sampler"]["weights"] == "dataset"
    with pytest.raises(ValueError, match="has no weights of its own"):
        batchd.RemoteDataLoader(srv.address, "fm", sampler=sampler)


def test_bad_weights_the_server_owns_stop_it_at_start(tmp_path):
    from conftest import running_server

    table = tmp_path / "bad.csv"
    write_png(tmp_path / "a.png", np.zeros((4, 4, 3), np.uint8))
    table.write_text("path,label,weight\na.png,0,1\na.png,0,-3\n")
    with pytest.raises(ValueError, match=r"row 1 .* has weight -3.0 in weight_column 'weight'"):
        with running_server(workers=1, cache_dir=tmp_path, datasets={"t": {"kind": "manifest", "path": str(table),
                                                                          "weight_column": "weight"}}):
            pass
    with pytest.raises(ValueError, match="no weight_column column 'w'"):
        with running_server(workers=1, cache_dir=tmp_path, datasets={"t": {"kind": "manifest", "path": str(table),
                                                                          "weight_column": "w"}}):
            pass
    with pytest.raises(ValueError, match="weights must have one entry per sample"):
        with running_server(workers=1, cache_dir=tmp_path, python_path=[str(PYDATA)], datasets={
                "t": {"kind": "python", "factory": "batchd_testdata:WeightedPaced", "args": {"bad": True}}}):
            pass


def test_class_counts_and_labels_describe_the_dataset(srv, fmnist_root):
    info = batchd.describe_dataset(srv.address, "fm", labels=True)
    assert info.labels.dtype == np.int64 and len(info.labels) == N_FM
    assert list(info.class_counts) == np.bincount(info.labels, minlength=10).tolist() and sum(info.class_counts) == N_FM
    with batchd.RemoteDataLoader(srv.address, "fm", batch_size=500) as ld:
        assert np.array_equal(np.concatenate([b["label"].numpy() for b in ld]), info.labels)
        assert ld.info.labels is None and ld.info.class_counts == info.class_counts
    assert batchd.describe_dataset(srv.address, "rng", labels=True).labels is None  # no labels index: none


# --- bad input -----------------------------------------------------------------------------------------


def test_bad_arguments_with_a_server_raise_before_anything_starts(srv):
    before = snapshot(srv.loader).totals.streams_started
    with pytest.raises(ValueError, match="weights has 3 entries but dataset 'fm' .* has 10000 samples"):
        batchd.RemoteDataLoader(srv.address, "fm", sampler=batchd.WeightedRandomSampler([1, 2, 3], 5))
    with pytest.raises(ValueError, match="unknown source 'nope'"):
        batchd.RemoteDataLoader(srv.address, batchd.Mix({"fm": 1, "nope": 1}, num_samples=5))
    with pytest.raises(ValueError, match="mutually exclusive with shuffle"):
        batchd.RemoteDataLoader(srv.address, "fm", shuffle=True, sampler=batchd.WeightedRandomSampler(np.ones(N_FM), 5))
    with pytest.raises(ValueError, match="batchd.WeightedRandomSampler"):
        from torch.utils.data import WeightedRandomSampler

        batchd.RemoteDataLoader(srv.address, "fm", sampler=WeightedRandomSampler([1.0], 1))
    with pytest.raises(ValueError, match="decode_on_client"):
        batchd.RemoteDataLoader(srv.address, batchd.Mix({"fm": 1}, num_samples=5), decode_on_client=True)
    assert snapshot(srv.loader).totals.streams_started == before


def _put(stub, weights, digest=None, num=None) -> None:
    from batchd.sampler import weights_digest

    raw = np.asarray(weights, "<f8")
    stub.PutWeights(iter([pb.WeightsChunk(digest=digest or weights_digest(raw), num_weights=len(raw) if num is None
                                          else num, weights=raw.tobytes())]), timeout=30)


def _refusal(stub, request: pb.StreamBatchesRequest) -> tuple[grpc.StatusCode, str]:
    call = RawBatches(stub, request, grant=[0], timeout=30)
    try:
        list(call)
    except grpc.RpcError as e:
        return e.code(), e.details()
    raise AssertionError("the server accepted the request")


def test_bad_requests_are_invalid_argument_naming_the_value(srv):
    from batchd.sampler import weights_digest

    channel = grpc.insecure_channel(srv.address)
    stub = loader_pb2_grpc.BatchLoaderStub(channel)
    short = np.ones(3)
    _put(stub, short)
    ok = np.ones(N_FM)
    _put(stub, ok)
    before = snapshot(srv.loader)

    def weighted(**kw):
        fields = dict(weights_digest=weights_digest(ok), num_samples=10, replacement=True)
        fields.update(kw)
        return pb.StreamBatchesRequest(dataset="fm", batch_size=4, sampler=pb.WeightedSampler(**fields))

    def mix(sources, num_samples=10):
        return pb.StreamBatchesRequest(batch_size=4, mix=pb.Mix(sources=[pb.MixSource(dataset=d, weight=w)
                                                                         for d, w in sources], num_samples=num_samples))
    cases = [
        (weighted(weights_digest=weights_digest(short)), "weights has 3 entries but dataset 'fm' has 10000"),
        (weighted(num_samples=0), "num_samples must be a positive integer, got 0"),
        (weighted(num_samples=N_FM + 1, replacement=False), "num_samples=10001 without replacement"),
        (weighted(weights_digest="", dataset_weights=True), "dataset 'fm' has no weights of its own"),
        (pb.StreamBatchesRequest(dataset="fm", batch_size=4, shuffle=True, sampler=weighted().sampler), "shuffle"),
        (mix([("fm", 1.0), ("nope", 1.0)]), "unknown source 'nope'"),
        (mix([("fm", 0.0), ("fm2", 0.0)]), "weights sum to zero"),
        (mix([("fm", -1.0)]), "source 'fm' has weight -1.0"),
        (mix([("fm", float("nan"))]), "source 'fm' has weight nan"),
        (mix([("fm", 1.0)], num_samples=0), "num_samples must be a positive integer, got 0"),
        (mix([("fm", 1.0), ("fm", 1.0)]), "source 'fm' is named twice"),
    ]
    for request, words in cases:
        code, details = _refusal(stub, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT and words in details, (words, code, details)
    code, details = _refusal(stub, weighted(weights_digest="0" * 64))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "does not hold the weights" in details
    after = snapshot(srv.loader)
    assert after.computations_started == before.computations_started  # nothing started
    assert after.totals.streams_started == before.totals.streams_started
    uploads = [
        (lambda: _put(stub, [1.0, -1.0]), grpc.StatusCode.INVALID_ARGUMENT, "weights[1] is -1.0"),
        (lambda: _put(stub, [1.0, float("nan")]), grpc.StatusCode.INVALID_ARGUMENT, "weights[1] is nan"),
        (lambda: _put(stub, [0.0, 0.0]), grpc.StatusCode.INVALID_ARGUMENT, "all zero"),
        (lambda: _put(stub, [1.0, 2.0], digest="ab" * 32), grpc.StatusCode.INVALID_ARGUMENT, "not " + "ab" * 32),
        (lambda: _put(stub, [1.0, 2.0], num=3), grpc.StatusCode.INVALID_ARGUMENT, "16 bytes came for 3 weights"),
        (lambda: _put(stub, [1.0], num=10**12), grpc.StatusCode.RESOURCE_EXHAUSTED, "max_weights_bytes"),
    ]
    for put, status, words in uploads:
        with pytest.raises(grpc.RpcError) as e:
            put()
        assert e.value.code() == status and words in e.value.details(), (words, e.value.details())
    channel.close()
