"""Noise from the sample's stream with full entropy: no two samples share their noise.

albumentations seeds OpenCV's generator with ``integers(0, 2**16)`` for GaussNoise, so over
3,000 samples about 3000^2 / 2 / 65536 = 69 pairs got byte-identical noise; ISONoise,
CoarseDropout and GridDropout (random fill) seed a numpy Generator with 32 bits. The server
widens them (server/compute/entropy.py). The data here is one 16x16 PNG (fixed noise in
[64, 192)) listed 3,000 times in a manifest, so any two equal outputs are equal noise.
"""

from __future__ import annotations

import albumentations as A
import numpy as np
import pytest
from helpers import write_png

import batchd
from batchd.server.compute import pipeline as pipelines
from conftest import running_server

N = 3000
SIDE = 16
IMAGE = np.random.default_rng(5).integers(64, 192, (SIDE, SIDE, 3), np.uint8)

# every allowlisted transform whose randomness albumentations narrows, with settings under which
# two samples give equal bytes exactly when their noise (or fill) is equal
NARROW = {
    "GaussNoise": A.GaussNoise(std_range=(0.1, 0.1), p=1),  # per_channel=False, noise_scale_factor: below
    "ISONoise": A.ISONoise(color_shift=(0.05, 0.05), intensity=(0.5, 0.5), p=1),
    "CoarseDropout": A.CoarseDropout(num_holes_range=(1, 1), hole_height_range=(16, 16),
                                     hole_width_range=(16, 16), fill="random", p=1),
    "GridDropout": A.GridDropout(ratio=0.5, unit_size_range=(8, 9), random_offset=False, fill="random", p=1),
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("same")
    write_png(root / "one.png", IMAGE)
    (root / "same.csv").write_text("path,label\n" + "one.png,0\n" * N)
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("idx"),
                        datasets={"same": {"kind": "manifest", "path": str(root / "same.csv")}}) as s:
        yield s


def _images(server, transform) -> np.ndarray:
    """uint8 [N, SIDE, SIDE, 3]: one epoch, in sample order."""
    with batchd.RemoteDataLoader(server.address, "same", batch_size=500, transform=A.Compose([transform]),
                                 seed=7, timeout=120) as loader:
        return np.concatenate([b["image"].numpy() for b in loader])


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(NARROW))
def test_no_two_samples_get_the_same_noise(server, name):
    images = _images(server, NARROW[name])
    assert images.shape == (N, SIDE, SIDE, 3)
    distinct = len({im.tobytes() for im in images})
    assert (images != IMAGE).mean() > 0.02  # the noise (or fill) is there
    assert distinct == N, f"{name}: {N - distinct} samples repeat another's noise among {N}"


def _built(transform):
    """``transform`` as the server builds it (widened), drawing from a SampleRandom."""
    compose = pipelines.build(pipelines.canonical_json(A.to_dict(A.Compose([transform]))))
    random = pipelines.SampleRandom()
    random.attach(compose)
    return compose, random


@pytest.mark.parametrize("name", ["ISONoise", "CoarseDropout", "GridDropout"])
def test_the_seeds_carry_128_bits_of_the_stream(name):
    """A 32-bit seed would repeat among ~77,000 samples; these are 128 bits, all distinct."""
    compose, random = _built(NARROW[name])
    seeds = []
    for position in range(1000):
        random.start(np.array([3, 4], np.uint64), position)
        compose(image=IMAGE)
        params = compose.transforms[0].params
        seeds.append(params["random_seed"] if "random_seed" in params else params["seed"])
    assert len(set(seeds)) == len(seeds)
    bits = np.array([s.bit_length() for s in seeds])
    assert bits.max() == 128 and np.median(bits) >= 127  # uniform on [0, 2**128): half the seeds have bit 127 set


@pytest.mark.parametrize("kwargs", [{"std_range": (0.1, 0.1)}, {"std_range": (0.05, 0.2), "mean_range": (-0.1, 0.1)},
                                    {"std_range": (0.1, 0.1), "per_channel": False},
                                    {"std_range": (0.1, 0.1), "noise_scale_factor": 0.25}], ids=str)
def test_gauss_noise_keeps_albumentations_statistics(kwargs):
    """Ours (numpy normal deviates) against albumentations' own (OpenCV's), 300 samples each of
    a float32 0.5-grey 32x32 image: mean and spread of the per-sample noise mean and std, the
    correlation between channels and between neighbouring pixels."""
    image = np.full((32, 32, 3), 0.5, np.float32)
    compose, random = _built(A.GaussNoise(p=1, **kwargs))
    theirs = A.Compose([A.GaussNoise(p=1, **kwargs)], seed=0)
    ours_noise, their_noise = [], []
    for position in range(300):
        random.start(np.array([5, 6], np.uint64), position)
        ours_noise.append(compose(image=image)["image"] - 0.5)
        their_noise.append(theirs(image=image)["image"] - 0.5)

    def figures(noise):
        noise = np.stack(noise).astype(np.float64)
        means, stds = noise.mean(axis=(1, 2, 3)), noise.std(axis=(1, 2, 3))
        channels = np.corrcoef(noise[..., 0].ravel(), noise[..., 1].ravel())[0, 1]
        neighbours = np.corrcoef(noise[:, :, :-1].ravel(), noise[:, :, 1:].ravel())[0, 1]
        return np.array([means.mean(), means.std(), stds.mean(), stds.std(), channels, neighbours])

    ours, theirs_ = figures(ours_noise), figures(their_noise)
    # the correlations of 300 samples of 8x8 noise (noise_scale_factor 0.25) have a standard error
    # of about 0.007 each, so two independent estimates differ by 0.01 one time in three: 0.03
    atol = np.array([0.01, 0.01, 0.01, 0.01, 0.03, 0.03])
    assert np.allclose(ours, theirs_, atol=atol, rtol=0.1), f"ours {ours.round(4)} vs albumentations {theirs_.round(4)}"
