"""Weighted sampling and dataset mixing as a loader asks for them: ``WeightedRandomSampler``, ``Mix``.

Both are plain objects checked on construction (ValueError naming the argument and the value) that
say what the epoch's order is; the server draws it (``batchd.sampler``: the formulas, shared with
the server) and every batch stays a pure function of the request, so ranks, exact and elastic
resume, several servers, hedging and sharing between identical loaders work as for a plain epoch
(docs/sampling.md). The rest of this module is the glue the loader's files call: the options
(``resolve``), the dataset's description (``describe``: a mix's every source), the epoch's length
(``epoch_length``), what ``state_dict`` records (``settings``), the request's fields
(``apply``) and the weights' upload (``put_weights``, once per loader and server process).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any, Callable

import grpc
import numpy as np

from batchd.client.transport.channel import translate
from batchd.client.transport.datasets import DatasetInfo, describe as describe_one
from batchd.errors import DatasetNotFoundError
from batchd.sampler import check_draw, check_weights, weights_digest
from batchd.v1 import loader_pb2 as pb

PUT_WEIGHTS_METHOD = "/batchd.v1.BatchLoader/PutWeights"
CHUNK_WEIGHTS = 1 << 16  # weights per PutWeights chunk: 512 KiB, within a server's default max_request_bytes (1 MiB)
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


# --- the loader's glue ------------------------------------------------------------------------------


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
    if isinstance(transform, Mapping):
        unknown = [n for n in transform if n not in dataset.sources]
        if unknown:
            raise ValueError(f"transform names {unknown[0]!r}, which is not a source of the mix "
                             f"({', '.join(dataset.sources)})")
        per_source = {n: pipeline_of(transform.get(n)) for n in dataset.sources}
    else:
        per_source = {n: pipeline_of(transform) for n in dataset.sources}  # one pipeline for every source
    return {"dataset": dataset.name, "pipeline": None, "mix": dataset, "source_pipelines": per_source}


def describe(channel: grpc.Channel, address: str, options: Any, timeout: float) -> DatasetInfo:
    """The loader's ``info`` at ``address``: the dataset's description, or a mix's (``DatasetInfo``
    of kind "mix" whose ``sources`` describe each source; its num_samples the sources' total, its
    fingerprints over theirs). Checks the sampler's weights against the dataset (one per sample;
    the dataset's own must exist). Raises ValueError (a weight count that differs from the
    dataset's size, an unknown mix source), DatasetNotFoundError, ConnectionError, TimeoutError."""
    mix, sampler = getattr(options, "mix", None), getattr(options, "sampler", None)
    if mix is None:
        info = describe_one(channel, address, options.dataset, timeout)
        if sampler is not None:
            check_sampler(sampler, info, address)
        return info
    infos = []
    for name in mix.sources:
        try:
            infos.append(describe_one(channel, address, name, timeout))
        except DatasetNotFoundError:
            raise ValueError(f"Mix: unknown source {name!r}: the server at {address} has no dataset of that name") \
                from None
    return mixed_info(mix, infos)


def check_sampler(sampler: WeightedRandomSampler, info: DatasetInfo, address: str) -> None:
    """Raises ValueError unless ``sampler`` fits the dataset ``info`` describes."""
    if sampler.weights is None:
        if not info.weights_digest:
            raise ValueError(f"WeightedRandomSampler({DATASET!r}): dataset {info.name!r} at {address} has no weights "
                             "of its own (a manifest's weight_column, a python dataset's weights); pass the weights")
    elif len(sampler.weights) != info.num_samples:
        raise ValueError(f"WeightedRandomSampler: weights has {len(sampler.weights)} entries but dataset {info.name!r} "
                         f"at {address} has {info.num_samples} samples; give one weight per sample")


def mixed_info(mix: Mix, infos: list[DatasetInfo]) -> DatasetInfo:
    """A mix's ``DatasetInfo`` from its sources' (in order)."""
    def digest(parts: list) -> str:
        return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]
    fingerprint = (digest([[i.name, i.num_samples, i.fingerprint] for i in infos])
                   if all(i.fingerprint for i in infos) else "")
    built = all(i.build_fingerprint for i in infos)
    first = infos[0]
    return DatasetInfo(
        mix.name, "mix", sum(i.num_samples for i in infos), (), first.sample_shape, first.sample_dtype,
        fingerprint, digest([i.build_fingerprint for i in infos]) if built else "",
        {f"{i.name}.{k}": v for i in infos for k, v in i.build.items()},
        "skip" if all(i.on_error == "skip" for i in infos) else "raise", first.server_id, sources=tuple(infos))


def epoch_length(options: Any, info: DatasetInfo) -> int:
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


def apply(request: pb.StreamBatchesRequest, options: Any, info: DatasetInfo) -> pb.StreamBatchesRequest:
    """``request`` (a plain one, built for ``options.dataset``) with the sampler or the mix set; a
    mix's dataset, pipeline and expectations move to its sources (their own expectations, under
    ``strict`` as the dataset's)."""
    sampler, mix = getattr(options, "sampler", None), getattr(options, "mix", None)
    if sampler is not None:
        request.sampler.CopyFrom(sampler.wire())
    if mix is None:
        return request
    for name in ("dataset", "pipeline", "expect_num_samples", "expect_fingerprint", "expect_build_fingerprint"):
        request.ClearField(name)
    request.shuffle = False
    strict = options.strict
    wire = pb.Mix(num_samples=mix.num_samples)
    for source in info.sources:
        pipeline = options.source_pipelines.get(source.name)
        wire.sources.add(dataset=source.name, weight=mix.sources[source.name], pipeline=pipeline,
                         expect_num_samples=source.num_samples,
                         expect_fingerprint=source.fingerprint if strict else "",
                         expect_build_fingerprint=source.build_fingerprint if strict else "")
    request.mix.CopyFrom(wire)
    return request


def needs_upload(options: Any) -> bool:
    """Whether the loader's weights travel with PutWeights (a sampler with weights of its own)."""
    sampler = getattr(options, "sampler", None)
    return sampler is not None and sampler.weights is not None


def put_weights(channel: grpc.Channel, address: str, sampler: WeightedRandomSampler, timeout: float) -> None:
    """Send the sampler's weights to the server at ``address`` (PutWeights, ``CHUNK_WEIGHTS`` a chunk).
    Raises ValueError (the server refused them, its reason), ConnectionError, TimeoutError."""
    raw = np.ascontiguousarray(sampler.weights, "<f8")

    def chunks():
        for start in range(0, len(raw), CHUNK_WEIGHTS):
            piece = raw[start : start + CHUNK_WEIGHTS].tobytes()
            if start == 0:
                yield pb.WeightsChunk(digest=sampler.digest, num_weights=len(raw), weights=piece)
            else:
                yield pb.WeightsChunk(weights=piece)
    rpc = channel.stream_unary(PUT_WEIGHTS_METHOD, request_serializer=pb.WeightsChunk.SerializeToString,
                               response_deserializer=pb.PutWeightsResponse.FromString)
    try:
        rpc(chunks(), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(f"the batchd server at {address} refused the sampler's weights: {e.details()}") from None
        raise translate(e, address) from None
