"""Splitting a pipeline into its deterministic prefix and random rest (server/compute/prefix.py)."""

from __future__ import annotations

import json

import albumentations as A
import numpy as np
import pytest

from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import prefix


def _compose(*transforms, **kw):
    text = pipelines.canonical_json(A.to_dict(A.Compose(list(transforms), **kw)))
    return text, pipelines.build(text)


L3 = (A.Resize(256, 256), A.HorizontalFlip(p=0.5), A.RandomCrop(200, 200), A.RandomBrightnessContrast(p=1),
      A.VerticalFlip(p=0.5))


@pytest.mark.parametrize("transforms, n", [
    (L3, 1),
    ((A.Resize(64, 64), A.CenterCrop(48, 48), A.ToGray(p=1), A.HorizontalFlip()), 3),
    ((A.SmallestMaxSize(80), A.PadIfNeeded(100, 100), A.RandomCrop(90, 90)), 2),
    ((A.LongestMaxSize(max_size=[64, 80]), A.Resize(32, 32)), 0),   # a random choice of size
    ((A.PadIfNeeded(100, 100, position="random"), A.Resize(32, 32)), 0),
    ((A.ToGray(), A.Resize(32, 32)), 0),                              # ToGray's default p is 0.5
    ((A.Resize(64, 64, p=0.9), A.CenterCrop(8, 8)), 0),
    ((A.OneOf([A.Resize(32, 32)], p=1), A.Resize(8, 8)), 0),
    ((A.Resize(40, 40), A.CenterCrop(20, 20)), 2),                    # all of it: no rest
])
def test_prefix_length(transforms, n):
    _, compose = _compose(*transforms)
    assert prefix.prefix_length(compose) == n
    s = prefix.split(compose, None)
    assert len(s.prefix) == n
    assert (s.rest is None) == (n == len(transforms))


def test_compose_with_p_below_one_has_no_prefix():
    _, compose = _compose(A.Resize(32, 32), A.HorizontalFlip(), p=0.5)
    assert prefix.prefix_length(compose) == 0


@pytest.mark.parametrize("transforms", [
    L3,
    (A.Resize(64, 64), A.CenterCrop(48, 48), A.ToGray(p=1), A.HorizontalFlip(), A.RandomBrightnessContrast()),
    (A.SmallestMaxSize(80), A.PadIfNeeded(100, 100), A.RandomCrop(90, 90), A.Rotate(limit=20, p=0.7)),
])
def test_split_gives_the_same_bytes_as_the_whole_pipeline(transforms):
    """prefix then rest, under the same per-sample stream, equals the whole Compose, sample by sample."""
    _, compose = _compose(*transforms)
    s = prefix.split(compose, None)
    assert s.prefix, "a test of nothing"
    whole_random, split_random = pipelines.SampleRandom(), pipelines.SampleRandom()
    whole_random.attach(compose)
    split_random.attach(s.rest)
    rng = np.random.default_rng(0)
    key = np.array([7, 11], np.uint64)
    differ = 0
    for position in range(40):
        image = rng.integers(0, 256, (120, 150, 3), np.uint8)
        whole_random.start(key, position)
        expected = compose(image=image.copy())["image"]
        split_random.start(key, position)
        got = s.rest(image=s.apply_prefix(image.copy()))["image"]
        assert got.dtype == expected.dtype and np.array_equal(got, expected), position
        differ += not np.array_equal(got, s.apply_prefix(image.copy())[:got.shape[0], :got.shape[1]])
    assert differ > 20  # the rest really is random and applied


def test_canonical_names_what_changes_the_pixels():
    def canon(*transforms, min_size=None):
        return prefix.split(_compose(*transforms)[1], min_size).canonical

    a = canon(A.Resize(256, 256), A.HorizontalFlip())
    assert a == canon(A.Resize(256, 256), A.VerticalFlip(), A.RandomCrop(10, 10))  # same prefix, other rest
    assert a != canon(A.Resize(256, 255), A.HorizontalFlip())
    assert a != canon(A.Resize(256, 256, interpolation=0), A.HorizontalFlip())
    assert a != canon(A.Resize(256, 256), A.HorizontalFlip(), min_size=(256, 256))
    assert json.loads(a)["transforms"][0]["__class_fullname__"] == "Resize"
    assert prefix.split(None, None).canonical == canon(A.HorizontalFlip())  # decode alone
