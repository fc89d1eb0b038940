"""A real worker (server/compute/worker.py's ``_Worker``) run in this process on real datasets:
each batch built into a real shared-memory slot and read back through its layouts, as the
server's transport reads it (stacked tensors, and ragged ones as lists of per-sample arrays)."""

from __future__ import annotations

import contextlib
import secrets

import albumentations as A
import numpy as np

from batchd.sampler import global_positions, sample_key, shard_indices
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import python_pipeline
from batchd.server.compute.protocol import BatchDone, Task, storage_dtype
from batchd.server.compute.worker import _Worker
from batchd.server.data.datasets import open_dataset
from batchd.server.shm import Segment


def pipeline_json(transform) -> str:
    """Canonical JSON of an albumentations transform (None: no pipeline), as the loader sends it."""
    return "" if transform is None else pipelines.canonical_json(A.to_dict(transform))


def read_slot(seg: Segment, done: BatchDone) -> dict:
    """The batch in ``seg``: name -> array (stacked) or list of arrays (ragged; str fields as str,
    bytes fields as bytes), copied out of the slot."""
    out = {}
    for t in done.tensors:
        flat = np.frombuffer(seg.buf, storage_dtype(t.dtype), int(np.prod(t.shape)), t.offset)
        if t.sample_shapes is None:
            out[t.name] = flat.reshape(t.shape).copy()
            continue
        values, start = [], 0
        for shape in t.sample_shapes:
            size = int(np.prod(shape))
            v = flat[start:start + size].reshape(shape).copy()
            values.append(v.tobytes().decode() if t.dtype == "str" else v.tobytes() if t.dtype == "bytes" else v)
            start += size
        assert start == t.shape[0], f"{t.name}: sample shapes cover {start} of {t.shape[0]} elements"
        out[t.name] = values
        del flat
    return out


class InWorker:
    """One ``_Worker`` over ``datasets`` (name -> config dict), the server's index built first.

    ``batch(dataset, indices, transform=..., seed=..., epoch=...)`` builds one batch and returns
    (BatchDone, batch dict); positions are the samples' places in the epoch (or ``positions=``).
    """

    def __init__(self, datasets: dict, cache_dir, *, python_pipelines=None, slot_capacity: int = 1 << 20,
                 cache_prefix: str | None = None):
        from batchd.server.config import ServerConfig

        cfg = ServerConfig.model_validate({"datasets": datasets, "cache_dir": str(cache_dir),
                                           "pipelines": python_pipelines or {}})
        self.configs = dict(cfg.datasets)
        self.python = cfg.python_pipelines()
        for name, dcfg in self.configs.items():
            open_dataset(name, dcfg, cfg.cache_dir, build=True)
        self.prefix = cache_prefix or f"batchd-test-{secrets.token_hex(4)}-"
        self.worker = _Worker(0, self.configs, cfg.cache_dir, self.prefix, python_pipelines=self.python)
        self.slot = Segment.create(f"{self.prefix}slot", slot_capacity)
        self.task_ids = iter(range(1, 1 << 30))

    def batch(self, dataset: str, indices, transform=None, *, preset: str | None = None, seed: int = 0,
              epoch: int = 0, positions=None, skip: bool = False, max_batch_bytes: int = 0,
              key=None) -> tuple[BatchDone, dict]:
        """``key``: the task's random key (uint64 [2]) itself, instead of ``sample_key(seed, epoch)``."""
        text = python_pipeline.preset_json(preset, self.python[preset]) if preset else pipeline_json(transform)
        indices = np.asarray(indices, np.int64)
        positions = np.arange(len(indices), dtype=np.int64) if positions is None else np.asarray(positions, np.int64)
        task = Task(next(self.task_ids), dataset, pipelines.pipeline_key(text), text, indices,
                    sample_key(seed=seed, epoch=epoch) if key is None else np.asarray(key, np.uint64), positions, self.slot.name, self.slot.capacity,
                    skip_bad_samples=skip, max_batch_bytes=max_batch_bytes)
        done = self.worker.run(task)
        if done.slot_name == self.slot.name:
            return done, read_slot(self.slot, done)
        grown = Segment.attach(done.slot_name)
        try:
            return done, read_slot(grown, done)
        finally:
            grown.close()
            grown.unlink()
            self.worker._unadopted = None

    def epoch(self, dataset: str, n: int, batch_size: int, transform=None, **kw):
        """Every batch of one shuffled epoch of ``n`` samples, as the server would cut it."""
        seed, epoch = kw.pop("seed", 0), kw.pop("epoch", 0)
        order = shard_indices(n, shuffle=True, seed=seed, epoch=epoch, rank=0, world_size=1, drop_last=False)
        positions = global_positions(0, n, rank=0, world_size=1)
        for start in range(0, n, batch_size):
            yield self.batch(dataset, order[start:start + batch_size], transform, seed=seed, epoch=epoch,
                             positions=positions[start:start + batch_size], **kw)[1]

    def close(self) -> None:
        for seg in list(self.worker.segments.values()):
            with contextlib.suppress(BufferError):
                seg.close()
        if self.worker.cache is not None:
            self.worker.cache.close()
        self.worker.reader.close()
        self.slot.close()
        self.slot.unlink()

    def __enter__(self) -> "InWorker":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
