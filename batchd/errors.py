"""Errors users of batchd catch. Shared by server and client; no heavy imports.

Each is a ``BatchdError`` and the built-in exception it refines (``LookupError``,
``ValueError``, ...), so ``except batchd.BatchdError`` catches every one of them and code that
catches the built-in keeps working. ``ConnectionError`` and ``TimeoutError`` here shadow the
built-ins of the same name on purpose: ``except ConnectionError`` (the built-in) catches
batchd's too.
"""

from __future__ import annotations

import builtins


class BatchdError(Exception):
    """Base of batchd's own errors."""


class ConnectionError(BatchdError, builtins.ConnectionError):
    """No batchd server answered (within ``connect_timeout``), a call or data connection broke
    and did not resume (within ``reconnect_timeout``), or a server sent what a batchd server
    never sends. The message names the server's address. Also a built-in ``ConnectionError``
    (an ``OSError``)."""


class TimeoutError(BatchdError, builtins.TimeoutError):
    """A server answered, but not in time: no batch for ``timeout`` seconds, or a call past its
    deadline. The message names the server and the wait in seconds. Also a built-in
    ``TimeoutError`` (an ``OSError``)."""


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


class DatasetChangedError(BatchdError, ValueError):
    """A server's dataset is no longer the one this loader was reading: after a reconnect, or at
    the start of an epoch after a restart between epochs, it has another number of samples
    (always an error: the epoch's batch plan, ``len(loader)``, no longer holds), or, with
    ``strict``, another dataset or build fingerprint. Raised before any batch of the new data is
    yielded.

    Attributes: dataset (name), address (the server), num_samples ``(before, now)`` where the
    number of samples differs, else None; changes (the fingerprints that differ, each "before vs
    now", e.g. ``"dataset fingerprint 3f2a... vs 9c41..."``, ``"opencv 4.10.0 vs 5.0.0"``).
    """

    def __init__(self, dataset: str, address: str, changes: list[str] | tuple[str, ...] = (),
                 num_samples: tuple[int, int] | None = None):
        self.dataset, self.address = dataset, address
        self.changes, self.num_samples = tuple(changes), None if num_samples is None else tuple(num_samples)
        what = [f"{self.num_samples[0]} samples before, {self.num_samples[1]} now"] if self.num_samples else []
        what += [f"{c} (before vs now)" for c in self.changes]
        why = ("the epoch's batch plan (len(loader)) no longer holds; start a new loader for the new data"
               if self.num_samples else "strict=False goes on with the new data")
        super().__init__(f"dataset {dataset!r} at {address} changed since the loader last read it (a restart): "
                         f"{'; '.join(what)}; {why}")

    def __reduce__(self):
        return (type(self), (self.dataset, self.address, self.changes, self.num_samples))
