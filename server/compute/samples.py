"""One sample of a task, as a worker gets it: read, decoded, and through the pipeline's prefix.

A sample's bytes come from the worker's ``SampleReader`` (``server/data/reader.py``), which read
them ahead on its I/O threads, or its fields from the dataset itself (kinds held in memory: no
``read_bytes``); it is decoded at the size the pipeline allows (reduced JPEG decoding). With a
server cache (config ``cache:``), the decoded sample's pipeline prefix (``server/compute/prefix.py``)
comes from the shared cache (``server/data/cache/``) or is computed and stored there, keyed by
the dataset's fingerprint, the sample, the prefix and the build (``sample_key``); the reader then
skips the bytes of samples already cached. A sample for which the prefix would draw a random
number (``prefix.RandomDrawn``) is built by the whole pipeline instead, and not cached.
"""

from __future__ import annotations

from batchd.sampler import draw_key
from batchd.server.compute import prefix as prefixes
from batchd.server.compute.build import build_fingerprint, build_parts
from batchd.server.compute.plan import Plan
from batchd.server.compute.protocol import Task
from batchd.server.compute.stages import CACHE, DECODE, PIPELINE, READ
from batchd.server.data.cache import sample_key
from batchd.server.data.datasets import Dataset


class WorkerSamples:
    """Mixed into the worker (``worker._Worker``): needs its ``clock``, ``reader``,
    ``between_samples``, ``cache``, ``cache_lookups``, ``cache_misses``, ``builds``,
    ``per_object`` and ``_plan``."""

    def _load(self, ds: Dataset, task: Task, k: int, index: int, min_size) -> dict:
        """Sample k of the task, decoded (a dict of fields): its bytes from the reader if they are read ahead."""
        clock = self.clock  # (its enter calls only for timed samples: clock.on)
        if task.task_id not in self.reader or not ds.concurrent_reads:  # in memory: nothing to read
            if task.sources:  # (a mix's source in memory, beside sources read from storage)
                self.reader.forget(task.task_id, k)
            if clock.on:
                clock.enter(DECODE)
            # a weighted or mixed epoch may hold the sample twice: its own randomness keyed to its position
            key = draw_key(task.random_key, int(task.positions[k])) if task.drawn else task.random_key
            return ds.load_sample(index, min_size, key=key)
        if clock.on:
            clock.enter(READ)
        self.between_samples()
        data = self.reader.take(task.task_id, k, self.between_samples)
        if data is None:  # in the cache when read ahead (so not read), but gone since (found corrupt)
            data = ds.read_bytes(index)
        if clock.on:
            clock.enter(DECODE)
        return ds.decode_sample(index, data, min_size)

    def _reads(self, task: Task, ds: Dataset, plan: Plan | None = None):
        """What the reader calls per sample: ``ds.read_bytes``, or with the cache a function that
        returns None for samples already cached (their bytes are not needed). plan: the samples'
        pipeline (default: the task's)."""
        plan = plan if plan is not None else self._plan(task.pipeline_key, task.pipeline_json)
        if task.encoding == "jpeg" or self._cache_key(ds, plan, 0) is None:
            return ds.read_bytes
        cache = self.cache

        def read(index: int):
            return None if cache.contains(ds.name, self._cache_key(ds, plan, index)) else ds.read_bytes(index)
        return read

    def _cache_key(self, ds: Dataset, plan: Plan, index: int) -> bytes | None:
        """The cache key of sample ``index``'s prefix output; None when it is not cached (no cache,
        no dataset fingerprint, or a pipeline that cannot be split)."""
        if self.cache is None or plan.split is None or not ds.fingerprint or not getattr(ds, "deterministic", True):
            return None
        build = self.builds.get(ds.name)
        if build is None:
            build = self.builds[ds.name] = build_fingerprint(build_parts(ds.decode_settings, cache=True))
        return sample_key(ds.fingerprint, index, plan.cache_name, build)

    def _sample(self, ds: Dataset, task: Task, k: int, index: int, plan: Plan) -> tuple[dict, bool]:
        """(sample k of the task decoded, or its state after the pipeline's deterministic prefix;
        whether it is that state). The state (``targets.TargetPipeline.begin``) comes from the
        cache, else is computed (and stored there), and ``TargetPipeline.end`` then runs the
        rest. The prefix runs whether or not a cache is configured, so the bytes cannot depend on
        it. If a prefix transform would draw a random number for this sample
        (``prefix.RandomDrawn``: the prefix runs with generators that raise), or the dataset drew
        some to build it (``Dataset.last_sample_drew``: it depends on the epoch), the decoded
        sample goes through the whole pipeline instead, and nothing is stored."""
        if plan.split is None:
            return self._load(ds, task, k, index, plan.min_size), False
        decoded = []

        def compute() -> dict:
            decoded.append(self._load(ds, task, k, index, plan.split.min_size))
            if ds.last_sample_drew:  # (kind python) drew random numbers for (seed, epoch, index): not cached
                raise prefixes.RandomDrawn(f"dataset {ds.name!r}: sample {index} drew random numbers")
            return self._prefix(plan, ds, decoded[0], index, then=CACHE if key is not None else PIPELINE)
        key = self._cache_key(ds, plan, index)
        try:
            if key is None:
                return compute(), True
            self.cache_lookups += 1
            if self.clock.on:
                self.clock.enter(CACHE)
            sample = self.cache.get_or_compute(ds.name, key, compute)
            self.cache_misses += bool(decoded)
        except prefixes.RandomDrawn:
            return decoded[0], False  # the prefix transforms do not write their input
        self.reader.forget(task.task_id, k)  # a hit: the bytes read ahead are not needed
        return sample, True

    def _prefix(self, plan: Plan, ds: Dataset, sample: dict, index: int, then: int = PIPELINE) -> dict:
        """The pipeline's deterministic prefix on the decoded sample: its state
        (``TargetPipeline.begin``; timed as pipeline; ``then``: the stage that follows, CACHE when
        the cache stores the result)."""
        if plan.targets is None or not plan.targets.prefix:
            return sample
        clock = self.clock
        if clock.on:
            clock.enter(PIPELINE)
        try:
            return plan.targets.begin(sample, self.per_object[ds.name])
        except Exception as e:
            e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
            raise
        finally:
            if clock.on:
                clock.enter(then)
