"""Albumentations pipelines: parsed from their own serialized form, cached by content, one random stream per sample.

A pipeline travels as canonical JSON (``json.dumps(A.to_dict(compose), sort_keys=True)``); its
key is the SHA-256 of that text, so workers build each distinct pipeline once.

Randomness: every sample gets its own stream, ``batchd.sampler.sample_stream(key, position)``
with ``key = sample_key(seed, epoch)`` and ``position`` the sample's place in the epoch's global
order (``global_positions``: ``rank + world_size * i``). The computation sends both with the task
(``Task.random_key``, ``Task.positions``). A worker holds one ``SampleRandom``: its numpy
Generator and a ``random.Random`` that draws from that same Generator are handed to the whole
pipeline once (``Compose.set_random_state`` shares the two objects with every transform, nested
composes included), and before each sample the Philox bit generator under them is re-keyed to the
sample's stream. So the transforms of a pipeline draw in turn from one stream (never a copy each,
which made albumentations' ``set_random_seed`` flip both ways or not at all), and a sample's
augmentation depends on nothing but (seed, epoch, position). Cost: bench/tables/table_seeding.py.
"""

from __future__ import annotations

import hashlib
import json
import random
from typing import Any

import albumentations as A
import numpy as np

from batchd.sampler import sample_stream_state
from batchd.server.compute.entropy import widen


def canonical_json(spec: dict[str, Any] | str | None) -> str:
    """Canonical JSON text of an ``A.to_dict`` dict ("" for no pipeline).

    Raises ValueError if a string is not JSON or not a JSON object.
    """
    if spec is None or spec == "":
        return ""
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"pipeline is not valid JSON: {e}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"pipeline must be a JSON object as A.to_dict returns, got {type(spec).__name__}")
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def pipeline_key(pipeline_json: str) -> str:
    return hashlib.sha256(pipeline_json.encode()).hexdigest()[:32] if pipeline_json else ""


def build(pipeline_json: str) -> A.Compose | None:
    """An ``A.Compose`` from canonical JSON (None for ""). A lone transform is wrapped in Compose.
    Transforms that narrow their randomness to a small seed are widened (``entropy.widen``).

    Raises ValueError naming what albumentations could not build.
    """
    if not pipeline_json:
        return None
    spec = json.loads(pipeline_json)
    if "transform" not in spec:
        raise ValueError("pipeline dict has no 'transform' key; send what A.to_dict(compose) returns")
    try:
        transform = A.from_dict(spec)
    except Exception as e:  # albumentations raises ValueError, KeyError, TypeError, pydantic errors...
        raise ValueError(f"albumentations cannot build the pipeline: {type(e).__name__}: {e}") from None
    if not isinstance(transform, A.Compose):
        transform = A.Compose([transform])
    widen(transform)
    return transform


def decode_min_size(compose: A.Compose | None) -> tuple[int, int] | None:
    """(height, width) an image may be decoded down to, if the pipeline starts by resizing.

    ``Resize(h, w)`` -> (h, w); ``SmallestMaxSize(s)`` -> (s, s); ``LongestMaxSize(s)`` -> (s,):
    at least the size that resize gives (``decode.min_dims``). Anything else (no pipeline, a
    list of sizes to draw from, ``max_size_hw``; a random crop first: decoded at the scale its
    drawn window needs, ``region.py``) -> None: decode at full size.
    """
    if compose is None or not compose.transforms:
        return None
    first = compose.transforms[0]
    if getattr(first, "p", 1.0) < 1.0:
        return None
    if isinstance(first, A.Resize):
        return int(first.height), int(first.width)
    if isinstance(first, A.SmallestMaxSize) and isinstance(first.max_size, int):
        return int(first.max_size), int(first.max_size)
    if isinstance(first, A.LongestMaxSize) and isinstance(first.max_size, int):
        return (int(first.max_size),)
    return None


class _GeneratorRandom(random.Random):
    """A ``random.Random`` whose draws come from a numpy Generator (one stream for both APIs).

    ``random()``, ``getrandbits()`` and ``gauss()`` draw from the generator; every other method
    (``uniform``, ``randint``, ``choice``, ``sample``, ``shuffle``...) is built on those by
    ``random.Random``. ``random()`` is the generator's own ``random()``: one double from the
    stream per call, no values held back, so re-keying the generator fully determines what this
    object returns (``gauss`` caches no second value either). Seeding it is a no-op.

    Speed: ``random`` is an instance attribute, the generator's bound C method, which shadows the
    method below (CPython's ``uniform`` calls ``self.random()``): 0.45 us a draw, no Python frame.
    Doubles drawn ahead in blocks cost less per draw but a new block iterator per sample, which
    cost more in the worker's loop (bench/tables/table_seeding.py; Fashion-MNIST's train preset makes
    6.6 ``random()`` calls per sample).
    """

    def __init__(self, generator: np.random.Generator):
        self._generator = generator
        self._raw = generator.bit_generator.random_raw
        super().__init__()
        self.random = generator.random

    def seed(self, a=None, version=2) -> None:  # random.Random.__init__ calls it; the generator is seeded elsewhere
        pass

    def random(self) -> float:  # shadowed per instance (see the class doc); here for calls through the class
        return self._generator.random()

    def getrandbits(self, k: int) -> int:
        if k < 0:
            raise ValueError("number of bits must be non-negative")
        value, bits = 0, 0
        while bits < k:
            value = (value << 64) | self._raw()
            bits += 64
        return value >> (bits - k)

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return mu + sigma * float(self._generator.standard_normal())

    def getstate(self):
        raise NotImplementedError("the state lives in the numpy Generator")

    def setstate(self, state) -> None:
        raise NotImplementedError("the state lives in the numpy Generator")


class SampleRandom:
    """One worker's random state for pipelines: re-keyed to each sample's own stream.

    ``generator`` (numpy, over one Philox) and ``py_random`` (drawing from ``generator``) are
    what every transform of a pipeline attached with ``attach`` draws from. ``start(key,
    position)`` makes them ``batchd.sampler.sample_stream(key, position)``.
    """

    def __init__(self):
        self._bit_generator = np.random.Philox(key=0)
        self.generator = np.random.Generator(self._bit_generator)
        self.py_random = _GeneratorRandom(self.generator)
        # sample_stream_state's dict with Python ints in lists: numpy's Philox state setter reads
        # them item by item, 0.8 us a re-key against 2.0 us with uint64 arrays
        state = sample_stream_state(np.zeros(2, np.uint64), 0)
        state["state"] = {"counter": state["state"]["counter"].tolist(), "key": [0, 0]}
        state["buffer"] = state["buffer"].tolist()
        self._state = state
        self._counter = state["state"]["counter"]

    def attach(self, compose: A.Compose) -> None:
        """Make every transform of ``compose`` (nested ones too) draw from this object's stream."""
        compose.set_random_state(self.generator, self.py_random)

    def start(self, key: np.ndarray, position: int) -> None:
        """Re-key to the stream of the sample at global ``position`` under ``key`` (uint64 [2]).

        Raises ValueError if position is not in [0, 2**63).
        """
        if not 0 <= position < 1 << 63:
            raise ValueError(f"sample position {position} is not in [0, 2**63)")
        self._state["state"]["key"] = key.tolist()
        self._counter[2] = position
        self._bit_generator.state = self._state  # numpy copies the values: the dict and lists are reused
