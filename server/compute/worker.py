"""The worker process: read, decode, transform and stack whole batches into shared memory.

``worker_main`` runs in a process started by the server's ``forkserver`` context (never forked
from the process that runs gRPC). It opens the datasets read-only (memory-mapped indexes),
answers each ``Task`` with exactly one ``BatchDone`` or ``TaskFailed``, in the order the tasks came,
and never raises across the pipe. It exits on ``Shutdown``, on EOF, or within a second of the
server disappearing.

The scheduler sends a worker its next tasks before the current one finishes. The worker takes
them from the pipe as they come (between samples) and hands their samples to its
``SampleReader`` (``server/data/reader.py``), whose I/O threads read the bytes of the current and the
queued tasks' samples concurrently (``reads_in_flight``), while this process's own thread
decodes and transforms them one at a time, in order (so bytes and order do not change).
Datasets whose samples are in memory (no ``read_bytes``) are read on this thread. With a
server cache (config ``cache:``), a sample's decode and its pipeline's deterministic prefix
(``server/compute/prefix.py``) come from the shared cache (``server/data/cache/``) or are computed and stored
there (``samples.py``); the pipeline's random rest runs here as before (its plan: ``plan.py``). A
sample for which the prefix would draw a random number (``prefix.RandomDrawn``) is built by the
whole pipeline instead, and not cached.

What is not the batch's build lives beside it: the pipe's end (``inbox.py``: tasks in,
exceptions out as ``TaskFailed``), a mix's per-source handling (``mix.py``), and the recheck of
``kind: python`` samples while serving (``recheck.py``, mixed in).
"""

from __future__ import annotations

import collections
import os
import signal
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from batchd.errors import SampleError
from batchd.server.compute import encoded, python_pipeline
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.collate import BatchWriter
from batchd.server.compute.inbox import Inbox, failure, parent_alive
from batchd.server.compute.mix import MixSources, prefetch_mix
from batchd.server.compute.plan import Plan, make_plan
from batchd.server.compute.protocol import BatchDone, Ready, Task, TaskFailed
from batchd.server.compute.recheck import Rechecks
from batchd.server.compute.samples import DECODE_KINDS, WorkerSamples
from batchd.server.compute.stages import IDLE, PIPELINE, WRITE, StageBoard, StageClock
from batchd.server.data.cache import SharedCache
from batchd.server.data.datasets import PER_OBJECT_FIELDS, Dataset, open_dataset
from batchd.server.data.datasets.python import add_python_path
from batchd.server.data.datasets.values import as_value
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT, SampleReader
from batchd.server.shm import Segment

_CACHED_SEGMENTS = 16
_CACHED_PIPELINES = 32


class _Worker(WorkerSamples, Rechecks):
    """Builds batches in a worker process: opens datasets and pipelines on first use (kept), reads
    the samples of its tasks ahead, and writes each batch into its slot (``run``). One sample's
    way through read, decode and the cached prefix is ``samples.py``'s; the pipeline's plan
    ``plan.py``'s; a python sample's recheck ``recheck.py``'s."""

    def __init__(self, worker_id: int, dataset_configs: dict[str, Any], cache_dir, new_segment_prefix: str,
                 reduced_decode: bool = True, reads_in_flight: int = DEFAULT_READS_IN_FLIGHT,
                 python_pipelines: dict[str, dict[str, Any]] | None = None):
        self.worker_id = worker_id
        self.python_pipelines = python_pipelines or {}  # the server config's python presets (python_pipeline.py)
        self.reduced_decode = reduced_decode
        self.dataset_configs = dataset_configs
        self.cache_dir = cache_dir
        self.new_segment_prefix = new_segment_prefix
        self.datasets: dict[str, Dataset] = {}
        self.per_object: dict[str, Callable[[str], bool]] = {}  # dataset -> whether a field is per-object
        self.pipelines: collections.OrderedDict[str, Plan] = collections.OrderedDict()
        self.segments: collections.OrderedDict[str, Segment] = collections.OrderedDict()
        self.grown = 0
        self._unadopted: Segment | None = None  # a segment this task created, until BatchDone names it
        self.random = pipelines.SampleRandom()
        self.reader = SampleReader(reads_in_flight)
        self.between_samples = lambda: None  # worker_main: take newly sent tasks from the pipe
        # the server's decoded-sample cache (None: none configured); prefix outputs are looked up there
        self.cache = SharedCache.attach(f"{new_segment_prefix}cache", worker_id)
        self.builds: dict[str, str] = {}  # dataset name -> build fingerprint
        # seconds per stage of the running batch (BatchDone.timings), and its stage on the server's board
        self.clock = StageClock(StageBoard.attach(new_segment_prefix), worker_id)
        self.cache_lookups = self.cache_misses = 0  # samples of the running batch looked up in the cache, computed
        self._start_rechecks()  # when to check a kind: python sample's keying next (recheck.py)
        self.decodes = dict.fromkeys(DECODE_KINDS, 0)  # the running batch's decodes by kind (samples.py)
        self.decoded_pixels = 0  # ... and the pixels they decoded

    def prefetch(self, task: Task) -> None:
        """Start reading ``task``'s samples (after those of the tasks before it), if its dataset
        reads from storage. Never raises: a task whose dataset cannot be opened fails in ``run``."""
        try:
            if task.sources:
                prefetch_mix(self, task)
                return
            ds = self.dataset(task.dataset)
            if ds.concurrent_reads:
                self.reader.add(task.task_id, self._reads(task, ds), task.indices.tolist())
        except Exception:
            pass

    def dataset(self, name: str) -> Dataset:
        ds = self.datasets.get(name)
        if ds is None:
            ds = self.datasets[name] = open_dataset(name, self.dataset_configs[name], self.cache_dir, build=False)
            declared = {f.name: f.per_object for f in ds.fields}
            self.per_object[name] = lambda field: declared.get(field, field in PER_OBJECT_FIELDS)
        return ds

    def pipeline(self, key: str, text: str) -> tuple[Any, tuple[int, int] | None]:
        """(Compose or None, the size images may be decoded down to) for a pipeline, cached."""
        plan = self._plan(key, text)
        return plan.compose, plan.min_size

    def _plan(self, key: str, text: str) -> Plan:
        """How this worker runs the pipeline ``text`` (canonical JSON, "" for none), built once per key."""
        plan = self.pipelines.get(key)
        if plan is not None:
            self.pipelines.move_to_end(key)
            return plan
        plan = self.pipelines[key] = make_plan(text, self.python_pipelines, reduced_decode=self.reduced_decode,
                                               random=self.random)
        if len(self.pipelines) > _CACHED_PIPELINES:
            self.pipelines.popitem(last=False)
        return plan

    def segment(self, name: str) -> Segment:
        seg = self.segments.get(name)
        if seg is None:
            seg = self.segments[name] = Segment.attach(name)
            while len(self.segments) > _CACHED_SEGMENTS:
                self._forget(next(iter(self.segments)))
        else:
            self.segments.move_to_end(name)
        return seg

    def _forget(self, name: str) -> None:
        seg = self.segments.pop(name)
        try:
            seg.close()
        except BufferError:
            pass

    def run(self, task: Task) -> BatchDone:
        """Build ``task``'s batch in its slot (or a grown segment). Raises what building it raised:
        SampleError (unless skipped), ShapeMismatchError, ResourceExhaustedError, pipeline errors."""
        self._unadopted = None
        self.clock.start(PIPELINE)  # (building or finding its pipeline; the samples' stages follow)
        try:
            return self._run(task)
        except BaseException:
            # a segment grown for a batch that failed is adopted by no one: remove it, or it
            # stays in /dev/shm (even after the server stops) with every failed task
            seg, self._unadopted = self._unadopted, None
            if seg is not None:
                self._forget(seg.name)
                seg.unlink()
            raise
        finally:
            self.clock.enter(IDLE)
            self.reader.discard(task.task_id)

    def timings(self, task: Task) -> dict[str, float]:
        """``BatchDone.timings`` of the batch ending now (see ``server/compute/stages.py``)."""
        return {**self.clock.stop(), "read_io": self.reader.io_seconds(task.task_id), "started": self.clock.started,
                "cache_hits": float(self.cache_lookups - self.cache_misses),
                **{f"decode_{kind}": float(n) for kind, n in self.decodes.items()},
                "decoded_pixels": float(self.decoded_pixels)}

    def _run(self, task: Task) -> BatchDone:
        if task.encoding == "jpeg":  # the files as they are, for the client to decode
            return encoded.build_batch(self, task)
        ds = self.dataset(task.dataset)
        plan = self._plan(task.pipeline_key, task.pipeline_json)
        per_object = self.per_object[ds.name]
        skipped: list[tuple[int, str, str]] = []
        slot: list = [None, False]  # the segment written, and whether it is a new (grown) one
        mix = MixSources(self, task) if task.sources else None
        skip = task.skip_bad_samples

        def alloc(nbytes: int, keep: int) -> memoryview:
            seg, grown = self._slot(task, nbytes, slot[0] if keep else None, keep)
            slot[0], slot[1] = seg, slot[1] or grown
            return seg.buf
        if mix is None:
            writer = BatchWriter(len(task.indices), per_object=per_object, alloc=alloc, max_bytes=task.max_batch_bytes,
                                 describe=lambda i: f"sample {i} ({ds.source(i)})", specs=ds.fields, dataset=ds.name)
        else:
            writer = mix.writer(len(task.indices), alloc, task.max_batch_bytes)
        self.prefetch(task)  # no-op if it came ahead of time
        clock, self.cache_lookups, self.cache_misses = self.clock, 0, 0
        self.decodes, self.decoded_pixels = dict.fromkeys(DECODE_KINDS, 0), 0
        # a first random crop drawn ahead of a decode at the scale it needs (region.py): reduced
        # decoding on, samples read from storage (such a pipeline is never cached: _cache_key)
        # (per source in a mix)
        reads = task.task_id in self.reader
        region = reads and plan.first is not None and getattr(ds, "reduced_decode", False) and ds.concurrent_reads
        indices, positions = task.indices.tolist(), task.positions.tolist()
        for k in clock.samples(len(indices), WRITE):  # timed one in clock.every (the rest: their share)
            index, position, on = indices[k], positions[k], clock.on
            if mix is not None:
                ds, plan, skip = mix.source(k, index)
                region = (reads and plan.first is not None and getattr(ds, "reduced_decode", False)
                          and ds.concurrent_reads)
            try:
                sample, data = self._region(ds, task, k, index, position, plan) if region else (None, None)
                if sample is None:
                    sample, prefixed = self._sample(ds, task, k, index, plan, data)
                    if on:
                        clock.enter(PIPELINE)
                    sample = self._pipeline(plan, ds, task, sample, prefixed, index, position)
            except SampleError as e:
                if not skip:
                    raise
                skipped.append((index, e.path, e.reason))
                continue
            image = sample.get("image")
            if image is not None and getattr(image, "ndim", 3) != 3:
                sample = {**sample, "image": _as_hwc_array(image, ds.name, index)}
            if mix is not None:
                sample = mix.tagged(sample, k, ds, index)
            if on:
                clock.enter(WRITE)
            if mix is None:
                writer.add(sample, index, position)
            else:
                mix.add(writer, sample, index, position)
        layout = writer.finish()
        seg, grown = slot
        return BatchDone(task.task_id, self.worker_id, seg.name, seg.capacity, grown, layout, self.timings(task),
                         tuple(skipped))

    def _pipeline(self, plan: Plan, ds: Dataset, task: Task, sample: dict, prefixed: bool, index: int,
                  position: int) -> dict:
        """The sample after the pipeline's rest (``TargetPipeline.end``) or the python pipeline,
        under the sample's stream (a python pipeline also under the global generators keyed to
        the sample, ``python_pipeline.run_keyed``). Raises what the pipeline raises (with a note naming dataset
        and sample), or SampleError naming the field for a python pipeline's field that cannot
        become an array (``values.as_value``; ``on_error: skip`` applies)."""
        if plan.fn is None and plan.targets is None:
            return sample
        try:
            if plan.fn is None:
                self.random.start(task.random_key, position)
                return plan.targets.end(sample, self.per_object[ds.name], prefixed)
            sample = python_pipeline.run_keyed(plan.fn, sample, self.random, task.random_key, position)
        except Exception as e:
            e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
            raise
        for name, value in sample.items():
            try:
                as_value(name, value)
            except TypeError as e:
                raise SampleError(ds.name, index, ds.source(index), f"the python pipeline returned {e}") from None
        return sample

    def _slot(self, task: Task, nbytes: int, old: Segment | None = None, keep: int = 0) -> tuple[Segment, bool]:
        """The task's slot if the batch fits (and nothing is written yet), else a new segment of at
        least nbytes (the server adopts it), into which the first ``keep`` bytes of ``old`` are copied."""
        if old is None and nbytes <= task.slot_capacity:
            return self.segment(task.slot_name), False
        self.grown += 1
        size = nbytes if old is None else nbytes + nbytes // 4  # a batch of lists grew: room for the next one
        seg = Segment.create(f"{self.new_segment_prefix}w{self.worker_id}-{os.getpid()}-{self.grown}", size)
        if keep:
            seg.buf[:keep] = old.buf[:keep]
        if task.slot_name in self.segments:
            self._forget(task.slot_name)
        previous, self._unadopted = self._unadopted, seg
        if previous is not None:  # grown twice for one batch: the first is adopted by no one
            self._forget(previous.name)
            previous.unlink()
        self.segments[seg.name] = seg
        return seg, True


def _as_hwc_array(image: Any, dataset: str, index: int) -> np.ndarray:
    if not isinstance(image, np.ndarray):
        raise TypeError(
            f"dataset {dataset!r}, sample {index}: the pipeline returned {type(image).__name__}, not a numpy "
            "array (drop ToTensorV2: batchd returns [B, H, W, C] arrays and the client makes tensors)"
        )
    if image.ndim == 2:
        image = image[:, :, None]
    return image


def worker_main(
    worker_id: int,
    conn: Connection,
    dataset_configs: dict[str, Any],
    cache_dir,
    segment_prefix: str,
    server_pid: int,
    reads_in_flight: int = DEFAULT_READS_IN_FLIGHT,
    python_path: tuple = (),
    python_pipelines: dict[str, dict[str, Any]] | None = None,
) -> None:
    """Serve tasks from ``conn`` until Shutdown, EOF, or the server (``server_pid``) is gone.

    A task already received when Shutdown comes is dropped (the server is not waiting for it).
    reads_in_flight: I/O threads reading samples ahead (see ``server/data/reader.py``).
    python_path: folders put first on ``sys.path`` (the config's ``python_path``), where kind
    python factories and python pipelines are imported from. python_pipelines: the config's
    python presets (name -> {python, args}), the only python pipelines this worker runs.
    """
    add_python_path(python_path)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which shuts us down
    import cv2

    cv2.setNumThreads(1)  # one worker per core; OpenCV's own threads would oversubscribe
    worker = _Worker(worker_id, dataset_configs, cache_dir, segment_prefix, reads_in_flight=reads_in_flight,
                     python_pipelines=python_pipelines)
    inbox = Inbox(conn, worker)
    worker.between_samples = inbox.drain
    conn.send(Ready(worker_id, os.getpid()))
    while True:
        inbox.drain()
        if not inbox.open:
            return
        if not inbox.tasks:
            if not inbox.wait(1.0) and not parent_alive(server_pid):
                return
            continue
        task = inbox.tasks.popleft()
        try:
            reply: BatchDone | TaskFailed = worker.run(task)
        except Exception as e:
            reply = failure(task.task_id, worker_id, e)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception as e:  # the reply itself did not pickle
            conn.send(failure(task.task_id, worker_id, e))