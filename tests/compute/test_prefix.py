"""Splitting a pipeline into its deterministic prefix and random rest (server/compute/prefix.py)."""

from __future__ import annotations

import json
import random

import albumentations as A
import cv2
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
    ((A.LongestMaxSize(max_size=[64]), A.Resize(32, 32)), 0),       # albumentations draws choice([64]) too
    ((A.SmallestMaxSize(max_size=[64]), A.Resize(32, 32)), 0),
    ((A.Resize(64, 64), A.CenterCrop(80, 80, pad_if_needed=True, pad_position="random")), 1),  # a random pad
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


class Draws(A.ImageOnlyTransform):
    """Adds 0 or 1 to the image, drawn from where ``how`` says ("none": adds 0, draws nothing)."""

    def __init__(self, how: str = "none", p: float = 1.0):
        super().__init__(p=p)
        self.how = how

    def apply(self, img, **params):
        if self.how == "small" and img.shape[0] >= 10:
            return img
        one = np.zeros((1, 1))
        draw = {
            "own random": lambda: self.py_random.randint(0, 1),
            "own generator": lambda: int(self.random_generator.integers(0, 2)),
            "small": lambda: self.py_random.randint(0, 1),  # only for images under 10 rows
            "numpy module": lambda: int(np.random.randint(0, 2)),
            "python module": lambda: random.randint(0, 1),
            "opencv": lambda: int(cv2.randu(one, 0, 2)[0, 0]),
            "fresh generator": lambda: np.random.default_rng().integers(0, 2, img.shape).astype(img.dtype),
            "none": lambda: 0,
        }[self.how]
        return img + draw()

    def get_transform_init_args_names(self):
        return ("how",)


@pytest.mark.parametrize("how", ["own random", "own generator", "small", "numpy module", "python module", "opencv",
                                 "fresh generator", "none"])
def test_a_transform_that_draws_from_anywhere_ends_the_prefix(how):
    """Decided by running it sealed on the probes (the type filter opened to Draws here)."""
    transforms = [A.Resize(40, 40), Draws(how), A.CenterCrop(8, 8)]
    cacheable = prefix.CACHEABLE + (Draws,)
    proven = prefix.deterministic_prefix(transforms, cacheable=cacheable)
    assert len(proven) == (3 if how in ("none", "small") else 1)  # "small": never under 10 rows after Resize
    # first: the probes reach it at their own sizes (3x5, 29x37, 480x640)
    assert len(prefix.deterministic_prefix(transforms[1:], cacheable=cacheable)) == (2 if how == "none" else 0)
    assert transforms[0].random_generator is not prefix.SEALED_GENERATOR  # sealed copies; the pipeline's own untouched


def test_a_prefix_that_draws_only_for_some_inputs_raises_on_those():
    """CenterCrop(3, 3, pad random) draws nothing on the probes (none is under 3x3) but draws a pad
    offset for a 2x2 image: apply_prefix raises there (the worker then runs the whole pipeline)."""
    crop = A.CenterCrop(3, 3, pad_if_needed=True, pad_position="random")
    s = prefix.split(_compose(crop, A.HorizontalFlip())[1], None)
    assert len(s.prefix) == 1
    assert s.apply_prefix(np.zeros((5, 4, 3), np.uint8)).shape == (3, 3, 3)
    with pytest.raises(prefix.RandomDrawn, match="drew from its random.Random"):
        s.apply_prefix(np.zeros((2, 2, 3), np.uint8))


@pytest.mark.parametrize("transform", [
    A.Resize(20, 30), A.LongestMaxSize(40), A.SmallestMaxSize(16), A.CenterCrop(20, 20),
    A.CenterCrop(90, 90, pad_if_needed=True), A.PadIfNeeded(90, 90), A.ToGray(p=1),
], ids=repr)
def test_the_prefix_never_writes_its_input(transform):
    """The worker runs the whole pipeline on the decoded image after a prefix raised RandomDrawn
    part way (server/compute/worker.py ``_through_cache``): the prefix must have left it as it was."""
    s = prefix.split(_compose(transform, A.HorizontalFlip())[1], None)
    assert len(s.prefix) == 1
    image = np.random.default_rng(1).integers(0, 256, (60, 70, 3), np.uint8)
    before = image.copy()
    s.apply_prefix(image)
    assert np.array_equal(image, before)
