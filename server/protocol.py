"""The messages between the server and its worker processes.

Each worker has one duplex pipe. Down it go ``Task`` and ``Shutdown``; up it come ``Ready``,
``BatchDone`` and ``TaskFailed``. Workers never raise across the pipe: a failure is a
``TaskFailed`` carrying the exception (pickled when possible) and the worker's formatted
traceback, which the server re-raises with that traceback attached. Pixels never cross the pipe:
a worker writes the batch into a shared-memory slot and sends only its layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one tensor of a batch lies in its slot: ``nbytes`` bytes at ``offset``, C order."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True, slots=True)
class Task:
    """Build one batch: load ``indices``, run the pipeline on each, stack into a slot.

    task_id: unique per server. dataset: config name. pipeline_key/pipeline_json: the
    albumentations pipeline ("" = none), cached per worker by key. indices: int64 [B].
    random_key: uint64 [2], the epoch's key (``batchd.sampler.sample_key``). positions: int64 [B],
    each sample's global position (``batchd.sampler.global_positions``): sample ``j`` is
    augmented with the stream ``sample_stream(random_key, positions[j])``.
    slot_name/slot_capacity: the shared-memory slot to write, bytes.
    skip_bad_samples: leave out samples that raise SampleError instead of failing.
    max_batch_bytes: fail with ResourceExhaustedError before writing a batch larger than this (0: no limit).
    """

    task_id: int
    dataset: str
    pipeline_key: str
    pipeline_json: str
    indices: np.ndarray
    random_key: np.ndarray
    positions: np.ndarray
    slot_name: str
    slot_capacity: int
    skip_bad_samples: bool = False
    max_batch_bytes: int = 0


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Finish and exit."""


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker ``worker_id`` (process ``pid``) has started and takes tasks."""

    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class BatchDone:
    """The batch is in ``slot_name`` (a new, larger segment when ``grown``), laid out as ``tensors``.

    timings: seconds spent per stage ("load" = read + decode, "pipeline", "copy").
    skipped: (index, file, reason) of samples left out under on_error: skip.
    """

    task_id: int
    worker_id: int
    slot_name: str
    slot_capacity: int
    grown: bool
    tensors: tuple[TensorLayout, ...]
    timings: dict[str, float] = field(default_factory=dict)
    skipped: tuple[tuple[int, str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class TaskFailed:
    """Building the batch raised. ``error`` is the exception if it pickles, else None."""

    task_id: int
    worker_id: int
    error: BaseException | None
    error_type: str
    message: str
    traceback: str
