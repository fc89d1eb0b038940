"""Where a server worker's CPU goes on Table 20's work, per image, in this process, on one core.

    python -m bench.probes.region_cpu [--batches N] [--rounds R] [--tf]

About a minute on a 2-core machine (two more with ``--tf``); prints tables (nothing written). Run
it under ``taskset -c N`` for one core. Table 20 (bench/tables/table_decode.py) times whole
loaders, every process of each; this splits one worker's share, so that a change to the region
path shows where it moved, without a server, a client or a second process:

A. ``_Worker.run`` (server/compute/worker.py) in this process on the large photos, Table 20's
   ``RandomResizedCrop(224)`` + ``HorizontalFlip`` at batch 64, the dataset with ``reduced_decode``
   on (region decoding) and off (a full OpenCV decode), one OpenCV thread, ``time.process_time``
   (the one thread's CPU: what the machine's other load disturbs least); the same ``batches``
   tasks each round, medians of ``rounds``. The region path's rounds, B and C come first, the full
   decodes after: a full decode's buffers (5 MB) raise glibc's mmap threshold, after which the
   region path's allocations and page faults differ (0.1 ms per image measured), and a server's
   worker decoding regions never saw them. To compare two commits, run this on each, one after
   the other, a few times (the machine's load moves every figure by as much).
B. The region path by stage: each piece wrapped in a timer (about 1 us each, in the total), one more
   round: read, header, crop draw, region decode (the C call, and its Python around it), the
   checks, the resize of the window, the rest of the first transform and the flip, the copy into
   the batch, and what is left (the loop, the clock).
C. The floor under the decode: the same region decodes replayed (one thread, no Python between),
   against libjpeg's entropy decoding alone of the rows down to each region's last row
   (``_jpeg_region.entropy``: ``jpeg_skip_scanlines``), which any decoder of these baseline JPEGs
   must do (no restart markers: a row is found only by decoding every row above it); and of those
   the rows above the region (the part ``jpeg_skip_scanlines`` passes).
D. PSNR of region decoding against ``reduced_decode: false``, every image of A's tasks.
E. ``--tf``: tf.data's ``_crop_pipeline`` (bench/peers/tf_peer.py: ``decode_and_crop_jpeg``,
   bilinear resize, flip) in this process with one thread (``tf.config.threading``, a private
   pool of one), the same number of images, built up stage by stage.
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import statistics
import time
import uuid

import numpy as np

from bench.fixtures import data
from bench.report import md_table

BATCH = 64


def _worker(folder, reduced_decode: bool):
    """(worker, slot, pipeline key, pipeline text) for the large photos, Table 20's pipeline."""
    import albumentations as A
    import cv2

    from batchd.server.compute import pipeline as server_pipelines
    from batchd.server.compute.worker import _Worker
    from batchd.server.config import ImageFolderConfig
    from batchd.server.data.datasets import open_dataset
    from batchd.server.shm import Segment
    from bench.tables import table_decode

    cv2.setNumThreads(1)
    cfg = ImageFolderConfig(kind="imagefolder", root=folder, reduced_decode=reduced_decode)
    open_dataset("large", cfg, data.LOCAL_CACHE, build=True)
    text = server_pipelines.canonical_json(A.to_dict(table_decode.compose()))
    prefix = f"bregion{uuid.uuid4().hex[:6]}-"
    slot = Segment.create(f"{prefix}slot", 64 << 20)
    return _Worker(0, {"large": cfg}, data.LOCAL_CACHE, prefix), slot, server_pipelines.pipeline_key(text), text


class _Run:
    """One worker and its slot; ``batch(ix, b)`` builds a batch and returns its image bytes."""

    def __init__(self, folder, reduced_decode: bool):
        from batchd.sampler import sample_key

        self.worker, self.slot, self.key, self.text = _worker(folder, reduced_decode)
        self.random_key = sample_key(seed=1, epoch=0)
        self.ids = iter(range(1 << 30))

    def batch(self, ix: np.ndarray, b: int) -> np.ndarray:
        from batchd.server.compute.protocol import Task

        task = Task(next(self.ids), "large", self.key, self.text, ix, self.random_key, np.arange(BATCH) + BATCH * b,
                    self.slot.name, self.slot.capacity)
        done = self.worker.run(task)
        image = next(t for t in done.tensors if t.name == "image")
        return np.frombuffer(self.slot.buf, np.uint8, count=math.prod(image.shape), offset=image.offset
                             ).reshape(image.shape).copy()

    def close(self) -> None:
        self.slot.close()
        self.slot.unlink()
        for seg in list(self.worker.segments.values()):
            seg.close()


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def worker_cpu(run: _Run, tasks: list[np.ndarray], rounds: int) -> tuple[list[float], list[np.ndarray]]:
    """Part A for one worker: (CPU ms per image of each round, the images of the warm-up round)."""
    out: list[float] = []
    images: list[np.ndarray] = []
    for r in range(rounds + 1):  # the first round warms up (pipelines built, pages read), untimed
        t0 = time.process_time()
        got = [run.batch(ix, b) for b, ix in enumerate(tasks)]
        if r:
            out.append(1000 * (time.process_time() - t0) / (len(tasks) * BATCH))
        else:
            images = got
    return out, images


def stages(run: _Run, tasks: list[np.ndarray]) -> dict[str, float]:
    """Part B: CPU ms per image of each piece of the region path (wrapped timers, one round)."""
    from batchd.server.compute import collate, region, samples, targets, worker
    from batchd.server.data import scaled_jpeg

    acc: dict[str, float] = collections.defaultdict(float)
    clock = time.process_time
    restore = []

    def timed(owner, name, label):
        fn = getattr(owner, name)

        def wrapper(*a, **k):
            t0 = clock()
            try:
                return fn(*a, **k)
            finally:
                acc[label] += clock() - t0
        restore.append((owner, name, fn))
        setattr(owner, name, wrapper)

    class Extension:  # the C calls, timed
        def __init__(self, ext):
            for name in ("decode", "resample", "entropy"):
                if hasattr(ext, name):
                    setattr(self, name, (lambda fn, label: lambda *a: _timed_call(fn, label, a))(getattr(ext, name), name))

    def _timed_call(fn, label, a):
        t0 = clock()
        try:
            return fn(*a)
        finally:
            acc["C " + label] += clock() - t0

    ds = run.worker.dataset("large")
    timed(samples.WorkerSamples, "_take", "read")
    timed(type(ds), "decoded_size", "header")
    timed(region.FirstStep, "draw", "crop draw")
    timed(type(ds), "decode_sample", "decode")
    timed(samples.WorkerSamples, "_checked", "checks")
    timed(targets.TargetPipeline, "end_first", "first transform + rest")
    timed(region.FirstStep, "image", "first transform's image")
    timed(region, "resample", "resize")
    timed(collate.BatchWriter, "add", "copy into the batch")
    timed(worker._Worker, "run", "total")
    ext = scaled_jpeg._region()
    if ext is not None:
        restore.append((scaled_jpeg, "_region", scaled_jpeg._region))
        wrapped = Extension(ext)
        scaled_jpeg._region = lambda: wrapped
    try:
        for b, ix in enumerate(tasks):
            run.batch(ix, b)
    finally:
        for owner, name, fn in reversed(restore):
            setattr(owner, name, fn)
    n = len(tasks) * BATCH
    ms = {k: 1000 * v / n for k, v in acc.items()}
    out = {
        "read (the file's bytes)": ms["read"],
        "header (size, EXIF orientation)": ms["header"],
        "crop draw (albumentations' own draws)": ms["crop draw"],
        "region decode: libjpeg (C)": ms.get("C decode", 0.0),
        "region decode: Python around it": ms["decode"] - ms.get("C decode", 0.0),
        "checks (targets, on the full frame)": ms["checks"],
        "resize of the window to 224 x 224": ms["resize"],
        "first transform's glue": ms["first transform's image"] - ms["resize"],
        "flip and the Compose's steps": ms["first transform + rest"] - ms["first transform's image"],
        "copy into the batch": ms["copy into the batch"],
    }
    out["other (loop, clock, timers)"] = ms["total"] - sum(out.values())
    out["total"] = ms["total"]
    return out


def floor(folder, tasks: list[np.ndarray], rounds: int) -> dict[str, float] | None:
    """Part C: ms per image of the region decodes of ``tasks`` replayed, and of libjpeg's entropy
    decoding alone down to each region's last row, and of the rows above it; None without the
    region decoder."""
    from batchd.server.data import scaled_jpeg

    ext = scaled_jpeg.extension()
    if ext is None:
        return None
    run = _Run(folder, True)
    calls: list[tuple[bytes, int, tuple[int, int, int, int]]] = []
    decode_region = scaled_jpeg.decode_region

    def recording(buf, m, rect):
        calls.append((bytes(buf), m, rect))
        return decode_region(buf, m, rect)
    scaled_jpeg.decode_region = recording
    try:
        for b, ix in enumerate(tasks):
            run.batch(ix, b)
    finally:
        scaled_jpeg.decode_region = decode_region
        run.close()
    cases = {"region decode (libjpeg, replayed)": lambda d, m, r: ext.decode(d, m, *r),
             "entropy decoding down to the region's last row": lambda d, m, r: ext.entropy(d, m, r[1] + r[3]),
             "  of which the rows above the region": lambda d, m, r: ext.entropy(d, m, r[1])}
    out: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            t0 = time.process_time()
            for d, m, r in calls:
                fn(d, m, r)
            out[name].append(1000 * (time.process_time() - t0) / len(calls))
    return {name: statistics.median(v) for name, v in out.items()}


def tf_stages(folder, images: int, rounds: int) -> dict[str, float]:
    """Part E: tf.data's crop pipeline in one thread, CPU ms per image, built up stage by stage."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
    import tensorflow as tf

    from bench.peers import tf_peer

    tf.config.threading.set_inter_op_parallelism_threads(1)
    tf.config.threading.set_intra_op_parallelism_threads(1)
    paths = [str(folder / f) for f in data.photo_files(folder)]
    order = np.random.default_rng(0).integers(0, len(paths), images)
    whole = tf.constant([[[0.0, 0.0, 1.0, 1.0]]])

    def load(stage):
        def fn(path, label, position):  # tf_peer._crop_pipeline's load, cut after `stage`
            keys = tf.random.experimental.stateless_split(tf.stack([tf.constant(7, tf.int64), position]), num=2)
            raw = tf.io.read_file(path)
            if stage == 0:
                return tf.zeros((224, 224, 3), tf.uint8), label
            begin, size, _ = tf.image.stateless_sample_distorted_bounding_box(
                tf.io.extract_jpeg_shape(raw), bounding_boxes=whole, seed=keys[0], min_object_covered=0.0,
                aspect_ratio_range=tf_peer.CROP_RATIO, area_range=tf_peer.CROP_AREA, max_attempts=10,
                use_image_if_no_bounding_boxes=True)
            y, x, _ = tf.unstack(begin)
            h, w, _ = tf.unstack(size)
            if stage == 1:
                return tf.zeros((224, 224, 3), tf.uint8) + tf.cast(y + x + h + w, tf.uint8), label
            image = tf.image.decode_and_crop_jpeg(raw, tf.stack([y, x, h, w]), channels=3)
            if stage == 2:
                return tf.zeros((224, 224, 3), tf.uint8) + image[0, 0, 0], label
            image = tf.image.resize(image, (tf_peer.CROP_SIZE, tf_peer.CROP_SIZE))
            image = tf.image.stateless_random_flip_left_right(image, seed=keys[1])
            return tf.cast(tf.clip_by_value(image, 0.0, 255.0), tf.uint8), label
        return fn

    names = ("read, batch", "+ crop draw (header)", "+ decode_and_crop_jpeg", "+ resize, flip (all)")
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        for stage, name in enumerate(names):
            ds = tf_peer._batched(tf, load(stage), paths, [0] * len(paths), order, 1, BATCH)
            t0 = time.process_time()
            n = sum(int(image.shape[0]) for image, _ in ds)
            if r:
                out[name].append(1000 * (time.process_time() - t0) / n)
    return {name: statistics.median(v) for name, v in out.items()}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=8, help="tasks of 64 per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tf", action="store_true", help="also tf.data's crop pipeline in one thread (part E)")
    args = ap.parse_args(argv)
    folder = data.ensure_large_photos()
    n = len(data.photo_files(folder))
    rng = np.random.default_rng(0)
    tasks = [rng.integers(0, n, BATCH) for _ in range(args.batches)]
    runs = {"region": _Run(folder, True), "full": _Run(folder, False)}
    try:  # the region path first: a full decode's large buffers change the allocator's state after
        region, region_images = worker_cpu(runs["region"], tasks, args.rounds)
        parts = stages(runs["region"], tasks)
        low = floor(folder, tasks, args.rounds)
        full, full_images = worker_cpu(runs["full"], tasks, args.rounds)
    finally:
        for run in runs.values():
            run.close()
    psnr = [_psnr(a, b) for x, y in zip(region_images, full_images) for a, b in zip(x, y)]
    region_ms, full_ms = statistics.median(region), statistics.median(full)
    print(f"{args.batches} tasks of {BATCH} large photos, RandomResizedCrop(224) + HorizontalFlip(p=0.5), "
          f"one thread, medians of {args.rounds} rounds\n")
    print(md_table(["worker", "CPU ms / image"], [["reduced_decode on (region decoding)", f"{region_ms:.3f}"],
                                                  ["reduced_decode: false (full decode)", f"{full_ms:.3f}"]]))
    print("\nB. The region path by stage (one more round, each piece timed):\n")
    print(md_table(["stage", "CPU ms / image", "share"],
                   [[k, f"{v:.3f}", f"{v / parts['total']:.0%}"] for k, v in parts.items()]))
    if low is not None:
        print("\nC. The floor under the region decode (the same decodes replayed, one thread):\n")
        print(md_table(["libjpeg", "CPU ms / image"], [[k, f"{v:.3f}"] for k, v in low.items()]))
    finite = [min(x, 99.0) for x in psnr]
    print(f"\nD. Region decoding against reduced_decode: false, {len(psnr)} images: mean PSNR {np.mean(finite):.1f} dB, "
          f"lowest {min(psnr):.1f} dB, {sum(math.isinf(x) for x in psnr)} equal byte for byte")
    if args.tf:
        tf_ms = tf_stages(folder, args.batches * BATCH, args.rounds)
        print("\nE. tf.data's crop pipeline (bench/peers/tf_peer.py), one thread, built up stage by stage:\n")
        print(md_table(["tf.data", "CPU ms / image"], [[k, f"{v:.3f}"] for k, v in tf_ms.items()]))


if __name__ == "__main__":
    main()
