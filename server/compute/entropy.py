"""Transforms whose randomness albumentations narrows to a small seed, widened to the sample's stream.

A sample's stream (server/compute/pipeline.py ``SampleRandom``) has far more entropy than some
transforms pass on. In the installed albumentations (2.0.x):

- ``GaussNoise`` seeds OpenCV's generator with ``random_generator.integers(0, 2**16)`` and
  draws its noise with ``cv2.randn``: 65,536 noise patterns, so among 3,000 samples about 69
  pairs got byte-identical noise. (``cv2.setRNGSeed`` takes a C ``int``: OpenCV's generator
  cannot take more than 32 bits.)
- ``ISONoise``, ``CoarseDropout`` and ``GridDropout`` draw ``integers(0, 2**32 - 1)`` and seed a
  numpy Generator with it for their noise (ISONoise) or ``fill="random"`` values (the dropouts):
  about 190 pairs of equal noise per 1.28 million samples (an ImageNet epoch).

``widen(compose)`` turns each such transform of a built pipeline into the subclass below, which
keeps every parameter and the distribution but gives the noise 128 bits of seed: ``wide_seed``,
a BLAKE2b hash of the sample's stream state at that point (its Philox key and counter: unique to
the sample and to the draw) and of albumentations' own narrow seed. ``GaussNoise`` draws its normal
deviates from a numpy generator of that seed (not OpenCV's); the others seed their generator
with it. Each still makes exactly the draws albumentations' own makes from the shared stream
(GaussNoise: its sigma, mean and ``integers(0, 2**16)``; the others their ``integers(0, 2**32 -
1)``) and no more: so every transform after it draws what it draws in a plain Compose (before,
the extra draws shifted them: a dropout then a flip flipped other samples than albumentations'),
and only the noise or fill values themselves differ from albumentations' bytes (constant fills,
the default, are the same bytes). ``pipeline.build`` widens every pipeline the server builds.
The statistics are albumentations' (tests/compute/test_noise_entropy.py compares them, and
counts repeated noise over 3,000 samples for each transform here). The list is complete for the allowlist:
tests/compute/test_rng_audit.py finds every allowlisted transform that reaches OpenCV's
generator or seeds a generator of its own, in the installed albumentations' source.
"""

from __future__ import annotations

import hashlib
from typing import Any

import albumentations as A
import cv2
import numpy as np
from albucore import MAX_VALUES_BY_DTYPE
from albumentations.augmentations.geometric import functional as fgeometric


def wide_seed(generator: np.random.Generator, narrow: int) -> int:
    """A 128-bit seed for ``np.random.default_rng``, drawing nothing from ``generator``: BLAKE2b
    (16 bytes) of its bit generator's state (for the sample's Philox: the epoch's key and the
    counter, so distinct for every sample and every point of its stream) and of ``narrow``, the
    seed albumentations drew. Cost: a few microseconds (the state dict)."""
    digest = hashlib.blake2b(digest_size=16)
    _feed(digest, generator.bit_generator.state)
    digest.update(int(narrow).to_bytes(16, "little", signed=True))
    return int.from_bytes(digest.digest(), "little")


def _feed(digest: Any, value: Any) -> None:
    """Feed a bit generator's state (nested dicts of str, ints and uint64 arrays) to ``digest``."""
    if isinstance(value, dict):
        for k in sorted(value):
            digest.update(str(k).encode() + b"=")
            _feed(digest, value[k])
    elif isinstance(value, np.ndarray):
        digest.update(np.ascontiguousarray(value).tobytes())
    else:
        digest.update(repr(value).encode() + b";")


class GaussNoise(A.GaussNoise):
    """``A.GaussNoise`` with its noise drawn from a numpy generator seeded by ``wide_seed``, not
    OpenCV's 16-bit-seeded generator: ``(mean + sigma * N(0, 1)) * max_value`` per pixel and channel
    (``per_channel``) or per pixel, shared by the channels; at ``noise_scale_factor < 1`` drawn
    at that fraction of the size and resized (bilinear), as albumentations does."""

    def get_params_dependent_on_data(self, params: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        image = data["image"] if "image" in data else data["images"][0]
        max_value = MAX_VALUES_BY_DTYPE[image.dtype]
        sigma = self.py_random.uniform(*self.std_range)
        mean = self.py_random.uniform(*self.mean_range)
        height, width = image.shape[:2]
        channels = image.shape[2:] if self.per_channel else ()
        if self.noise_scale_factor < 1:
            size = (max(1, int(height * self.noise_scale_factor)), max(1, int(width * self.noise_scale_factor)))
        else:
            size = (height, width)
        narrow = self.random_generator.integers(0, 2**16)  # albumentations' draw (generate_noise): the same stream after
        noise_rng = np.random.default_rng(wide_seed(self.random_generator, narrow))
        noise = (mean + sigma * noise_rng.standard_normal((*size, *channels), dtype=np.float32)) * max_value
        if size != (height, width):
            noise = fgeometric.resize(noise, (height, width), interpolation=cv2.INTER_LINEAR)
        if image.ndim > 2 and not self.per_channel:
            noise = np.broadcast_to(noise[..., None], image.shape)
        return {"noise_map": noise}


class _WideSeed:
    """Replaces the 32-bit seed albumentations puts in ``params[SEED]`` (drawn from the stream)
    by ``wide_seed``'s 128 bits (which draws nothing more)."""

    SEED = "seed"

    def get_params_dependent_on_data(self, params: dict[str, Any], data: dict[str, Any]) -> dict[str, Any]:
        out = super().get_params_dependent_on_data(params, data)
        out[self.SEED] = wide_seed(self.random_generator, out[self.SEED])
        return out


class ISONoise(_WideSeed, A.ISONoise):
    """``A.ISONoise`` with a 128-bit seed for its noise generator."""

    SEED = "random_seed"


class CoarseDropout(_WideSeed, A.CoarseDropout):
    """``A.CoarseDropout`` with a 128-bit seed for its random fill."""


class GridDropout(_WideSeed, A.GridDropout):
    """``A.GridDropout`` with a 128-bit seed for its random fill."""


WIDENED: dict[type, type] = {A.GaussNoise: GaussNoise, A.ISONoise: ISONoise, A.CoarseDropout: CoarseDropout,
                             A.GridDropout: GridDropout}


def widen(transform: Any) -> None:
    """Turn, in place, every transform of ``transform`` (a Compose, nested ones included, or a
    single transform) whose type is a key of ``WIDENED`` into its widened subclass."""
    wide = WIDENED.get(type(transform))
    if wide is not None:
        transform.__class__ = wide
    for child in getattr(transform, "transforms", ()):
        widen(child)
