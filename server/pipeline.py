"""Albumentations pipelines: parsed from their own serialized form, cached by content, seeded per batch.

A pipeline travels as canonical JSON (``json.dumps(A.to_dict(compose), sort_keys=True)``); its
key is the SHA-256 of that text, so workers build each distinct pipeline once.

Seeding: before building batch ``b`` the worker calls ``compose.set_random_seed(s)`` with
``s = batchd.sampler.batch_seed(seed, epoch, batch_index=b, rank, world_size)`` and then applies
the pipeline to the batch's samples in order. Measured cost on this project's 2-core machine:
about 80 us per call, once per batch (under 0.1% of a 64-image L3 batch).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import albumentations as A


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
    return transform


def decode_min_size(compose: A.Compose | None) -> tuple[int, int] | None:
    """(height, width) an image may be decoded down to, if the pipeline starts by resizing.

    ``Resize(h, w)`` -> (h, w); ``SmallestMaxSize(s)`` -> (s, s). Anything else (crops first,
    ``LongestMaxSize``, no pipeline) -> None: decode at full size.
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
    return None
