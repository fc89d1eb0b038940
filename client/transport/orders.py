"""An epoch's order as the wire carries it: a weighted sampler's or a mix's part of the request.

The transport's side of ``batchd.client.loader.sampling``: the loader's ``info`` at a server
(``describe``), the request's fields (``apply``) and the weights' upload (``put_weights``), which
a connection makes once per server process (again after a broken call: the server may have
restarted, or dropped them, docs/design/sampling.md). Mirrors server/serve/orders.py.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import grpc
import numpy as np

from batchd.client.transport.channel import translate
from batchd.client.transport.datasets import DatasetInfo, describe as describe_one
from batchd.errors import DatasetNotFoundError
from batchd.v1 import loader_pb2 as pb

PUT_WEIGHTS_METHOD = "/batchd.v1.BatchLoader/PutWeights"
CHUNK_WEIGHTS = 1 << 16  # weights per PutWeights chunk: 512 KiB, within a server's default max_request_bytes (1 MiB)
DATASET = "dataset"  # (batchd.client.loader.sampling.DATASET)


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


def check_sampler(sampler: Any, info: DatasetInfo, address: str) -> None:
    """Raises ValueError unless ``sampler`` fits the dataset ``info`` describes."""
    if sampler.weights is None:
        if not info.weights_digest:
            raise ValueError(f"WeightedRandomSampler({DATASET!r}): dataset {info.name!r} at {address} has no weights "
                             "of its own (a manifest's weight_column, a python dataset's weights); pass the weights")
    elif len(sampler.weights) != info.num_samples:
        raise ValueError(f"WeightedRandomSampler: weights has {len(sampler.weights)} entries but dataset {info.name!r} "
                         f"at {address} has {info.num_samples} samples; give one weight per sample")


def mixed_info(mix: Any, infos: list[DatasetInfo]) -> DatasetInfo:
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
    request.mix.num_samples = mix.num_samples
    for source in info.sources:
        request.mix.sources.add(dataset=source.name, weight=mix.sources[source.name],
                                pipeline=options.source_pipelines.get(source.name),
                                expect_num_samples=source.num_samples,
                                expect_fingerprint=source.fingerprint if strict else "",
                                expect_build_fingerprint=source.build_fingerprint if strict else "")
    return request


def needs_upload(options: Any) -> bool:
    """Whether the loader's weights travel with PutWeights (a sampler with weights of its own)."""
    sampler = getattr(options, "sampler", None)
    return sampler is not None and sampler.weights is not None


def put_weights(channel: grpc.Channel, address: str, sampler: Any, timeout: float) -> None:
    """Send the sampler's weights to the server at ``address`` (PutWeights, ``CHUNK_WEIGHTS`` a chunk).
    Raises ValueError (the server refused them, its reason), ConnectionError, TimeoutError."""
    raw = np.ascontiguousarray(sampler.weights, "<f8")

    def chunks():  # the first one names the weights
        first = raw[:CHUNK_WEIGHTS].tobytes()
        yield pb.WeightsChunk(digest=sampler.digest, num_weights=len(raw), weights=first)
        for start in range(CHUNK_WEIGHTS, len(raw), CHUNK_WEIGHTS):
            yield pb.WeightsChunk(weights=raw[start : start + CHUNK_WEIGHTS].tobytes())
    rpc = channel.stream_unary(PUT_WEIGHTS_METHOD, request_serializer=pb.WeightsChunk.SerializeToString,
                               response_deserializer=pb.PutWeightsResponse.FromString)
    try:
        rpc(chunks(), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
            raise ValueError(f"the batchd server at {address} refused the sampler's weights: {e.details()}") from None
        raise translate(e, address) from None
