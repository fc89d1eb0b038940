"""What a server says of a dataset, and what a request expects of it.

``dataset_info``: DescribeDataset's answer (computed once per dataset per process by the servicer,
server/serve/service.py). ``expected_mismatches``: how a StreamBatches or Batches request's
``expect_*`` fields (or each of its mix's sources') differ from the dataset served, named as the
client names changes; the servicer refuses such a request with FAILED_PRECONDITION.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from batchd.server.compute import build
from batchd.server.loader import Loader
from batchd.v1 import loader_pb2 as pb


def dataset_info(loader: Loader, name: str) -> pb.DatasetInfo:
    """DescribeDataset's answer: size, classes, the sample's fields (``Dataset.fields``, then index
    and position), the dataset and build fingerprints, on_error, the dataset's own weights by
    digest and its class counts (where the kind holds its labels; ``Dataset.labels``)."""
    ds = loader.dataset(name)
    parts = build.build_parts(ds.decode_settings, cache=loader.cache is not None)
    labels = ds.labels()
    own = loader.dataset_weights.get(name)
    return pb.DatasetInfo(
        name=name,
        kind=ds.kind,
        num_samples=len(ds),
        class_names=list(ds.classes),
        sample=[
            *(pb.TensorSpec(name=f.name, dtype=f.dtype, shape=list(f.shape)) for f in ds.fields),
            pb.TensorSpec(name="index", dtype="int64", shape=[]),
            pb.TensorSpec(name="position", dtype="int64", shape=[]),  # in the epoch's global order (server/compute/worker.py)
        ],
        fingerprint=ds.fingerprint,
        build_fingerprint=build.served_fingerprint(parts),
        build=parts,
        on_error=loader.config.datasets[name].on_error,
        weights_digest=own.digest if own is not None else "",
        class_counts=(np.bincount(labels, minlength=len(ds.classes)).tolist()
                      if labels is not None and len(labels) else []),
    )


def expected_mismatches(request: pb.StreamBatchesRequest, info: Callable[[str], pb.DatasetInfo]) -> list[str]:
    """``expected_mismatch`` of the request's dataset, or of each source of its mix (each named);
    ``info(name)`` describes a dataset."""
    if not request.HasField("mix"):
        if not (request.expect_num_samples or request.expect_fingerprint or request.expect_build_fingerprint):
            return []
        return expected_mismatch(request, info(request.dataset))
    found = []
    for source in request.mix.sources:
        if source.expect_num_samples or source.expect_fingerprint or source.expect_build_fingerprint:
            found += [f"source {source.dataset!r}: {d}" for d in expected_mismatch(source, info(source.dataset))]
    return found


def expected_mismatch(request: pb.StreamBatchesRequest | pb.MixSource, info: pb.DatasetInfo) -> list[str]:
    """What differs between the dataset a request (or a mix's source) expects (its ``expect_*``
    fields, where set) and ``info``: ``"num_samples A vs B"``, ``"dataset fingerprint A vs B"``, ``"build fingerprint A vs
    B"`` (expected vs served), as the client names changes. Empty: it matches."""
    found = []
    if request.expect_num_samples and request.expect_num_samples != info.num_samples:
        found.append(f"num_samples {request.expect_num_samples} vs {info.num_samples}")
    if request.expect_fingerprint and request.expect_fingerprint != info.fingerprint:
        found.append(f"dataset fingerprint {request.expect_fingerprint} vs {info.fingerprint or '(none)'}")
    if request.expect_build_fingerprint and request.expect_build_fingerprint != info.build_fingerprint:
        found.append(f"build fingerprint {request.expect_build_fingerprint} vs {info.build_fingerprint}")
    return found
