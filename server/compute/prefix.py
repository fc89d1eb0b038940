"""Split a pipeline into its deterministic prefix (cacheable) and its random rest.

A sample's pixels are ``rest(prefix(decode(bytes, min_size)))``. The prefix is decode (at the
reduced size ``pipeline.decode_min_size`` allows, when it applies) plus the pipeline's leading
transforms that draw no random number and depend on nothing but their input: an explicit vetted
list (``VETTED``), each with ``p=1`` and no parameter chosen at random (``PadIfNeeded`` with
``position="random"`` and ``Longest/SmallestMaxSize`` with several ``max_size`` values are
random). The first transform not on the list ends the prefix; nested compositions (``OneOf``,
``Sequential``...) always do.

Bytes do not change: albumentations' ``Compose.__call__`` draws one ``random()`` before its
transforms (even at ``p=1``), a vetted transform at ``p=1`` draws none, so applying the prefix
transforms one by one and then ``rest`` (a ``Compose`` with the same settings and the remaining
transforms) consumes the sample's random stream exactly as the whole ``Compose`` did
(tests/compute/test_prefix.py checks the bytes). A top-level ``Compose`` with ``p < 1`` may skip every
transform, so its prefix is decode alone.

``canonical`` names the prefix for cache keys: the decode size and the prefix transforms'
``A.to_dict`` as canonical JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import albumentations as A
import numpy as np

VETTED = (A.Resize, A.LongestMaxSize, A.SmallestMaxSize, A.CenterCrop, A.PadIfNeeded, A.ToGray)


@dataclass(frozen=True, slots=True)
class Split:
    """A pipeline split in two.

    prefix: the deterministic leading transforms (applied one by one, each at p=1).
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
        """The prefix transforms applied to a decoded uint8 [H, W, C] image (a new array)."""
        for t in self.prefix:
            image = t(image=image)["image"]
        return image


def _deterministic(t: Any) -> bool:
    """True if ``t`` is a vetted transform that, as configured, draws no random number."""
    if type(t) not in VETTED or getattr(t, "p", 0.0) < 1.0:
        return False
    if isinstance(t, A.PadIfNeeded) and getattr(t, "position", "center") == "random":
        return False
    if isinstance(t, (A.LongestMaxSize, A.SmallestMaxSize)):
        size = t.max_size
        if isinstance(size, (list, tuple)) and len(size) != 1:
            return False
    return True


def prefix_length(compose: A.Compose | None) -> int:
    """How many leading transforms of ``compose`` form its deterministic prefix (0 for None)."""
    if compose is None or getattr(compose, "p", 1.0) < 1.0:
        return 0
    n = 0
    for t in compose.transforms:
        if not _deterministic(t):
            break
        n += 1
    return n


def split(compose: A.Compose | None, min_size: tuple[int, int] | None) -> Split:
    """Split ``compose`` (as ``pipeline.build`` returns it, or None) in prefix and rest.

    min_size: the decode size the worker uses for this pipeline (None: full size); it is part
    of the prefix. Raises ValueError if the rest cannot be rebuilt by albumentations.
    """
    n = prefix_length(compose)
    prefix = tuple(compose.transforms[:n]) if compose is not None else ()
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
