"""Table 11: what batching samples as dicts of fields costs a worker, against the work of the batch.

    python -m bench.tables.table_collate [--runs 7]

Before issue 19 a worker wrote each sample's image straight into the batch's slot
(``images[n] = image``, then ``labels[n] = label``). Now ``BatchWriter`` (server/compute/collate.py)
does it for every field of a sample dict: still one copy per value, straight into the slot, plus
per-field checks (dtype, shape) in Python. In this process, as a worker runs (one OpenCV thread):

- work: a real ``_Worker.run`` per batch (read, decode, pipeline, write), its own timings, ms;
- the same batch's pipeline outputs (computed once, kept) written into a slot both ways, back to
  back, alternating which goes first: the old loop (image and label) and ``BatchWriter``;
- cost: the median of the paired (new - old) / work, per batch.

Rows: photos (bench/fixtures/make_photos.py, made if missing) with L3, 64 per batch, and Fashion-MNIST's
training set with the ``train`` preset of examples/fashion_mnist.yaml, 256 per batch (the
smallest images: where a per-sample overhead shows most). Target: cost under 1%.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import time

import cv2
import numpy as np

from batchd.sampler import global_positions, sample_key
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.collate import BatchWriter
from batchd.server.compute.layout import align
from batchd.server.compute.protocol import Task
from batchd.server.compute.stages import STAGES
from batchd.server.compute.worker import _Worker
from batchd.server.config import load_config
from batchd.server.shm import Segment
from bench import ROOT, common
from bench.fixtures import data, pipelines as bench_pipelines
from bench.measure import median
from bench.report import md_table

NAME = "table11"
TITLE = "Table 11: what batching samples as dicts of fields costs a worker (ms per batch, in-process)"
FMNIST_ROOT = pathlib.Path("/usr/share/datasets/fashion-mnist")
EXAMPLE_CONFIG = ROOT / "examples" / "fashion_mnist.yaml"
TARGET = 0.01


def _datasets(quick: bool):
    data.ensure_photos()
    yield "photos, L3", "photos", common.photos_config(), pipelines.canonical_json(bench_pipelines.preset("L3")), 64, \
        (128 if quick else 384)
    if (FMNIST_ROOT / "train-images-idx3-ubyte.gz").exists():
        cfg = load_config(EXAMPLE_CONFIG)
        yield "Fashion-MNIST, train preset", "fmnist-train", cfg.datasets["fmnist-train"], cfg.pipeline_json("train"), \
            256, (1024 if quick else 4096)
    else:
        print(f"Fashion-MNIST is not installed in {FMNIST_ROOT}: its row is left out", file=sys.stderr)


def _old(buf: memoryview, outputs, indices, positions) -> float:
    """Seconds: the write loop of the worker before samples were dicts (image, label, index, position)."""
    t0 = time.thread_time()
    b = len(outputs)
    first = outputs[0]["image"]
    images = np.ndarray((b, *first.shape), first.dtype, buf, 0)
    offset = align(images.nbytes)
    labels = np.ndarray((b,), np.int64, buf, offset)
    kept = np.ndarray((b,), np.int64, buf, offset + align(8 * b))
    kept_positions = np.ndarray((b,), np.int64, buf, offset + 2 * align(8 * b))
    for n, (sample, index, position) in enumerate(zip(outputs, indices, positions)):
        image = sample["image"]
        if image.shape != first.shape or image.dtype != first.dtype:
            raise AssertionError("the old loop needs one shape")
        images[n] = image
        labels[n] = sample["label"]
        kept[n] = index
        kept_positions[n] = position
    del images, labels, kept, kept_positions
    return time.thread_time() - t0


def _new(buf: memoryview, outputs, indices, positions) -> float:
    """Seconds: BatchWriter writing the same samples (every field, checked)."""
    t0 = time.thread_time()
    writer = BatchWriter(len(outputs), per_object=lambda name: False, describe=str, alloc=lambda n, keep: buf)
    for sample, index, position in zip(outputs, indices, positions):
        writer.add(sample, index, position)
    writer.finish()
    return time.thread_time() - t0


def measure(quick: bool, runs: int) -> dict:
    cv2.setNumThreads(1)  # as in batchd's workers
    key = sample_key(seed=7, epoch=0)
    out = {}
    for label, name, cfg, text, batch, count in _datasets(quick):
        ds = common.open_local(name, cfg)  # builds the index the worker opens
        indices = list(range(min(count, len(ds))))
        positions = global_positions(0, len(indices), rank=0, world_size=1).tolist()
        prefix = f"batchd-bench11-{os.getpid()}-"
        slot = Segment.create(f"{prefix}slot", 64 << 20)
        scratch = Segment.create(f"{prefix}scratch", 64 << 20)
        worker = _Worker(0, {name: cfg}, data.LOCAL_CACHE, prefix)
        try:
            plan = worker._plan(pipelines.pipeline_key(text), text)
            work, pairs = [], []
            for run in range(runs):
                for start in range(0, len(indices) - batch + 1, batch):
                    ix, pos = indices[start:start + batch], positions[start:start + batch]
                    task = Task(start, name, pipelines.pipeline_key(text), text, np.asarray(ix, np.int64), key,
                                np.asarray(pos, np.int64), slot.name, slot.capacity)
                    timings = worker.run(task).timings
                    work.append(sum(timings[s] for s in STAGES))  # the worker's whole batch: read .. write
                    outputs = []
                    for i, p in zip(ix, pos):
                        sample = ds.load_sample(i, plan.min_size)
                        worker.random.start(key, p)
                        outputs.append(plan.rest(plan.prefix(sample, lambda f: False), lambda f: False))
                    if (run + start // batch) % 2:
                        new = _new(scratch.buf, outputs, ix, pos)
                        old = _old(scratch.buf, outputs, ix, pos)
                    else:
                        old = _old(scratch.buf, outputs, ix, pos)
                        new = _new(scratch.buf, outputs, ix, pos)
                    pairs.append((old, new, work[-1]))
                    del outputs
        finally:
            worker.reader.close()
            for seg in list(worker.segments.values()):
                seg.close()
            for seg in (slot, scratch):
                seg.close()
                seg.unlink()
        out[label] = {"batch": batch, "batches": len(pairs), "work_ms": median(work) * 1e3,
                      "old_ms": median(o for o, _, _ in pairs) * 1e3, "new_ms": median(n for _, n, _ in pairs) * 1e3,
                      "cost": median((n - o) / w for o, n, w in pairs)}
    return out


def run(s, log=print) -> dict:
    """Table 11 for ``bench/run_all.py``: --quick measures fewer batches and runs."""
    return {"datasets": measure(s.quick, 3 if s.quick else 7)}


def render(r: dict) -> str:
    rows = [[label, d["batch"], d["batches"], f"{d['work_ms']:.2f}", f"{d['old_ms']:.3f}", f"{d['new_ms']:.3f}",
             f"{d['cost']:+.2%}"] for label, d in r["datasets"].items()]
    return "\n".join([
        md_table(["dataset, pipeline", "batch", "batches", "work ms/batch (worker)", "old write ms/batch",
                  "BatchWriter ms/batch", f"cost (target < {TARGET:.0%})"], rows),
        "",
        "Work: ``_Worker.run``'s own timings (read, decode, pipeline, write into the slot). Old write: the worker's "
        "loop before samples were dicts; BatchWriter: server/compute/collate.py on the same pipeline outputs, the two "
        "back to back (alternating which first). Medians; cost is the median of the paired (new - old) / work.",
    ])


def targets(r: dict) -> list[dict]:
    return [{"name": f"batching fields costs under {TARGET:.0%} of a worker's work ({label})",
             "passed": d["cost"] < TARGET, "detail": f"{d['cost']:+.2%}"} for label, d in r["datasets"].items()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=7, help="passes over the samples")
    p.add_argument("--quick", action="store_true", help="fewer samples")
    args = p.parse_args(argv)
    r = {"datasets": measure(args.quick, args.runs)}
    print(TITLE)
    print(render(r))
    for t in targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
