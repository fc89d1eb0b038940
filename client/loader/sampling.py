"""Weighted sampling and dataset mixing as a loader asks for them: ``WeightedRandomSampler``, ``Mix``.

Both are plain objects checked on construction (ValueError naming the argument and the value) that
say what the epoch's order is; the server draws it (``batchd.sampler``: the formulas, shared with
the server) and every batch stays a pure function of the request, so ranks, exact and elastic
resume, several servers, hedging and sharing between identical loaders work as for a plain epoch
(docs/sampling.md). The loader reads them here (``resolve``, ``epoch_length``, ``settings``); what
goes on the wire is ``batchd.client.transport.orders``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Callable

import numpy as np

from batchd.sampler import check_draw, check_weights, weights_digest
from batchd.v1 import loader_pb2 as pb

DATASET = "dataset"  # WeightedRandomSampler("dataset", n): the weights the server's config gives the dataset

class WeightedRandomSampler:
    """Draw each epoch's samples by weight: ``torch.utils.data.WeightedRandomSampler``'s arguments
    and meaning, passed as ``RemoteDataLoader(..., sampler=...)``.

    weights: one non-negative float per sample of the dataset (a sequence, a numpy array or a CPU
        tensor; float64 on the wire), or ``"dataset"``: the weights the server's config gives the
        dataset (a manifest's ``weight_column``, a python dataset's ``weights``).
    num_samples: draws per epoch (``len(loader)`` counts their batches), >= 1.
    replacement: True: each draw picks sample i with probability weights[i] / sum(weights), so a
        sample may come several times in an epoch (each time with its own augmentation: its
        random stream is keyed to its position in the epoch). False: no sample twice
        (num_samples at most the samples of non-zero weight).

    The epoch's draw is a pure function of (the loader's seed, epoch, weights, num_samples,
    replacement): ``batchd.sampler.weighted_draw`` (docs/sampling.md gives the formula). Raises
    ValueError for weights that are not one-dimensional, empty, negative, NaN or infinite, or
    all zero, num_samples < 1, or replacement=False with num_samples above the non-zero weights.
    """

    __slots__ = ("weights", "num_samples", "replacement", "digest", "nonzero")

    def __init__(self, weights: Any, num_samples: int, replacement: bool = True):
        if not isinstance(replacement, bool):
            raise ValueError(f"replacement must be True or False, got {replacement!r}")
        if isinstance(weights, str):
            if weights != DATASET:
                raise ValueError(f"weights must be numbers, one per sample, or {DATASET!r} (the dataset's own on the "
                                 f"server), got {weights!r}")
            self.weights, self.digest, self.nonzero = None, "", None
            check_draw(num_samples, True, 0)
        else:
            if hasattr(weights, "detach"):  # a torch tensor, on any device
                weights = weights.detach().cpu().numpy()
            w = check_weights(weights).copy()
            w.flags.writeable = False
            self.weights, self.digest, self.nonzero = w, weights_digest(w), int(np.count_nonzero(w))
            check_draw(num_samples, replacement, self.nonzero)
        self.num_samples = int(num_samples)
        self.replacement = replacement

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        what = repr(DATASET) if self.weights is None else f"<{len(self.weights)} weights {self.digest[:12]}>"
        return f"WeightedRandomSampler({what}, num_samples={self.num_samples}, replacement={self.replacement})"

    def wire(self) -> pb.WeightedSampler:
        """The request's ``sampler``: the weights by digest (sent once with ``put_weights``)."""
        return pb.WeightedSampler(weights_digest=self.digest, dataset_weights=self.weights is None,
                                  num_samples=self.num_samples, replacement=self.replacement)


class Mix:
    """Several datasets mixed at set proportions, passed as ``RemoteDataLoader``'s dataset.

    sources: ``{dataset name: weight}`` (finite, >= 0, not all zero; normalised to proportions),
        in the order that numbers them: a batch's ``source`` int64 [B] is each sample's source's
        place in this mapping, and its ``index`` the sample's index in that source.
    num_samples: positions per epoch, >= 1. Each picks a source by weight and takes the next
        sample of that source's own shuffled order: no sample of a source comes twice before all
        of it came, then its next pass begins (a small source repeats, a large one is not
        exhausted). ``batchd.sampler.mix_draw`` is the formula (docs/sampling.md).

    Per-source pipelines: ``transform={name: pipeline}`` (a source left out gets none), as long as
    the sources' samples collate (the same fields and dtypes; stacked fields the same shapes).
    ``loader.info`` describes the mix and, in ``info.sources``, every source. Raises ValueError
    for no source, a name that is not a non-empty str, a weight that is negative, NaN or
    infinite, weights summing to zero, or num_samples < 1; an unknown source is a ValueError
    when the loader describes the sources (nothing starts).
    """

    __slots__ = ("sources", "num_samples")

    def __init__(self, sources: Mapping[str, float], *, num_samples: int):
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError(f"Mix: sources must be a non-empty mapping {{dataset name: weight}}, got {sources!r}")
        checked: dict[str, float] = {}
        for name, weight in sources.items():
            if not isinstance(name, str) or not name:
                raise ValueError(f"Mix: a source must be a dataset name (a non-empty str), got {name!r}")
            try:
                w = float(weight)
            except (TypeError, ValueError):
                raise ValueError(f"Mix: source {name!r} has weight {weight!r}; give a non-negative number") from None
            if not math.isfinite(w) or w < 0:
                raise ValueError(f"Mix: source {name!r} has weight {weight!r}; weights must be finite and non-negative")
            checked[name] = w
        if sum(checked.values()) <= 0:
            raise ValueError(f"Mix: the sources' weights sum to zero ({checked}); at least one must be positive")
        check_draw(num_samples, True, 0, what="Mix num_samples")
        self.sources = checked
        self.num_samples = int(num_samples)

    @property
    def name(self) -> str:
        """How the loader names the mix (its ``dataset``, logs and stats): ``mix(a,b,c)``."""
        return "mix(" + ",".join(self.sources) + ")"

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return f"Mix({self.sources!r}, num_samples={self.num_samples})"


# --- what the loader reads of them ---------------------------------------------------------------


def resolve(dataset: Any, transform: Any, sampler: Any, shuffle: Any,
            pipeline_of: Callable[[Any], pb.Pipeline | None]) -> dict[str, Any]:
    """``LoaderOptions`` fields from ``RemoteDataLoader``'s dataset, transform and sampler: the
    dataset's name (a mix's ``Mix.name``), ``pipeline``, ``sampler``, ``mix`` and ``source_pipelines``
    (a mix's per-source pipelines, wire form). Raises ValueError: a sampler that is not a
    ``batchd.WeightedRandomSampler``, a sampler with shuffle=True or with a Mix, a transform
    mapping for a single dataset or naming a dataset the mix does not have."""
    if sampler is not None and not isinstance(sampler, WeightedRandomSampler):
        raise ValueError(f"sampler must be None or a batchd.WeightedRandomSampler (the same arguments as torch's), "
                         f"got {type(sampler).__name__}: the server draws the order, so it must be one it knows")
    if sampler is not None and shuffle:
        raise ValueError("sampler option is mutually exclusive with shuffle (as in DataLoader): the sampler draws "
                         "the order; pass shuffle=False")
    if not isinstance(dataset, Mix):
        if isinstance(transform, Mapping):
            raise ValueError("transform as a mapping {source: pipeline} is for a batchd.Mix; give one pipeline")
        return {"dataset": dataset, "pipeline": pipeline_of(transform), "sampler": sampler}
    if sampler is not None:
        raise ValueError("a Mix draws its own order: it takes no sampler")
    if shuffle:
        raise ValueError("a Mix draws its own order (each source shuffled): pass shuffle=False")
    if not isinstance(transform, Mapping):
        transform = dict.fromkeys(dataset.sources, transform)  # one pipeline for every source
    unknown = [n for n in transform if n not in dataset.sources]
    if unknown:
        raise ValueError(f"transform names {unknown[0]!r}, which is not a source of the mix "
                         f"({', '.join(dataset.sources)})")
    per_source = {n: pipeline_of(transform.get(n)) for n in dataset.sources}
    return {"dataset": dataset.name, "pipeline": None, "mix": dataset, "source_pipelines": per_source}


def epoch_length(options: Any, info: Any) -> int:
    """Samples per epoch (what positions, padding, shards and batches count): the sampler's or the
    mix's ``num_samples``, else the dataset's size."""
    drawn = getattr(options, "sampler", None) or getattr(options, "mix", None)
    return drawn.num_samples if drawn is not None else info.num_samples


def settings(options: Any) -> dict[str, Any]:
    """What ``state_dict`` records of the sampler or mix (a state resumes only with the same):
    {} for a plain loader."""
    sampler, mix = getattr(options, "sampler", None), getattr(options, "mix", None)
    if sampler is not None:
        return {"sampler": {"weights": sampler.digest or DATASET, "num_samples": sampler.num_samples,
                            "replacement": sampler.replacement}}
    if mix is not None:
        return {"mix": {"sources": dict(mix.sources), "num_samples": mix.num_samples,
                        "pipelines": {n: "" if p is None else p.SerializeToString(deterministic=True).hex()
                                      for n, p in options.source_pipelines.items()}}}
    return {}
