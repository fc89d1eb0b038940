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
"""

from __future__ import annotations

import collections
import os
import pickle
import random
import signal
import traceback
from multiprocessing.connection import Connection
from typing import Any, Callable

import numpy as np

from batchd.errors import SampleError, ShapeMismatchError
from batchd.server.compute import encoded, python_pipeline
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.collate import BatchWriter
from batchd.server.compute.plan import Plan, make_plan
from batchd.server.compute.protocol import BatchDone, Ready, Shutdown, Task, TaskFailed
from batchd.server.compute.samples import DECODE_KINDS, WorkerSamples
from batchd.server.compute.stages import IDLE, PIPELINE, WRITE, StageBoard, StageClock
from batchd.server.data.cache import SharedCache
from batchd.server.data.datasets import PER_OBJECT_FIELDS, Dataset, FieldSpec, open_dataset
from batchd.server.data.datasets.python import add_python_path
from batchd.server.data.datasets.values import as_value
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT, SampleReader
from batchd.server.shm import Segment

_CACHED_SEGMENTS = 16
_CACHED_PIPELINES = 32
# mean number of samples between two checks of a kind: python dataset's keying while serving
# (``_Worker.recheck``: the sample built a second time, watched); the gaps are random
RECHECK_EVERY = 256


class _Worker(WorkerSamples):
    """Builds batches in a worker process: opens datasets and pipelines on first use (kept), reads
    the samples of its tasks ahead, and writes each batch into its slot (``run``). One sample's
    way through read, decode and the cached prefix is ``samples.py``'s; the pipeline's plan
    ``plan.py``'s."""

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
        # when to check a kind: python sample's keying next (recheck): drawn by batchd's own
        # generator, seeded by the OS, never one a dataset draws from (so the bytes do not depend on it)
        self._gaps = random.Random()
        self._until_recheck = self._gap()
        self.decodes = dict.fromkeys(DECODE_KINDS, 0)  # the running batch's decodes by kind (samples.py)
        self.decoded_pixels = 0  # ... and the pixels they decoded

    def prefetch(self, task: Task) -> None:
        """Start reading ``task``'s samples (after those of the tasks before it), if its dataset
        reads from storage. Never raises: a task whose dataset cannot be opened fails in ``run``."""
        try:
            if task.sources:
                self._prefetch_mix(task)
                return
            ds = self.dataset(task.dataset)
            if ds.concurrent_reads:
                self.reader.add(task.task_id, self._reads(task, ds), task.indices.tolist())
        except Exception:
            pass

    def _prefetch_mix(self, task: Task) -> None:
        """A mix's task: the reader's item k is sample k, read from its source's storage (nothing for
        a source held in memory: ``_load`` forgets those)."""
        reads = []
        for name, key, text in task.sources:
            ds = self.dataset(name)
            reads.append(self._reads(task, ds, self._plan(key, text)) if ds.concurrent_reads else None)
        if all(r is None for r in reads):
            return
        ids, indices = task.source_ids.tolist(), task.indices.tolist()

        def read(k: int):
            r = reads[ids[k]]
            return None if r is None else r(indices[k])
        self.reader.add(task.task_id, read, range(len(indices)))

    def dataset(self, name: str) -> Dataset:
        ds = self.datasets.get(name)
        if ds is None:
            ds = self.datasets[name] = open_dataset(name, self.dataset_configs[name], self.cache_dir, build=False)
            declared = {f.name: f.per_object for f in ds.fields}
            self.per_object[name] = lambda field: declared.get(field, field in PER_OBJECT_FIELDS)
        return ds

    def _gap(self) -> int:
        """Samples until the next ``recheck``: 1 + exponential of mean ``RECHECK_EVERY`` - 1."""
        return 1 + int(self._gaps.expovariate(1.0 / max(RECHECK_EVERY - 1, 1e-9))) if RECHECK_EVERY > 1 else 1

    def recheck(self, ds: Dataset, index: int, key: np.ndarray, sample: dict) -> None:
        """At random intervals (``RECHECK_EVERY`` samples on average), build a ``kind: python``
        sample (just built: ``sample``) a second time under the same key and raise
        ``UnkeyableRandomnessError`` naming the dataset if randomness batchd cannot key shows
        (``PythonDataset.check_keyed``). Not for ``deterministic: false`` datasets."""
        check = getattr(ds, "check_keyed", None)
        if check is None or not getattr(ds, "deterministic", True):
            return
        self._until_recheck -= 1
        if self._until_recheck > 0:
            return
        self._until_recheck = self._gap()
        check(index, key, sample)

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
        mix = _MixSources(self, task) if task.sources else None
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


class _MixSources:
    """A mix's task in the worker: each sample's dataset, plan and on_error by its source
    (``Task.source_ids``), the ``source`` field it gains (int64, the source's place in the mix),
    and messages naming the source of a sample that does not collate with the others."""

    def __init__(self, worker: _Worker, task: Task):
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


def _as_hwc_array(image: Any, dataset: str, index: int) -> np.ndarray:
    if not isinstance(image, np.ndarray):
        raise TypeError(
            f"dataset {dataset!r}, sample {index}: the pipeline returned {type(image).__name__}, not a numpy "
            "array (drop ToTensorV2: batchd returns [B, H, W, C] arrays and the client makes tensors)"
        )
    if image.ndim == 2:
        image = image[:, :, None]
    return image


def _failure(task_id: int, worker_id: int, exc: BaseException) -> TaskFailed:
    tb = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))  # some exceptions pickle but do not unpickle
        error = exc
    except Exception:
        error = None
    # notes (e.g. "while applying the pipeline to dataset ..., sample ...") name the sample; the
    # message is all a client sees when the exception travels as a WorkerError
    message = "\n".join([str(exc), *(n for n in getattr(exc, "__notes__", ()) if isinstance(n, str))])
    return TaskFailed(task_id, worker_id, error, type(exc).__name__, message, tb)


def _parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class _Inbox:
    """The worker's end of the pipe: tasks taken as soon as they arrive (started reading, then run
    in arrival order), and whether the server said Shutdown or went away (``open`` False)."""

    def __init__(self, conn: Connection, worker: _Worker):
        self.conn, self.worker = conn, worker
        self.tasks: collections.deque[Task] = collections.deque()
        self.open = True

    def drain(self) -> None:
        """Take every message already in the pipe, without waiting."""
        try:
            while self.open and self.conn.poll():
                self._put(self.conn.recv())
        except (EOFError, OSError):
            self.open = False

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message; True if one came (or the pipe closed)."""
        try:
            if not self.conn.poll(timeout):
                return False
            self._put(self.conn.recv())
        except (EOFError, OSError):
            self.open = False
        return True

    def _put(self, msg) -> None:
        if isinstance(msg, Shutdown):
            self.open = False
        else:
            self.tasks.append(msg)
            self.worker.prefetch(msg)


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
    inbox = _Inbox(conn, worker)
    worker.between_samples = inbox.drain
    conn.send(Ready(worker_id, os.getpid()))
    while True:
        inbox.drain()
        if not inbox.open:
            return
        if not inbox.tasks:
            if not inbox.wait(1.0) and not _parent_alive(server_pid):
                return
            continue
        task = inbox.tasks.popleft()
        try:
            reply: BatchDone | TaskFailed = worker.run(task)
        except Exception as e:
            reply = _failure(task.task_id, worker_id, e)
        try:
            conn.send(reply)
        except (BrokenPipeError, OSError):
            return
        except Exception as e:  # the reply itself did not pickle
            conn.send(_failure(task.task_id, worker_id, e))