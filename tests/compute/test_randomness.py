"""Random augmentations served by a real server: independent, covering their range, deterministic.

The data is synthetic and decodes exactly (PNG): 2,048 images of 40x40 RGB where red is 6 x column,
green is 6 x row and blue is 40. So from an output image one can read which flips were applied
(the direction of the red and green gradients), whether it was inverted (blue), and where a
32x32 crop was taken (its smallest red and green values / 6).

Chi-square tests are computed by hand (no scipy) and compared with the critical value at
alpha = 0.001; the seed is fixed, so every test is deterministic.
"""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest
from helpers import digest, write_png

import batchd
from batchd.sampler import sample_key, sample_stream
from batchd.server.compute.pipeline import SampleRandom
from conftest import running_server

N = 2048
SIDE = 40
STEP = 6  # red = STEP * column, green = STEP * row
BLUE = 40

# Upper 0.001 critical values of the chi-square distribution by degrees of freedom, from the
# NIST/SEMATECH e-Handbook of Statistical Methods, section 1.3.6.7.4 "Critical Values of the
# Chi-Square Distribution" (https://www.itl.nist.gov/div898/handbook/eda/section3/eda3674.htm).
CHI2_CRITICAL_001 = {1: 10.828, 3: 16.266, 4: 18.467, 6: 22.458, 7: 24.322, 8: 26.124, 64: 104.716}

FLIPS2 = A.Compose([A.Resize(32, 32), A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)])
FLIPS3 = A.Compose([A.Resize(32, 32), A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5), A.InvertImg(p=0.5)])
CROP = A.Compose([A.RandomCrop(32, 32), A.HorizontalFlip(p=0.5)])


def gradient(i: int) -> np.ndarray:
    """Image i: RGB uint8 [SIDE, SIDE, 3] (every image alike; the index tells samples apart)."""
    rows, cols = np.mgrid[0:SIDE, 0:SIDE]
    return np.stack([STEP * cols, STEP * rows, np.full_like(rows, BLUE)], axis=-1).astype(np.uint8)


@pytest.fixture(scope="module")
def datasets(tmp_path_factory):
    root = tmp_path_factory.mktemp("gradients")
    for i in range(N):
        write_png(root / "c0" / f"img_{i:04d}.png", gradient(i))
    decoded = cv2.cvtColor(cv2.imread(str(root / "c0" / "img_0000.png")), cv2.COLOR_BGR2RGB)
    assert np.array_equal(decoded, gradient(0)), "the PNG does not decode to the exact gradient"
    return {"grad": {"kind": "imagefolder", "root": str(root)}}


@pytest.fixture(scope="module")
def server(datasets, tmp_path_factory):
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("cache"), datasets=datasets) as s:
        yield s


def read(server, transform, **kwargs) -> dict[int, np.ndarray]:
    """One epoch: dataset index -> augmented image, uint8 [H, W, 3] (a padded duplicate keeps its first)."""
    kwargs.setdefault("batch_size", 64)
    kwargs.setdefault("seed", 2024)
    kwargs.setdefault("shuffle", True)
    out: dict[int, np.ndarray] = {}
    with batchd.RemoteDataLoader(server.address, "grad", transform=transform, **kwargs) as ld:
        for batch in ld:
            for i, image in zip(batch["index"].tolist(), batch["image"].numpy()):
                out.setdefault(i, image.copy())
    return out


def flips(images: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(horizontal, vertical, inverted) flags, bool [N] each, read from images uint8 [N, H, W, 3]."""
    img = images.astype(np.int16)
    inverted = img[..., 2].mean(axis=(1, 2)) > 127
    img = np.where(inverted[:, None, None, None], 255 - img, img)
    red, green = img[..., 0], img[..., 1]
    horizontal = red[:, :, 0].mean(axis=1) > red[:, :, -1].mean(axis=1)
    vertical = green[:, 0, :].mean(axis=1) > green[:, -1, :].mean(axis=1)
    return horizontal, vertical, inverted


def contingency(*factors: np.ndarray) -> np.ndarray:
    """Counts of each combination of the factors' values (non-negative ints [N] each): an array with one axis per factor."""
    table = np.zeros([int(f.max()) + 1 for f in factors], np.int64)
    np.add.at(table, tuple(f.astype(np.int64) for f in factors), 1)
    return table


def chi2_independence(table: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the chi-square test of mutual independence of the table's axes."""
    n = table.sum()
    expected = np.full(table.shape, float(n))
    for axis, k in enumerate(table.shape):
        marginal = table.sum(axis=tuple(a for a in range(table.ndim) if a != axis)) / n
        expected *= marginal.reshape([k if a == axis else 1 for a in range(table.ndim)])
    stat = float(((table - expected) ** 2 / expected).sum())
    return stat, table.size - 1 - sum(k - 1 for k in table.shape)


def chi2_uniform(table: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom) of the chi-square goodness of fit to equal cell probabilities."""
    expected = table.sum() / table.size
    return float(((table - expected) ** 2 / expected).sum()), table.size - 1


def assert_chi2(result: tuple[float, int], what: str, table: np.ndarray) -> None:
    stat, df = result
    critical = CHI2_CRITICAL_001[df]
    assert stat < critical, f"{what}: chi-square {stat:.1f} >= {critical} (df {df}, alpha 0.001); counts:\n{table}"


def stacked(images: dict[int, np.ndarray]) -> np.ndarray:
    return np.stack([images[i] for i in range(N)])


# --- independence ------------------------------------------------------------------------------


def test_two_flips_are_independent(server):
    images = read(server, FLIPS2)
    assert sorted(images) == list(range(N))
    h, v, inverted = flips(stacked(images))
    assert not inverted.any()
    table = contingency(h, v)
    assert table.shape == (2, 2) and table.min() > 0, f"a combination of flips never occurs:\n{table}"
    assert_chi2(chi2_independence(table), "HorizontalFlip x VerticalFlip independence", table)
    assert_chi2(chi2_uniform(table), "HorizontalFlip x VerticalFlip, each p=0.5", table)


def test_three_transforms_are_independent(server):
    h, v, inverted = flips(stacked(read(server, FLIPS3)))
    table = contingency(h, v, inverted)
    assert table.shape == (2, 2, 2) and table.min() > 0, f"a combination never occurs:\n{table}"
    assert_chi2(chi2_independence(table), "HorizontalFlip x VerticalFlip x InvertImg independence", table)
    assert_chi2(chi2_uniform(table), "HorizontalFlip x VerticalFlip x InvertImg, each p=0.5", table)


def test_crop_offsets_cover_their_range_independently_of_a_flip(server):
    # one sample per batch: where a per-transform copy of one seed showed most (the crop's first
    # draw was the flip's draw), and a test that the stream is keyed by sample, not by batch
    images = stacked(read(server, CROP, batch_size=1))
    assert images.shape == (N, 32, 32, 3)
    red, green = images[..., 0].astype(np.int64), images[..., 1].astype(np.int64)
    x, y = red.min(axis=(1, 2)) // STEP, green.min(axis=(1, 2)) // STEP
    flipped = red[:, :, 0].mean(axis=1) > red[:, :, -1].mean(axis=1)
    # every offset in [0, 40 - 32] occurs, each about equally often, and every (x, y) pair
    assert sorted(set(x.tolist())) == list(range(SIDE - 32 + 1)), sorted(set(x.tolist()))
    assert sorted(set(y.tolist())) == list(range(SIDE - 32 + 1)), sorted(set(y.tolist()))
    xy = contingency(x, y)
    assert xy.min() > 0, f"some (x, y) crop offsets never occur:\n{xy}"
    assert_chi2(chi2_uniform(contingency(x)), "crop x offset uniform", contingency(x))
    assert_chi2(chi2_uniform(contingency(y)), "crop y offset uniform", contingency(y))
    assert_chi2(chi2_independence(xy), "crop x offset x crop y offset independence", xy)
    for name, offset in (("x", x), ("y", y)):
        table = contingency(offset, flipped)
        assert_chi2(chi2_independence(table), f"crop {name} offset x HorizontalFlip independence", table)


# --- determinism and what a sample's augmentation depends on -----------------------------------


def test_same_bytes_with_one_and_two_workers(server, make_server, datasets):
    one = make_server(workers=1, datasets=datasets)
    kw = dict(batch_size=64, shuffle=True, seed=7, transform=FLIPS3)
    digests = []
    for s in (one, server, server):
        with batchd.RemoteDataLoader(s.address, "grad", **kw) as ld:
            digests.append([digest(b) for b in ld])
    assert len(digests[0]) == N // 64
    assert digests[1] == digests[0], "workers=2 gave other bytes than workers=1"
    assert digests[2] == digests[0], "a second pass gave other bytes"


def test_a_sample_is_augmented_alike_whatever_the_batch_size_and_world_size(server):
    ref = read(server, FLIPS3, batch_size=8)
    h, v, inv = flips(stacked(ref))
    assert 0 < h.sum() < N and 0 < v.sum() < N and 0 < inv.sum() < N  # not the identity, not always
    variants = {"batch_size 32": read(server, FLIPS3, batch_size=32)}
    for rank in (0, 1):
        variants[f"rank {rank} of 2"] = read(server, FLIPS3, batch_size=32, rank=rank, world_size=2)
    assert sorted(variants["rank 0 of 2"].keys() | variants["rank 1 of 2"].keys()) == list(range(N))
    for name, got in variants.items():
        differ = [i for i, image in got.items() if not np.array_equal(image, ref[i])]
        assert not differ, f"{name}: {len(differ)} of {len(got)} samples augmented differently from batch_size 8 (e.g. {differ[:5]})"


def documented_shard(n: int, *, seed: int, epoch: int, rank: int, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(dataset indices, global positions) of a rank's shuffled shard, int64 [shard] each, from the
    README's definition in numpy alone: the epoch's order is Generator(PCG64(SeedSequence([seed,
    epoch]))).permutation(n), padded by wrapping around to world_size * ceil(n / world_size)
    (DistributedSampler's rule), and rank r takes global positions r, r + world_size, ..."""
    order = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch]))).permutation(n)
    padded = np.concatenate([order, order[: world_size * -(-n // world_size) - n]])
    positions = np.arange(rank, len(padded), world_size)
    return padded[positions], positions


def documented_flips3(image: np.ndarray, *, seed: int, epoch: int, position: int) -> np.ndarray:
    """FLIPS3 on ``image`` at ``position``, from the README in numpy alone: the stream is
    Generator(Philox(key).jumped(position)) with key = SeedSequence([seed, epoch], spawn_key=(1,))
    .generate_state(2, uint64), and the pipeline draws from it in turn: Compose one double (its
    p), Resize none (p = 1), then HorizontalFlip, VerticalFlip, InvertImg one double each, applied
    if below 0.5."""
    key = np.random.SeedSequence([seed, epoch], spawn_key=(1,)).generate_state(2, np.uint64)
    _, hflip, vflip, invert = np.random.Generator(np.random.Philox(key=key).jumped(position)).random(4) < 0.5
    out = cv2.resize(image, (32, 32), interpolation=cv2.INTER_LINEAR)
    out = out[:, ::-1] if hflip else out
    out = out[::-1] if vflip else out
    return 255 - out if invert else out


def assert_documented_epoch(server, *, seed: int, epoch: int, rank: int, world_size: int) -> None:
    with batchd.RemoteDataLoader(server.address, "grad", transform=FLIPS3, batch_size=16, shuffle=True, seed=seed,
                                 rank=rank, world_size=world_size) as ld:
        ld.set_epoch(epoch)
        batches = list(ld)
    indices, positions = documented_shard(N, seed=seed, epoch=epoch, rank=rank, world_size=world_size)
    assert np.concatenate([b["index"].numpy() for b in batches]).tolist() == indices.tolist()
    assert np.concatenate([b["position"].numpy() for b in batches]).tolist() == positions.tolist()
    images = np.concatenate([b["image"].numpy() for b in batches])
    for image, index, position in zip(images, indices.tolist(), positions.tolist()):
        want = documented_flips3(gradient(index), seed=seed, epoch=epoch, position=position)
        assert np.array_equal(image, want), f"epoch {epoch}, sample {index} (position {position})"


# 2048 samples on 3 ranks: rank 2's last sample is the wrapped-around padding (position 2048)
DERIVED = dict(seed=99, epoch=1, rank=2, world_size=3)


def test_bytes_follow_the_documented_derivation(server):
    """Every sample of a shard, recomputed from the README's definition without batchd's sampler
    or SampleRandom (documented_shard, documented_flips3)."""
    assert documented_shard(N, **DERIVED)[1][-1] == N  # the shard ends with the padding
    assert_documented_epoch(server, **DERIVED)


def test_bytes_follow_the_documented_derivation_with_the_cache(datasets, tmp_path_factory):
    """The same with the decoded-sample cache: the epoch that fills it, then the same epoch again,
    every sample's Resize served from it."""
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("cache"), datasets=datasets,
                        cache={"memory_bytes": "8MiB"}) as server:
        assert_documented_epoch(server, **DERIVED)
        hits = server.loader.cache.stats()["grad"]["hits"]
        assert_documented_epoch(server, **DERIVED)
        assert server.loader.cache.stats()["grad"]["hits"] - hits >= N // 3, "the second epoch missed the cache"


def test_py_random_and_the_generator_are_one_stream():
    """py_random.random() is the next double of the sample's numpy stream; the methods random.Random
    builds on it (uniform, randint, choice, shuffle, gauss) work, stay in range and are re-keyed too."""
    key = sample_key(seed=5, epoch=2)
    rnd = SampleRandom()
    rnd.start(key, 77)
    mixed = [rnd.py_random.random(), rnd.generator.random(), rnd.py_random.random()]
    assert mixed == sample_stream(key, 77).random(3).tolist()  # interleaved draws take turns in one stream

    def draws():
        r = rnd.py_random
        return ([r.uniform(2.0, 3.0) for _ in range(200)], [r.randint(-3, 3) for _ in range(700)],
                [r.choice("abcd") for _ in range(400)], r.sample(range(100), 10), r.gauss(1.0, 2.0),
                r.getrandbits(130))

    rnd.start(key, 78)
    first = draws()
    rnd.start(key, 78)
    assert draws() == first, "re-keying must fully determine py_random (nothing held back)"
    uniforms, ints, letters, picked, _, bits = first
    assert all(2.0 <= u < 3.0 for u in uniforms) and max(uniforms) - min(uniforms) > 0.9
    counts = np.bincount(np.array(ints) + 3, minlength=7)
    chi2 = float(((counts - 100) ** 2 / 100).sum())
    assert chi2 < CHI2_CRITICAL_001[6], f"randint(-3, 3) counts {counts.tolist()}"
    assert set(letters) == set("abcd") and len(set(picked)) == 10 and 0 <= bits < 1 << 130
    rnd.start(key, 79)
    assert draws() != first, "another position must give another stream"
