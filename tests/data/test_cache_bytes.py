"""The cache never changes a batch: every transform type the prefix may cache, through real servers.

Two module servers over the same JPEGs (sizes from 24x30 to 200x150, so a transform that pads
at random draws for some samples and not for others): one without a cache, one with. Each
configuration of each cacheable type (server/compute/prefix.py ``CACHEABLE``), alone and followed
by random transforms, goes through both for 2 epochs (the second served from the cache), and
every batch's bytes must be equal. The configurations include the ones the old rule list let
through: ``LongestMaxSize(max_size=[32])`` (albumentations draws ``choice`` from a one-element
list) and ``CenterCrop(pad_if_needed=True, pad_position="random")`` (its pad offset drawn from
the transform's own unseeded generator). Then every client-allowlisted transform, alone and
after a cached Resize, and a transform that draws only for some samples (those are built
uncached).
"""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest

import batchd
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import prefix
from conftest import running_server

SIZES = [(24, 30), (30, 24), (50, 70), (70, 50), (96, 128), (128, 96), (120, 160), (160, 120), (45, 45),
         (200, 150), (150, 200), (64, 64)]
TINY = [(2, 2), (6, 6), (2, 5), (8, 4), (5, 2), (3, 3)]  # three need a pad to reach 3x3
SMALL = [(24, 30), (40, 33), (64, 48), (33, 40), (48, 64), (36, 36)]
RANDOM_REST = [A.HorizontalFlip(), A.RandomBrightnessContrast(p=1), A.VerticalFlip()]

# (id, transform, expected prefix length when alone: 1 deterministic, 0 draws)
CONFIGS = [
    ("Resize", A.Resize(40, 48), 1),
    ("Resize-nearest", A.Resize(40, 48, interpolation=cv2.INTER_NEAREST), 1),
    ("Resize-area", A.Resize(20, 20, interpolation=cv2.INTER_AREA), 1),
    ("Resize-p0.5", A.Resize(40, 48, p=0.5), 0),
    ("LongestMaxSize", A.LongestMaxSize(max_size=40), 1),
    ("LongestMaxSize-[32]", A.LongestMaxSize(max_size=[32]), 0),
    ("LongestMaxSize-[32,40]", A.LongestMaxSize(max_size=[32, 40]), 0),
    ("LongestMaxSize-hw", A.LongestMaxSize(max_size_hw=(40, 36)), 1),
    ("LongestMaxSize-p0.7", A.LongestMaxSize(max_size=40, p=0.7), 0),
    ("SmallestMaxSize", A.SmallestMaxSize(max_size=32), 1),
    ("SmallestMaxSize-[32]", A.SmallestMaxSize(max_size=[32]), 0),
    ("SmallestMaxSize-[24,32]", A.SmallestMaxSize(max_size=[24, 32]), 0),
    ("SmallestMaxSize-hw", A.SmallestMaxSize(max_size_hw=(None, 30)), 1),
    ("CenterCrop", A.CenterCrop(20, 20), 1),
    ("CenterCrop-pad", A.CenterCrop(64, 64, pad_if_needed=True), 1),
    ("CenterCrop-pad-top_left", A.CenterCrop(64, 64, pad_if_needed=True, pad_position="top_left",
                                             border_mode=cv2.BORDER_REFLECT_101), 1),
    ("CenterCrop-pad-random", A.CenterCrop(64, 64, pad_if_needed=True, pad_position="random"), 0),
    ("CenterCrop-p0.5", A.CenterCrop(20, 20, p=0.5), 0),
    ("PadIfNeeded", A.PadIfNeeded(100, 100), 1),
    ("PadIfNeeded-bottom_right", A.PadIfNeeded(100, 100, position="bottom_right", fill=7), 1),
    ("PadIfNeeded-divisor", A.PadIfNeeded(None, None, pad_height_divisor=32, pad_width_divisor=32,
                                          border_mode=cv2.BORDER_REPLICATE), 1),
    ("PadIfNeeded-random", A.PadIfNeeded(100, 100, position="random"), 0),
    ("ToGray", A.ToGray(p=1), 1),
    ("ToGray-desaturation", A.ToGray(method="desaturation", p=1), 1),
    ("ToGray-pca", A.ToGray(method="pca", p=1), 1),
    ("ToGray-default-p", A.ToGray(), 0),
]


def _write_jpegs(root, sizes, seed: int):
    rng = np.random.default_rng(seed)
    for i, (h, w) in enumerate(sizes):
        image = cv2.GaussianBlur(rng.integers(0, 256, (h, w, 3), np.uint8), (0, 0), 1.5)
        (root / f"c{i % 2}").mkdir(exist_ok=True)
        cv2.imwrite(str(root / f"c{i % 2}" / f"{i:03d}.jpg"), image)
    return root


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """(uncached, cached) servers, one worker each, over "sized" (SIZES), "tiny" (TINY), "small" (SMALL)."""
    datasets = {"sized": {"kind": "imagefolder", "root": str(_write_jpegs(tmp_path_factory.mktemp("sized"), SIZES, 3))},
                "tiny": {"kind": "imagefolder", "root": str(_write_jpegs(tmp_path_factory.mktemp("tiny"), TINY, 4))},
                "small": {"kind": "imagefolder", "root": str(_write_jpegs(tmp_path_factory.mktemp("small"), SMALL, 5))}}
    index = tmp_path_factory.mktemp("idx")
    with running_server(datasets=datasets, workers=1, cache_dir=index) as plain, \
            running_server(datasets=datasets, workers=1, cache_dir=index, cache={"memory_bytes": "16MiB"}) as cached:
        assert plain.loader.cache is None and cached.loader.cache is not None
        yield plain, cached


def _batches(server, transform, dataset: str = "sized", epochs: int = 2) -> list[np.ndarray]:
    """Every image of ``epochs`` shuffled epochs (batch 1: output sizes may vary), in order."""
    out = []
    with batchd.RemoteDataLoader(server.address, dataset, batch_size=1, shuffle=True, seed=11,
                                 transform=transform, timeout=60) as loader:
        for _ in range(epochs):
            out.extend(b["image"].numpy().copy() for b in loader)
    return out


def _compose(*transforms):
    return pipelines.build(pipelines.canonical_json(A.to_dict(A.Compose(list(transforms)))))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, transform, n", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_a_cacheable_transform_gives_the_same_bytes_with_and_without_the_cache(servers, name, transform, n):
    plain, cached = servers
    assert prefix.prefix_length(_compose(transform)) == n
    assert prefix.prefix_length(_compose(transform, *RANDOM_REST)) == n
    for pipeline in (A.Compose([transform]), A.Compose([transform, *RANDOM_REST])):
        hits = cached.loader.cache.stats()["sized"]["hits"]
        want, got = _batches(plain, pipeline), _batches(cached, pipeline)
        assert len(want) == len(got) == 2 * len(SIZES)
        differ = [i for i, (a, b) in enumerate(zip(want, got)) if a.shape != b.shape or not np.array_equal(a, b)]
        assert not differ, f"{pipeline}: {len(differ)} of {len(want)} samples differ from the uncached server"
        assert cached.loader.cache.stats()["sized"]["hits"] - hits >= len(SIZES)  # epoch 2 came from the cache


@pytest.mark.timeout(120)
def test_a_sample_for_which_the_prefix_would_draw_runs_the_whole_pipeline_uncached(servers):
    """CenterCrop(3, 3, pad random) draws nothing on the probes (all at least 3x5), so it is
    cached; but it draws a pad offset for the three TINY images under 3x3. Those samples are
    built by the whole pipeline from their own stream and never stored: same bytes, and in
    epoch 2 only the other three are hits."""
    plain, cached = servers
    crop = A.CenterCrop(3, 3, pad_if_needed=True, pad_position="random")
    assert prefix.prefix_length(_compose(crop, *RANDOM_REST)) == 1
    pipeline = A.Compose([crop, *RANDOM_REST])
    want, got = _batches(plain, pipeline, "tiny"), _batches(cached, pipeline, "tiny")
    assert len(want) == 2 * len(TINY) and all(np.array_equal(a, b) for a, b in zip(want, got))
    s = cached.loader.cache.stats()["tiny"]
    assert (s["misses"], s["hits"]) == (len(TINY) + 3, 3), s


def _allowlisted():
    from batchd.server.compute.allowlist import ALLOWED, COMPOSITIONS

    required = {"Resize": dict(height=24, width=24), "RandomCrop": dict(height=16, width=16),
                "CenterCrop": dict(height=16, width=16), "RandomResizedCrop": dict(size=(16, 16)),
                "RandomSizedCrop": dict(min_max_height=(8, 16), size=(16, 16)), "SmallestMaxSize": dict(max_size=24),
                "LongestMaxSize": dict(max_size=24), "RandomSizedBBoxSafeCrop": dict(height=16, width=16),
                "AtLeastOneBBoxRandomCrop": dict(height=16, width=16)}
    return [(name, getattr(A, name)(**required.get(name, {}))) for name in sorted(ALLOWED - COMPOSITIONS)]


# crops that read the sample's boxes (or its cropping_bbox field), as albumentations' own would fail
NEEDS_BOXES = {"BBoxSafeRandomCrop", "RandomSizedBBoxSafeCrop", "RandomCropNearBBox"}


@pytest.mark.timeout(300)
def test_every_allowlisted_transform_gives_the_same_bytes_with_and_without_the_cache(servers):
    """Each client-allowlisted transform (defaults), alone and after a cached Resize, one epoch of
    the six SMALL images through both servers: the same bytes, or the same error."""
    plain, cached = servers
    transforms = _allowlisted()
    assert len(transforms) > 50
    for name, transform in transforms:
        for pipeline in (A.Compose([transform]), A.Compose([A.Resize(32, 32), transform, A.HorizontalFlip()])):
            if name in NEEDS_BOXES:  # these images have no boxes: the same error from both
                errors = []
                for server in (plain, cached):
                    with pytest.raises((batchd.WorkerError, ValueError, KeyError)) as e:
                        _batches(server, pipeline, "small", epochs=1)
                    errors.append(str(e.value).splitlines()[0])
                assert errors[0] == errors[1], errors
                continue
            want, got = _batches(plain, pipeline, "small", epochs=1), _batches(cached, pipeline, "small", epochs=1)
            assert len(want) == len(got) == len(SMALL)
            differ = sum(a.shape != b.shape or not np.array_equal(a, b) for a, b in zip(want, got))
            assert not differ, f"{pipeline}: {differ} of {len(want)} samples differ from the uncached server"
