"""A mix's task in the worker: each sample by its source (``Task.sources``, ``Task.source_ids``).

A mix (``batchd.Mix``; its order drawn by ``batchd.sampler.mix_draw``) gives a task samples of
several datasets, each with its own pipeline and ``on_error``. The worker (``worker._Worker``)
builds such a task as any other, one sample at a time; what differs by source is here:
``prefetch_mix`` starts reading each sample from its own source's storage, and ``MixSources``
gives each sample its dataset, plan and on_error, tags it with its ``source`` field, and names the
source of a sample that does not collate with the others.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchd.errors import ShapeMismatchError
from batchd.server.compute.collate import BatchWriter
from batchd.server.compute.plan import Plan
from batchd.server.compute.protocol import Task
from batchd.server.data.datasets import Dataset, FieldSpec

if TYPE_CHECKING:
    from batchd.server.compute.worker import _Worker


def prefetch_mix(worker: "_Worker", task: Task) -> None:
    """A mix's task: the reader's item k is sample k, read from its source's storage (nothing for
    a source held in memory: ``_load`` forgets those)."""
    reads = []
    for name, key, text in task.sources:
        ds = worker.dataset(name)
        reads.append(worker._reads(task, ds, worker._plan(key, text)) if ds.concurrent_reads else None)
    if all(r is None for r in reads):
        return
    ids, indices = task.source_ids.tolist(), task.indices.tolist()

    def read(k: int):
        r = reads[ids[k]]
        return None if r is None else r(indices[k])
    worker.reader.add(task.task_id, read, range(len(indices)))


class MixSources:
    """A mix's task in the worker: each sample's dataset, plan and on_error by its source
    (``Task.source_ids``), the ``source`` field it gains (int64, the source's place in the mix),
    and messages naming the source of a sample that does not collate with the others."""

    def __init__(self, worker: "_Worker", task: Task):
        self.sources = [(worker.dataset(name), worker._plan(key, text),
                         getattr(worker.dataset_configs[name], "on_error", "raise") == "skip")
                        for name, key, text in task.sources]
        self.ids = task.source_ids.tolist()
        self.where: dict[int, Dataset] = {}  # sample index -> the dataset of its first sample in this batch (messages)
        self.current: tuple[int, Dataset] | None = None  # the sample being added
        self.names = [ds.name for ds, _, _ in self.sources]
        self.per_object = [worker.per_object[name] for name in self.names]  # a field per-object in any source

    def source(self, k: int, index: int) -> tuple[Dataset, Plan, bool]:
        """(dataset, plan, skip bad samples) of sample k."""
        found = self.sources[self.ids[k]]
        self.where.setdefault(index, found[0])
        self.current = (index, found[0])
        return found

    def tagged(self, sample: dict, k: int, ds: Dataset, index: int) -> dict:
        """The sample with its ``source``. Raises ValueError if it has a field of that name."""
        if "source" in sample:
            raise ValueError(f"dataset {ds.name!r}, sample {index}: it has a field 'source', which a mix adds (the "
                             "sample's source); rename the field to mix this dataset")
        return {**sample, "source": self.ids[k]}

    def writer(self, capacity: int, alloc, max_bytes: int) -> BatchWriter:
        first = self.sources[0][0]
        return BatchWriter(capacity, per_object=lambda field: any(po(field) for po in self.per_object),
                           alloc=alloc, max_bytes=max_bytes, describe=self._describe,
                           specs=(*first.fields, FieldSpec("source", "int64", ())), dataset=self.name)

    @property
    def name(self) -> str:
        return "mix(" + ",".join(self.names) + ")"

    def _describe(self, index: int) -> str:
        """The sample being added if it has this index, else the batch's first sample of that index."""
        ds = self.current[1] if self.current is not None and self.current[0] == index else self.where.get(index)
        return f"sample {index}" if ds is None else f"sample {index} of {ds.name!r} ({ds.source(index)})"

    def add(self, writer: BatchWriter, sample: dict, index: int, position: int) -> None:
        try:
            writer.add(sample, index, position)
        except ShapeMismatchError as e:
            e.add_note(f"the sources of a mix ({', '.join(self.names)}) must give samples that collate (the same "
                       "fields, dtypes and, for stacked fields, shapes): give each source a pipeline that makes them "
                       "alike (transform={name: pipeline})")
            raise
