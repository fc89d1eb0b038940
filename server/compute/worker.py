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
there; the pipeline's random rest runs here as before. A sample for which the prefix would draw a
random number (``prefix.RandomDrawn``) is built by the whole pipeline instead, and not cached.
"""

from __future__ import annotations

import collections
import os
import pickle
import signal
import time
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from batchd.errors import ResourceExhaustedError, SampleError, ShapeMismatchError
from batchd.server.compute import encoded
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import prefix as prefixes
from batchd.server.build import build_fingerprint, build_parts
from batchd.server.data.cache import SharedCache, sample_key
from batchd.server.data.datasets import Dataset, open_dataset
from batchd.server.compute.layout import batch_layout, layout_nbytes, view
from batchd.server.compute.protocol import BatchDone, Ready, Shutdown, Task, TaskFailed, TensorLayout
from batchd.server.data.reader import DEFAULT_READS_IN_FLIGHT, SampleReader
from batchd.server.serve.shm import Segment

_CACHED_SEGMENTS = 16
_CACHED_PIPELINES = 32


class _Worker:
    def __init__(self, worker_id: int, dataset_configs: dict[str, Any], cache_dir, new_segment_prefix: str,
                 reduced_decode: bool = True, reads_in_flight: int = DEFAULT_READS_IN_FLIGHT):
        self.worker_id = worker_id
        self.reduced_decode = reduced_decode
        self.dataset_configs = dataset_configs
        self.cache_dir = cache_dir
        self.new_segment_prefix = new_segment_prefix
        self.datasets: dict[str, Dataset] = {}
        self.pipelines: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self.segments: collections.OrderedDict[str, Segment] = collections.OrderedDict()
        self.grown = 0
        self._unadopted: Segment | None = None  # a segment this task created, until BatchDone names it
        self.random = pipelines.SampleRandom()
        self.reader = SampleReader(reads_in_flight)
        self.between_samples = lambda: None  # worker_main: take newly sent tasks from the pipe
        # the server's decoded-sample cache (None: none configured); prefix outputs are looked up there
        self.cache = SharedCache.attach(f"{new_segment_prefix}cache", worker_id)
        self.splits: dict[str, prefixes.Split] = {}  # pipeline key -> its prefix and random rest
        self.builds: dict[str, str] = {}  # dataset name -> build fingerprint

    def prefetch(self, task: Task) -> None:
        """Start reading ``task``'s samples (after those of the tasks before it), if its dataset
        reads from storage. Never raises: a task whose dataset cannot be opened fails in ``run``."""
        try:
            ds = self.dataset(task.dataset)
            if ds.concurrent_reads:
                self.reader.add(task.task_id, self._reads(task, ds), task.indices.tolist())
        except Exception:
            pass

    def dataset(self, name: str) -> Dataset:
        ds = self.datasets.get(name)
        if ds is None:
            ds = self.datasets[name] = open_dataset(name, self.dataset_configs[name], self.cache_dir, build=False)
        return ds

    def pipeline(self, key: str, text: str) -> tuple[Any, tuple[int, int] | None]:
        """(Compose or None, the size images may be decoded down to) for a pipeline, cached."""
        if not key:
            return None, None
        p = self.pipelines.get(key)
        if p is None:
            compose = pipelines.build(text)
            p = self.pipelines[key] = (compose, pipelines.decode_min_size(compose) if self.reduced_decode else None)
            if len(self.pipelines) > _CACHED_PIPELINES:
                self.pipelines.popitem(last=False)
        else:
            self.pipelines.move_to_end(key)
        return p

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
            self.reader.discard(task.task_id)

    def _load(self, ds: Dataset, task: Task, k: int, index: int, min_size) -> np.ndarray:
        """Sample k of the task, decoded: its bytes from the reader if they are read ahead."""
        if task.task_id not in self.reader:
            return ds.load_image(index, min_size)
        self.between_samples()
        data = self.reader.take(task.task_id, k, self.between_samples)
        if data is None:  # in the cache when read ahead (so not read), but gone since (found corrupt)
            data = ds.read_bytes(index)
        return ds.decode(index, data, min_size)

    def _reads(self, task: Task, ds: Dataset):
        """What the reader calls per sample: ``ds.read_bytes``, or with the cache a function that
        returns None for samples already cached (their bytes are not needed)."""
        split = self._split(task.pipeline_key, *self.pipeline(task.pipeline_key, task.pipeline_json), ds)
        if split is None or task.encoding == "jpeg":
            return ds.read_bytes
        cache, build = self.cache, self.builds[ds.name]

        def read(index: int):
            key = sample_key(ds.fingerprint, index, split.canonical, build)
            return None if cache.contains(ds.name, key) else ds.read_bytes(index)
        return read

    def _run(self, task: Task) -> BatchDone:
        if task.encoding == "jpeg":  # the files as they are, for the client to decode
            return encoded.build_batch(self, task)
        ds = self.dataset(task.dataset)
        compose, min_size = self.pipeline(task.pipeline_key, task.pipeline_json)
        whole = compose
        split = self._split(task.pipeline_key, compose, min_size, ds)
        if split is not None:  # decode + prefix come from the cache; the random rest runs here
            compose = split.rest
            if whole is not None:
                self.random.attach(whole)  # for samples whose prefix would draw (_through_cache)
        if compose is not None:
            self.random.attach(compose)  # its transforms draw in turn from one stream, re-keyed per sample
        t_load = t_pipe = t_copy = 0.0
        capacity = len(task.indices)
        labels = np.empty(capacity, np.int64)
        kept = np.empty(capacity, np.int64)
        kept_positions = np.empty(capacity, np.int64)  # aligned with kept: skipped samples leave both
        skipped: list[tuple[int, str, str]] = []
        images = first_shape = first_index = None
        seg = grown = layout = None
        n = 0  # samples in the batch so far
        self.prefetch(task)  # no-op if it came ahead of time
        for k, (index, position) in enumerate(zip(task.indices.tolist(), task.positions.tolist())):
            t0 = time.perf_counter()
            pipeline = compose
            try:
                if split is None:
                    image = self._load(ds, task, k, index, min_size)
                else:
                    image, pipeline = self._through_cache(split, whole, ds, task, k, index)
            except SampleError as e:
                if not task.skip_bad_samples:
                    raise
                skipped.append((index, e.path, e.reason))
                continue
            t1 = time.perf_counter()
            if pipeline is not None:
                self.random.start(task.random_key, position)
                try:
                    image = pipeline(image=image)["image"]
                except Exception as e:
                    e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
                    raise
            image = _as_hwc_array(image, ds.name, index)
            t2 = time.perf_counter()
            if images is None:
                first_shape, first_index = image.shape, index
                layout = batch_layout(capacity, image.shape, image.dtype)
                _check_batch_bytes(task, ds.name, layout, index)
                seg, grown = self._slot(task, layout_nbytes(layout))
                images = view(seg.buf, layout[0])
            elif image.shape != first_shape or image.dtype != images.dtype:
                raise ShapeMismatchError(
                    f"dataset {ds.name!r}: sample {index} ({ds.source(index)}) is {image.dtype}{list(image.shape)} "
                    f"after the pipeline but sample {first_index} ({ds.source(first_index)}) is "
                    f"{images.dtype}{list(first_shape)}; images of a batch must have one shape "
                    "(add a Resize or crop to the pipeline)"
                )
            images[n] = image
            labels[n] = ds.label(index)
            kept[n] = index
            kept_positions[n] = position
            n += 1
            t_load += t1 - t0
            t_pipe += t2 - t1
            t_copy += time.perf_counter() - t2
        if layout is None:  # every sample was skipped: an empty batch
            spec = ds.sample_spec
            layout = batch_layout(capacity, tuple(max(d, 0) for d in spec.image_shape), np.dtype(spec.image_dtype))
            seg, grown = self._slot(task, layout_nbytes(layout))
        del images
        if n < capacity:  # the image region's prefix holds the n kept images, C order
            layout = tuple(replace(t, shape=(n, *t.shape[1:])) for t in layout)
        view(seg.buf, layout[1])[:] = labels[:n]
        view(seg.buf, layout[2])[:] = kept[:n]
        view(seg.buf, layout[3])[:] = kept_positions[:n]
        timings = {"load": t_load, "pipeline": t_pipe, "copy": t_copy}
        return BatchDone(task.task_id, self.worker_id, seg.name, seg.capacity, grown, layout, timings, tuple(skipped))

    def _through_cache(self, split: prefixes.Split, whole, ds: Dataset, task: Task, k: int, index: int):
        """(image, pipeline to run on it) for sample k: its prefix output from the cache (computed
        and stored on a miss) and ``split.rest``; or, if the prefix would draw a random number for
        this sample, its decoded image and the ``whole`` pipeline (nothing stored)."""
        decoded = []

        def compute() -> np.ndarray:
            decoded.append(self._load(ds, task, k, index, split.min_size))
            return self._prefix(split, ds, decoded[0], index)

        key = sample_key(ds.fingerprint, index, split.canonical, self.builds[ds.name])
        try:
            image = self.cache.get_or_compute(ds.name, key, compute)
        except prefixes.RandomDrawn:
            return decoded[0], whole  # the prefix transforms do not write their input
        self.reader.forget(task.task_id, k)  # a hit: the bytes read ahead are not needed
        return image, split.rest

    @staticmethod
    def _prefix(split: prefixes.Split, ds: Dataset, image: np.ndarray, index: int) -> np.ndarray:
        try:
            return split.apply_prefix(image)
        except Exception as e:
            e.add_note(f"while applying the pipeline to dataset {ds.name!r}, sample {index} ({ds.source(index)})")
            raise

    def _split(self, key: str, compose, min_size, ds: Dataset) -> prefixes.Split | None:
        """The pipeline's prefix and rest when its samples go through the cache, else None."""
        if self.cache is None or not ds.fingerprint:
            return None
        if ds.name not in self.builds:
            self.builds[ds.name] = build_fingerprint(build_parts(ds.decode_settings, cache=True))
        split = self.splits.get(key)
        if split is None:
            if len(self.splits) >= _CACHED_PIPELINES:
                self.splits.clear()
            try:
                split = prefixes.split(compose, min_size)
            except ValueError:  # the rest cannot be rebuilt: this pipeline runs whole, uncached
                return None
            self.splits[key] = split
        return split

    def _slot(self, task: Task, nbytes: int) -> tuple[Segment, bool]:
        """The task's slot if the batch fits, else a new segment of exactly nbytes (the server adopts it)."""
        if nbytes <= task.slot_capacity:
            return self.segment(task.slot_name), False
        if task.slot_name in self.segments:
            self._forget(task.slot_name)
        self.grown += 1
        seg = Segment.create(f"{self.new_segment_prefix}w{self.worker_id}-{os.getpid()}-{self.grown}", nbytes)
        self.segments[seg.name] = seg
        self._unadopted = seg
        return seg, True


def _check_batch_bytes(task: Task, dataset: str, layout: tuple[TensorLayout, ...], index: int) -> None:
    """Raise ResourceExhaustedError before allocating a batch over the server's max_batch_bytes."""
    nbytes = layout_nbytes(layout)
    if task.max_batch_bytes and nbytes > task.max_batch_bytes:
        image = layout[0]
        raise ResourceExhaustedError(
            f"dataset {dataset!r}: a batch of {image.shape[0]} images of {image.dtype}{list(image.shape[1:])} "
            f"(as sample {index} comes out of the pipeline) is {nbytes} bytes, over the server's limit of "
            f"{task.max_batch_bytes} (max_batch_bytes); use a smaller batch_size or output size"
        )


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
) -> None:
    """Serve tasks from ``conn`` until Shutdown, EOF, or the server (``server_pid``) is gone.

    A task already received when Shutdown comes is dropped (the server is not waiting for it).
    reads_in_flight: I/O threads reading samples ahead (see ``server/data/reader.py``).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the server, which shuts us down
    import cv2

    cv2.setNumThreads(1)  # one worker per core; OpenCV's own threads would oversubscribe
    worker = _Worker(worker_id, dataset_configs, cache_dir, segment_prefix, reads_in_flight=reads_in_flight)
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
