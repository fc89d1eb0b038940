"""Errors users of batchd catch. Shared by server and client; no heavy imports."""

from __future__ import annotations


class BatchdError(Exception):
    """Base of batchd's own errors."""


class DatasetNotFoundError(BatchdError, LookupError):
    """The server has no dataset of the requested name."""


class SampleError(BatchdError, RuntimeError):
    """A sample could not be read, decoded or transformed.

    Attributes: dataset (name), index (dataset sample index), path (file relative to the
    dataset root, or "#index" for array-backed datasets), reason (what went wrong).
    """

    def __init__(self, dataset: str, index: int, path: str, reason: str):
        self.dataset, self.index, self.path, self.reason = dataset, int(index), path, reason
        super().__init__(f"dataset {dataset!r}, sample {index} ({path}): {reason}")

    def __reduce__(self):
        return (type(self), (self.dataset, self.index, self.path, self.reason))


class ShapeMismatchError(BatchdError, ValueError):
    """Samples of one batch cannot be batched: a field has different dtypes (or numbers of
    dimensions) in two samples, or some samples lack it. The message names the field and both
    samples. (Different shapes alone are not an error: such a field comes as a list.)"""


class WorkerError(BatchdError, RuntimeError):
    """A worker process failed (an exception in a pipeline, or it died) while building a batch.

    The message carries the worker's traceback.
    """


class ResourceExhaustedError(BatchdError, RuntimeError):
    """The server refused work over one of its limits (gRPC RESOURCE_EXHAUSTED): too many open
    streams, a batch larger than its ``max_batch_bytes``, a message over the size limit."""


class AuthenticationError(BatchdError, PermissionError):
    """The server wants a valid token (gRPC UNAUTHENTICATED): none was sent, or it is not one
    the server knows. Pass ``token=`` (or set ``BATCHD_TOKEN``)."""


class PermissionDeniedError(BatchdError, PermissionError):
    """The token is valid but may not read this dataset (gRPC PERMISSION_DENIED). The message is
    the same whether or not the dataset exists."""
