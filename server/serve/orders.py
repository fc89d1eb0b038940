"""An epoch's order as a request asks for it: a permutation, a weighted draw or a mix.

``batchd.sampler`` defines the three (the reference formulas, shared with the client); this module
checks what a request names against the datasets and the weights the server holds (``check_sampler``,
``check_mix``: ValueError naming the argument and its value, answered INVALID_ARGUMENT, before
anything starts) and computes one shard of the order (``shard``). The epoch's length is the
dataset's size for a plain epoch and ``num_samples`` for a weighted or mixed one; positions,
padding, sharding and start_position then count it alike.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from typing import Callable

import numpy as np

from batchd.sampler import check_draw, mix_draw, shard_indices, shard_of, weighted_draw
from batchd.server.compute.protocol import MixSpec, StreamRequest
from batchd.server.data.datasets import Dataset
from batchd.server.serve.weights import Weights, WeightsStore


def check_sampler(request: StreamRequest, ds: Dataset, store: WeightsStore,
                  dataset_weights: dict[str, Weights]) -> tuple[Weights, str]:
    """(the weights, the order key) of a weighted request. Raises ValueError naming what is wrong:
    shuffle set, num_samples < 1 or (without replacement) above the samples of non-zero weight,
    weights of another length than the dataset, a dataset without weights of its own (for
    ``dataset_weights``); WeightsNotFoundError when the store does not hold the digest named."""
    spec = request.sampler
    if request.shuffle:
        raise ValueError("shuffle must be false with a sampler: the sampler draws the epoch's order "
                         "(as DataLoader's sampler option is mutually exclusive with shuffle)")
    if spec.dataset_weights == bool(spec.weights_digest):
        raise ValueError("sampler: give either weights_digest or dataset_weights, one of them")
    if spec.dataset_weights:
        weights = dataset_weights.get(request.dataset)
        if weights is None:
            raise ValueError(f"sampler: dataset {request.dataset!r} has no weights of its own on this server "
                             "(a manifest's weight_column, a python dataset's weights); send them with the sampler")
    else:
        weights = store.get(spec.weights_digest)
    if len(weights.values) != len(ds):
        raise ValueError(f"sampler: weights has {len(weights.values)} entries but dataset {request.dataset!r} has "
                         f"{len(ds)} samples; give one weight per sample")
    check_draw(spec.num_samples, spec.replacement, weights.nonzero, what="sampler num_samples")
    return weights, f"weighted/{weights.digest}/{spec.num_samples}/{int(spec.replacement)}"


def check_mix(request: StreamRequest, dataset: Callable[[str], Dataset],
              pipeline: Callable[[str, str], tuple[str, str, str]]) -> tuple[MixSpec, str]:
    """The request's mix with each source's pipeline resolved, and its order key. ``dataset(name)``
    is the server's dataset (DatasetNotFoundError); ``pipeline(preset, json)`` gives (name,
    canonical JSON, key) and raises ValueError. Raises ValueError naming the source and value:
    shuffle set, a pipeline or dataset beside the sources, no source, an unknown or repeated
    source, a weight that is negative, NaN or infinite, weights summing to zero, num_samples < 1,
    an empty source or one whose samples have a field ``source``, image_encoding JPEG."""
    mix = request.mix
    if request.shuffle:
        raise ValueError("shuffle must be false with a mix: the mix draws the epoch's order")
    if request.preset or request.albumentations_json:
        raise ValueError("a mix takes a pipeline per source (MixSource.pipeline), not the request's pipeline")
    if request.image_encoding != "decoded":
        raise ValueError("image_encoding JPEG is not available for a mix; ask for decoded images "
                         "(decode_on_client=False)")
    if not mix.sources:
        raise ValueError("mix: give at least one source")
    check_draw(mix.num_samples, True, 1, what="mix num_samples")
    seen: set[str] = set()
    sources = []
    for s in mix.sources:
        if s.dataset in seen:
            raise ValueError(f"mix: source {s.dataset!r} is named twice")
        seen.add(s.dataset)
        if not math.isfinite(s.weight) or s.weight < 0:
            raise ValueError(f"mix: source {s.dataset!r} has weight {s.weight!r}; weights must be finite and "
                             "non-negative")
        try:
            ds = dataset(s.dataset)
        except LookupError:
            raise ValueError(f"mix: unknown source {s.dataset!r}: this server has no dataset of that name") from None
        if len(ds) == 0:
            raise ValueError(f"mix: source {s.dataset!r} has no samples")
        if any(f.name == "source" for f in ds.fields):
            raise ValueError(f"mix: source {s.dataset!r} has a field 'source', which a mix adds (each sample's "
                             "source); rename the field to mix this dataset")
        try:
            name, text, key = pipeline(s.preset, s.albumentations_json)
        except ValueError as e:
            raise ValueError(f"mix: source {s.dataset!r}: {e}") from None
        sources.append(dataclasses.replace(s, pipeline_name=name, pipeline_json=text, pipeline_key=key))
    if sum(s.weight for s in mix.sources) <= 0:
        raise ValueError(f"mix: the sources' weights sum to zero ({', '.join(f'{s.dataset}={s.weight:g}' for s in mix.sources)}); "
                         "at least one must be positive")
    resolved = MixSpec(tuple(sources), mix.num_samples)
    described = json.dumps([[[s.dataset, float(s.weight).hex(), s.pipeline_key] for s in sources], mix.num_samples])
    return resolved, "mix/" + hashlib.sha256(described.encode()).hexdigest()


def epoch_length(request: StreamRequest, num_samples: int) -> int:
    """Samples in one epoch: ``num_samples`` (the dataset's) for a plain epoch, the sampler's or the
    mix's ``num_samples`` otherwise."""
    if request.sampler is not None:
        return request.sampler.num_samples
    if request.mix is not None:
        return request.mix.num_samples
    return num_samples


def shard(request: StreamRequest, num_samples: int, weights: Weights | None = None,
          sizes: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray | None]:
    """This request's shard of its epoch's order (from its start_position on): (sample indices int64
    [shard], sources int64 [shard] for a mix, else None). num_samples: the dataset's size (plain);
    weights: the sampler's (weighted); sizes: the sources' sizes (mix)."""
    r = request
    cut = dict(rank=r.rank, world_size=r.world_size, drop_last=r.drop_last, start_position=r.start_position)
    if r.mix is not None:
        source, index = mix_draw(sizes, [s.weight for s in r.mix.sources], r.mix.num_samples, seed=r.seed,
                                 epoch=r.epoch)
        return shard_of(index, **cut), shard_of(source, **cut)
    if r.sampler is not None:
        draw = weighted_draw(weights.values, r.sampler.num_samples, replacement=r.sampler.replacement, seed=r.seed,
                             epoch=r.epoch)
        return shard_of(draw, **cut), None
    return shard_indices(num_samples, shuffle=r.shuffle, seed=r.seed, epoch=r.epoch, **cut), None
