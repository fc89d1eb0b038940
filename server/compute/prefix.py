"""Split a pipeline into its deterministic prefix (cacheable) and its random rest.

A sample's pixels are ``rest(prefix(decode(bytes, min_size)))``. The prefix is decode (at the
reduced size ``pipeline.decode_min_size`` allows, when it applies) plus the pipeline's leading
transforms that draw no random number. Whether a transform draws is decided by construction, not
by a list of rules (``PREFIX_RULES`` names the rule; it is part of the build fingerprint):

1. Its type must be one worth caching (``CACHEABLE``: transforms that resize, crop, pad or
   turn grey; a filter for cost, not for safety). The first transform of another type ends the
   prefix; nested compositions (``OneOf``, ``Sequential``...) always do.
2. A copy of it is *sealed*: its numpy Generator and its ``random.Random`` (what
   ``set_random_state`` hands every albumentations transform, and what its unseeded generators
   of its own are replaced by) raise ``RandomDrawn`` on any use. It is run, twice, on probe
   images (``PROBE_SIZES``: 3x5, 29x37 and 480x640, one and three channels; each probe is the
   previous transform's output). It is deterministic if no probe drew, the two runs agreed
   (an unseeded generator created on the fly would make them differ), numpy's and Python's
   module-level generators and OpenCV's are left as they were, and at least one probe was
   accepted (a probe the transform refuses, e.g. a crop larger than the image, is no evidence).
   ``p < 1`` draws (``should_apply``), and so do ``LongestMaxSize(max_size=[32])`` (albumentations
   calls ``py_random.choice`` even on one element) and ``CenterCrop(pad_if_needed=True,
   pad_position="random")`` on an image smaller than the crop: they end the prefix.

For every sample, not only the probes: the prefix transforms stay sealed, so a transform that
draws only for some inputs (a random pad position, needed only below the crop size) raises
``RandomDrawn`` on the first sample it would draw for; the worker then builds that sample with
the whole pipeline and the sample's own stream, uncached (server/compute/worker.py). An entry in
the cache is therefore always the output of a prefix that drew nothing *on that very sample*.
Module-level generators are checked on the probes only: no ``CACHEABLE`` type, nor any function
of the installed albumentations it calls, uses them (tests/compute/test_rng_audit.py
``test_no_cacheable_transform_reads_a_module_level_generator`` reads the source).

Bytes do not change: albumentations' ``Compose.__call__`` draws one ``random()`` before its
transforms (even at ``p=1``) and a prefix transform draws none for the sample, so applying the
prefix transforms one by one and then ``rest`` (a ``Compose`` with the same settings and the
remaining transforms) consumes the sample's random stream exactly as the whole ``Compose`` did
(tests/compute/test_prefix.py checks the bytes; tests/data/test_cache_bytes.py through servers).
That holds for the image; for boxes and keypoints two Composes would convert, clip and filter
them between the two (other boxes under ``check_each_transform: false``, other rounding), so the
worker runs ONE Compose in two stages instead (server/compute/targets.py, ``TargetPipeline``).
A top-level ``Compose`` with ``p < 1`` may skip every transform, so its prefix is decode alone.

``canonical`` names the prefix for cache keys: the decode size and the prefix transforms'
``A.to_dict`` as canonical JSON.
"""

from __future__ import annotations

import copy
import functools
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import albumentations as A
import cv2
import numpy as np

# version of the rule that decides the prefix, in the build fingerprint (server/compute/build.py):
# 1: a vetted list of types and parameters; 2: types as a filter, then proven by running sealed;
# 3: as 2, and what is cached is the state of one Compose run in two stages (targets.py: boxes
# and keypoints in albumentations' internal format), no longer a Compose of the prefix's output
PREFIX_RULES = "3"

CACHEABLE = (A.Resize, A.LongestMaxSize, A.SmallestMaxSize, A.CenterCrop, A.PadIfNeeded, A.ToGray)

PROBE_SIZES = ((3, 5), (29, 37), (480, 640))
_CV2_CANARY_SEED = 0x5EED


class RandomDrawn(RuntimeError):
    """A transform run as part of a cached prefix drew a random number (it is not deterministic)."""


class _Sealed:
    """Stands in for a numpy Generator or a ``random.Random``: any use raises RandomDrawn."""

    __slots__ = ("_what",)

    def __init__(self, what: str):
        self._what = what

    def __getattr__(self, name: str):
        if name.startswith("__"):  # copy, pickle and repr look these up: not a draw
            raise AttributeError(name)
        raise RandomDrawn(f"a cached prefix transform drew from its {self._what} ({name})")

    def __deepcopy__(self, memo) -> "_Sealed":
        return self


SEALED_GENERATOR = _Sealed("numpy Generator")
SEALED_RANDOM = _Sealed("random.Random")


def sealed(transform: Any) -> Any:
    """A deep copy of ``transform`` whose generators raise RandomDrawn when drawn from. Its own
    generators are not copied (one attached to a worker's stream cannot be: ``pipeline.SampleRandom``)."""
    memo = {id(g): s for g, s in ((getattr(transform, "random_generator", None), SEALED_GENERATOR),
                                  (getattr(transform, "py_random", None), SEALED_RANDOM)) if g is not None}
    t = copy.deepcopy(transform, memo)
    t.set_random_state(SEALED_GENERATOR, SEALED_RANDOM)
    return t


def probes(sizes: Sequence[tuple[int, int]] = PROBE_SIZES, channels: Sequence[int] = (3, 1)) -> list[np.ndarray]:
    """Probe images: uint8 [H, W, C] noise (fixed seed) for each size and channel count."""
    rng = np.random.default_rng(0)
    return [rng.integers(0, 256, (h, w, c), np.uint8) for h, w in sizes for c in channels]


class _ModuleGenerators:
    """Whether numpy's, Python's or OpenCV's module-level generator was drawn from between
    ``__init__`` and ``drawn()`` (by comparing their states; ~0.1 ms)."""

    def __init__(self):
        self.cv2 = _cv2_first_draw()
        self.numpy = np.random.get_state()
        self.python = random.getstate()
        cv2.setRNGSeed(_CV2_CANARY_SEED)

    def drawn(self) -> str | None:
        """Which generator was drawn from, or None."""
        numpy = np.random.get_state()
        if numpy[2:] != self.numpy[2:] or not np.array_equal(numpy[1], self.numpy[1]):
            return "numpy's module-level generator"
        if random.getstate() != self.python:
            return "Python's module-level generator"
        cv2_next = np.zeros((1, 1), np.float64)
        cv2.randu(cv2_next, 0.0, 1.0)
        if float(cv2_next[0, 0]) != self.cv2:
            return "OpenCV's generator"
        return None


@functools.cache
def _cv2_first_draw() -> float:
    """The first double OpenCV's generator gives after ``setRNGSeed(_CV2_CANARY_SEED)``."""
    cv2.setRNGSeed(_CV2_CANARY_SEED)
    out = np.zeros((1, 1), np.float64)
    cv2.randu(out, 0.0, 1.0)
    return float(out[0, 0])


def _proven(t: Any, inputs: list[np.ndarray]) -> list[np.ndarray] | None:
    """The outputs of sealed transform ``t`` on ``inputs`` (those it accepts), or None if it
    drew, gave two outputs for one input, or accepted none."""
    outputs = []
    for image in inputs:
        watch = _ModuleGenerators()
        try:
            first = t(image=image)["image"]
            second = t(image=image)["image"]
        except RandomDrawn:
            return None
        except Exception:  # e.g. a crop larger than the probe: it refuses this input
            first = second = None
        if watch.drawn():
            return None
        if first is None:
            continue
        if not (isinstance(first, np.ndarray) and first.dtype == second.dtype and np.array_equal(first, second)):
            return None
        outputs.append(first)
    return outputs or None


def deterministic_prefix(transforms: Sequence[Any], inputs: list[np.ndarray] | None = None,
                         cacheable: tuple[type, ...] = CACHEABLE) -> tuple[Any, ...]:
    """Sealed copies of the leading ``transforms`` proven to draw nothing (see the module
    docstring), run on ``inputs`` (default ``probes()``) in turn; the first transform whose
    type is not in ``cacheable`` ends them. Never raises for a transform that fails on a probe
    (that transform just ends the prefix)."""
    inputs = probes() if inputs is None else inputs
    proven = []
    for t in transforms:
        if type(t) not in cacheable:
            break
        s = sealed(t)
        inputs = _proven(s, inputs)
        if inputs is None:
            break
        proven.append(s)
    return tuple(proven)


@dataclass(frozen=True, slots=True)
class Split:
    """A pipeline split in two.

    prefix: the deterministic leading transforms, sealed copies (applied one by one, each at p=1).
    rest: a Compose of the remaining transforms with the original Compose's settings, or None
        when nothing remains (or there was no pipeline).
    min_size: (height, width) a JPEG may be decoded down to, or None (full size).
    canonical: text naming decode size and prefix transforms: equal text, equal prefix output.
    """

    prefix: tuple[Any, ...]
    rest: A.Compose | None
    min_size: tuple[int, int] | None
    canonical: str

    def apply_prefix(self, image: np.ndarray) -> np.ndarray:
        """The prefix transforms applied to a decoded uint8 [H, W, C] image (a new array or a
        view; ``image`` is not written). Raises RandomDrawn if a transform would draw a random
        number for this image (its output then must not be cached), or what a transform raises."""
        for t in self.prefix:
            image = t(image=image)["image"]
        return image


def prefix_length(compose: A.Compose | None) -> int:
    """How many leading transforms of ``compose`` form its deterministic prefix (0 for None)."""
    return len(_prefix(compose))


def _prefix(compose: A.Compose | None) -> tuple[Any, ...]:
    if compose is None or getattr(compose, "p", 1.0) < 1.0:
        return ()
    return deterministic_prefix(compose.transforms)


def split(compose: A.Compose | None, min_size: tuple[int, int] | None) -> Split:
    """Split ``compose`` (as ``pipeline.build`` returns it, or None) in prefix and rest.

    min_size: the decode size the worker uses for this pipeline (None: full size); it is part
    of the prefix. Raises ValueError if the rest cannot be rebuilt by albumentations.
    """
    prefix = _prefix(compose)
    n = len(prefix)
    if compose is None:
        rest = None
    elif n == 0:
        rest = compose
    elif n == len(compose.transforms):
        rest = None
    else:
        spec = A.to_dict(compose)
        spec["transform"]["transforms"] = spec["transform"]["transforms"][n:]
        try:
            rest = A.from_dict(spec)
        except Exception as e:  # albumentations raises ValueError, KeyError, pydantic errors...
            raise ValueError(f"cannot rebuild the pipeline after its first {n} transforms: {type(e).__name__}: {e}") from None
    return Split(prefix, rest, min_size, canonical(prefix, min_size))


def canonical(prefix: tuple[Any, ...], min_size: tuple[int, int] | None) -> str:
    """Canonical text of a prefix: decode size and each transform's ``to_dict`` (sorted keys)."""
    parts = [t.to_dict()["transform"] for t in prefix]
    return json.dumps({"decode_min_size": list(min_size) if min_size else None, "transforms": parts},
                      sort_keys=True, separators=(",", ":"), default=str)
