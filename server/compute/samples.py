"""One sample of a task, as a worker gets it: read, decoded, and through the pipeline's prefix.

A sample's bytes come from the worker's ``SampleReader`` (``server/data/reader.py``), which read
them ahead on its I/O threads, or its fields from the dataset itself (kinds held in memory: no
``read_bytes``); it is decoded at the size the pipeline allows (reduced JPEG decoding). With a
server cache (config ``cache:``), the decoded sample's pipeline prefix (``server/compute/prefix.py``)
comes from the shared cache (``server/data/cache/``) or is computed and stored there, keyed by
the dataset's fingerprint, the sample, the prefix and the build (``sample_key``); the reader then
skips the bytes of samples already cached. A sample for which the prefix would draw a random
number (``prefix.RandomDrawn``) is built by the whole pipeline instead, and not cached.

Every sample is checked as it comes from the dataset, before the prefix and the cache
(``sample_checks.check_targets``: boxes, keypoints, per-object counts; a bad one is a SampleError),
and a ``kind: python`` sample is, at random intervals, built a second time to catch randomness
batchd cannot key (``recheck``).
"""

from __future__ import annotations

from batchd.sampler import draw_key
from batchd.server.compute import prefix as prefixes
from batchd.server.compute.build import build_fingerprint, build_parts
from batchd.server.compute.plan import Plan
from batchd.server.compute.protocol import Task
from batchd.server.compute.sample_checks import check_targets
from batchd.server.compute.stages import CACHE, DECODE, PIPELINE, READ
from batchd.server.data import scaled_jpeg
from batchd.server.data.cache import sample_key
from batchd.server.data.datasets import Dataset
from batchd.server.data.decode import jpeg_orientation


DECODE_KINDS = ("full", "scaled", "region", "indexed")  # decodes counted in BatchDone.timings ("decode_<kind>")
INDEX_KEY = "jpeg-restart-index/1"  # the cache's "prefix" name of a sample's indexed JPEG (scaled_jpeg.index_jpeg)


class _NoIndex(Exception):
    """No indexed JPEG for this sample now (no room in the cache, or libjpeg cannot rewrite it)."""


class WorkerSamples:
    """Mixed into the worker (``worker._Worker``): needs its ``clock``, ``reader``,
    ``between_samples``, ``cache``, ``cache_lookups``, ``cache_misses``, ``builds``,
    ``per_object``, ``random``, ``decodes`` (kind -> count), ``decoded_pixels``, ``_plan`` and
    ``recheck``."""

    def _load(self, ds: Dataset, task: Task, k: int, index: int, plan: Plan, min_size, data=None) -> dict:
        """Sample k of the task, decoded (a dict of fields) and checked (``_checked``; boxes and
        keypoints float32): its bytes ``data`` if already taken, else from the reader if they are
        read ahead. Raises SampleError for a sample that cannot be read or decoded, or whose
        targets are bad."""
        clock = self.clock  # (its enter calls only for timed samples: clock.on)
        if data is None and (task.task_id not in self.reader or not ds.concurrent_reads):  # in memory: nothing to read
            if task.sources:  # (a mix's source in memory, beside sources read from storage)
                self.reader.forget(task.task_id, k)
            if clock.on:
                clock.enter(DECODE)
            # a weighted or mixed epoch may hold the sample twice: its own randomness keyed to its position
            key = draw_key(task.random_key, int(task.positions[k])) if task.drawn else task.random_key
            sample = ds.load_sample(index, min_size, key=key)
            self.recheck(ds, index, key, sample)
            return self._checked(ds, index, plan, sample)
        if data is None:
            data = self._take(ds, task, k, index)
        if clock.on:
            clock.enter(DECODE)
        sample = ds.decode_sample(index, data, min_size)
        image = sample.get("image")
        if min_size is not None and image is not None and ds.decoded_size(index, data) not in (None, image.shape[:2]):
            self._decoded("scaled", image)
        else:
            self._decoded("full", image)
        return self._checked(ds, index, plan, sample)

    def _checked(self, ds: Dataset, index: int, plan: Plan, sample: dict, size: tuple[int, int] | None = None) -> dict:
        """``sample_checks.check_targets`` on a sample as the dataset gave it, before the pipeline
        (``size``: the full frame's (height, width) when its image is a region decode's)."""
        inside = plan.targets is not None and plan.targets.boxes_inside
        return check_targets(sample, dataset=ds.name, index=index, source=ds.source(index),
                             per_object=self.per_object[ds.name], inside=inside, size=size)

    def _take(self, ds: Dataset, task: Task, k: int, index: int):
        """Sample k's bytes, read ahead by the reader (or read now)."""
        if self.clock.on:
            self.clock.enter(READ)
        self.between_samples()
        data = self.reader.take(task.task_id, k, self.between_samples)
        if data is None:  # in the cache when read ahead (so not read), but gone since (found corrupt)
            data = ds.read_bytes(index)
        return data

    def _decoded(self, kind: str, image) -> None:
        """Count a decode of ``kind`` (``DECODE_KINDS``) and its pixels (BatchDone.timings)."""
        self.decodes[kind] += 1
        shape = getattr(image, "shape", None)
        if shape is not None and len(shape) >= 2:
            self.decoded_pixels += int(shape[0]) * int(shape[1])

    def _region(self, ds: Dataset, task: Task, k: int, index: int, position: int, plan: Plan):
        """(sample k of the task through the whole pipeline, its first transform drawn ahead of a
        decode at the scale its window needs (server/compute/region.py), or None when the
        dataset cannot tell this sample's size without decoding it (not a JPEG); the sample's
        bytes). The decoded sample goes through the same checks as a full decode's
        (``_checked``, on the full frame ``drawn.shape``: its targets are the full image's).
        Raises what decoding or the checks (SampleError) or the pipeline raises, the latter with
        a note naming dataset and sample."""
        data = self._take(ds, task, k, index)
        shape = ds.decoded_size(index, data)
        if shape is None:
            return None, data
        clock, first = self.clock, plan.first
        self.random.start(task.random_key, position)
        try:
            drawn = first.draw(*shape)
        except Exception as e:
            e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
            raise
        if clock.on:
            clock.enter(DECODE)
        window = None if drawn.params is None else drawn.window
        jpeg_index = None if window is None else self._indexed(ds, index, data)
        sample = ds.decode_sample(index, data, None, eighths=drawn.eighths, window=window, jpeg_index=jpeg_index)
        self._decoded("indexed" if jpeg_index is not None else "full" if drawn.eighths == 8 else "region",
                      sample.get("image"))
        sample = self._checked(ds, index, plan, sample, size=drawn.shape)
        if clock.on:
            clock.enter(PIPELINE)
        try:
            return plan.targets.end_first(sample, self.per_object[ds.name], first, drawn), data
        except Exception as e:
            e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
            raise

    def _indexed(self, ds: Dataset, index: int, data) -> scaled_jpeg.JpegIndex | None:
        """Sample ``index``'s JPEG with a restart marker before every MCU (``scaled_jpeg.index_jpeg``),
        from the server's cache, or made now (about 7 ms for a 1,500 px photo, once) and stored
        there while the cache has room; None without a cache, a dataset fingerprint, room, or for
        a JPEG turned by its EXIF orientation (an index keeps no EXIF) or one libjpeg cannot
        rewrite. A region decodes to the same bytes from it as from ``data``
        (``scaled_jpeg.decode_indexed``), so whether a sample has one changes no batch."""
        cache = self.cache
        if cache is None or not ds.fingerprint or not getattr(ds, "deterministic", True):
            return None
        build = self._build(ds)

        def make() -> dict:
            if not cache.room(len(data) * 5 // 4) or jpeg_orientation(memoryview(data).cast("B")) != 1:
                raise _NoIndex()
            made = scaled_jpeg.index_jpeg(data)
            if made is None:
                raise _NoIndex()
            return made.as_sample()
        try:
            return scaled_jpeg.JpegIndex.from_sample(
                cache.get_or_compute(ds.name, sample_key(ds.fingerprint, index, INDEX_KEY, build), make))
        except _NoIndex:
            return None

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
        no dataset fingerprint, a pipeline that cannot be split, or one whose first random crop is
        drawn ahead of decoding, region.py)."""
        if self.cache is None or plan.split is None or not ds.fingerprint or not getattr(ds, "deterministic", True):
            return None
        if plan.first is not None and getattr(ds, "reduced_decode", False):
            return None  # a first random crop decoded at the scale of its draw (region.py): never cached
        return sample_key(ds.fingerprint, index, plan.cache_name, self._build(ds))

    def _build(self, ds: Dataset) -> str:
        """The build fingerprint of ``ds``'s cache entries (its decode settings), made once."""
        build = self.builds.get(ds.name)
        if build is None:
            build = self.builds[ds.name] = build_fingerprint(build_parts(ds.decode_settings, cache=True))
        return build

    def _sample(self, ds: Dataset, task: Task, k: int, index: int, plan: Plan, data=None) -> tuple[dict, bool]:
        """(sample k of the task decoded, or its state after the pipeline's deterministic prefix;
        whether it is that state). The state (``targets.TargetPipeline.begin``) comes from the
        cache, else is computed (and stored there), and ``TargetPipeline.end`` then runs the
        rest. The prefix runs whether or not a cache is configured, so the bytes cannot depend on
        it. If a prefix transform would draw a random number for this sample
        (``prefix.RandomDrawn``: the prefix runs with generators that raise), or the dataset drew
        some to build it (``Dataset.last_sample_drew``: it depends on the epoch), the decoded
        sample goes through the whole pipeline instead, and nothing is stored. ``data``: the
        sample's bytes when already taken from the reader."""
        if plan.split is None:
            return self._load(ds, task, k, index, plan, plan.min_size, data), False
        decoded = []

        def compute() -> dict:
            decoded.append(self._load(ds, task, k, index, plan, plan.split.min_size, data))
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
