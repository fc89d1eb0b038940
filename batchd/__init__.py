"""batchd: decode and augment on a loader server; stream ordered, deterministic batches to training.

The names users type::

    import batchd
    loader = batchd.RemoteDataLoader("127.0.0.1:50051", "fmnist-train", batch_size=256, shuffle=True)
    batchd.list_datasets("127.0.0.1:50051")
    batchd.RemoteDataLoader(..., sampler=batchd.WeightedRandomSampler(weights, num_samples=n))
    batchd.RemoteDataLoader(..., batchd.Mix({"a": 0.7, "b": 0.3}, num_samples=n), ...)

Client names are imported lazily so that server worker processes never import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchd import _grpc_fork  # noqa: F401  (first: before anything imports grpc; see there)
from batchd.errors import (
    AuthenticationError,
    BatchdError,
    ConnectionError,
    DatasetChangedError,
    DatasetNotFoundError,
    PermissionDeniedError,
    ResourceExhaustedError,
    SampleError,
    ShapeMismatchError,
    TimeoutError,
    WorkerError,
)
from batchd.python_dataset import PythonDataset

if TYPE_CHECKING:
    from batchd.client.transport.channel import TLS
    from batchd.client.device.collate import detection_collate
    from batchd.client.transport.datasets import DatasetInfo, describe_dataset, list_datasets
    from batchd.client.device.finish import GpuTransform
    from batchd.client.loader.loader import RemoteDataLoader
    from batchd.client.loader.sampling import Mix, WeightedRandomSampler
    from batchd.client.transport.server_stats import get_stats

__all__ = [
    "AuthenticationError",
    "BatchdError",
    "ConnectionError",
    "DatasetChangedError",
    "DatasetInfo",
    "DatasetNotFoundError",
    "GpuTransform",
    "Mix",
    "PermissionDeniedError",
    "PythonDataset",
    "RemoteDataLoader",
    "ResourceExhaustedError",
    "SampleError",
    "ShapeMismatchError",
    "TLS",
    "TimeoutError",
    "WeightedRandomSampler",
    "WorkerError",
    "describe_dataset",
    "detection_collate",
    "get_stats",
    "list_datasets",
]

_LAZY = {
    "TLS": "batchd.client.transport.channel",
    "detection_collate": "batchd.client.device.collate",
    "DatasetInfo": "batchd.client.transport.datasets",
    "describe_dataset": "batchd.client.transport.datasets",
    "list_datasets": "batchd.client.transport.datasets",
    "GpuTransform": "batchd.client.device.finish",
    "RemoteDataLoader": "batchd.client.loader.loader",
    "Mix": "batchd.client.loader.sampling",
    "WeightedRandomSampler": "batchd.client.loader.sampling",
    "get_stats": "batchd.client.transport.server_stats",
}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchd' has no attribute {name!r}")
    import importlib

    try:
        return getattr(importlib.import_module(module), name)
    except ModuleNotFoundError as e:
        if e.name != "torch":
            raise
        raise ModuleNotFoundError(f"batchd.{name} needs torch, which batchd's client extra installs: "
                                  "pip install 'batchd[client]'", name="torch") from e
