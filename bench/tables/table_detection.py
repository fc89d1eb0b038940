"""Table 13: COCO-format detection loading with boxes and masks, boxes in COCO's format under a cached prefix.

    python -m bench.tables.table_detection [--quick] [--repeats 3]

Data: ``bench/data/fashion-coco-384`` (examples/make_fashion_coco.py, made once: 1,000 JPEG
canvases of 384-512 px with up to 8 Fashion-MNIST items each; a COCO JSON whose masks are
polygons, compressed and uncompressed RLE). Pipeline ``det-train``: LongestMaxSize(448) and
PadIfNeeded(448, 448) (the deterministic prefix, which the server caches), then RandomCrop(384,
384), HorizontalFlip and RandomBrightnessContrast, under ``BboxParams(format="coco",
label_fields=[labels], min_visibility=0.3)``: boxes arrive as COCO's [x, y, w, h], and boxes,
masks and every per-object field move and drop together. Batch 8.

**Throughput** (images/s and CPU per image, 2 workers each, medians of interleaved repeats):

- DataLoader: a torch ``Dataset`` doing the same work as torchvision's detection references
  (``bench/peers/torch_coco.py``: OpenCV decode, pycocotools' ``annToMask``, the same albumentations
  Compose with the boxes given in COCO's format), ``collate_fn=lambda x: tuple(zip(*x))``,
  persistent forkserver workers;
- batchd: ``kind: coco`` with ``masks: true``, ``RemoteDataLoader(..., collate_fn=batchd.detection_collate)``
  (the same (images, targets) structure), over shared memory and over TCP (inline bytes), without
  a cache; and over shared memory with the decoded-sample cache (``cache: {memory_bytes: 3GiB,
  compress: true}``) warmed by one pass over the dataset first, so that the timed batches are
  cache hits (the prefix's output: image, masks and boxes in albumentations' internal format);
- the sequential loop (the same Dataset read in the training process: DataLoader(num_workers=0)).

CPU per image counts every process of this tree during the timed window (client, server, workers,
DataLoader workers). Targets: batchd shared memory, cache off and on, >= 1.0x the DataLoader's images/s.

**Loading time per sample beside a training step** (the classic asynchronous-loader table): a
training step modelled by ``time.sleep(T2)`` (a GPU step frees the CPU) with T2 = 0.5, 1 and 2 x
T1, T1 = the sequential loop's time to build a batch; per method the step time and the time per
sample the loop spends waiting for data (sequential: all of the loading; batchd and DataLoader
with 2 workers: what overlapping leaves).
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import time

from bench import common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.fixtures.trainer import SleepStep, train_loop
from bench.measure import median, spread, time_stream
from bench.noise import measure
from bench.report import fx, md_table

NAME = "table13"
TITLE = ("Table 13: COCO detection with masks, boxes in COCO's format under a LongestMaxSize + PadIfNeeded prefix "
         "(batch 8, 2 workers)")
BS, WORKERS, PRESET = 8, 2, "det-train"
CACHE = {"memory_bytes": "3GiB", "compress": True}
METHODS = ("sequential", "dataloader", "batchd_tcp", "batchd_shm", "batchd_shm_cache")
LABELS = {"sequential": "sequential loop (Dataset in the training process)",
          "dataloader": "DataLoader, 2 workers, collate_fn=lambda x: tuple(zip(*x))",
          "batchd_tcp": "batchd over TCP (inline), detection_collate, no cache",
          "batchd_shm": "batchd over shared memory, detection_collate, no cache",
          "batchd_shm_cache": "batchd over shared memory, detection_collate, cache (warm)"}
RATIOS = (0.5, 1.0, 2.0)
STEP_METHODS = ("sequential", "dataloader", "batchd_shm")


def pipeline_dict() -> dict:
    import albumentations as A
    import cv2

    return A.to_dict(A.Compose(
        [A.LongestMaxSize(max_size=448), A.PadIfNeeded(448, 448, border_mode=cv2.BORDER_CONSTANT),
         A.RandomCrop(384, 384), A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5)],
        bbox_params=A.BboxParams(format="coco", label_fields=["labels"], min_visibility=0.3)))


class Setup:
    """The servers (no cache; a cache), the DataLoaders (2 workers and sequential) and their Dataset, started once."""

    def __init__(self, root: pathlib.Path):
        from bench.peers.torch_coco import CocoMasks, make_loader

        images, annotations = root / "images" / "train", root / "annotations" / "instances_train.json"
        preset = pipeline_dict()
        datasets = {"det": {"kind": "coco", "images": str(images), "annotations": str(annotations), "masks": True}}
        self.server = ServerProcess(datasets=datasets, pipelines={PRESET: preset}, workers=WORKERS,
                                    cache_dir=data.CACHE).start()
        self.cached = ServerProcess(datasets=datasets, pipelines={PRESET: preset}, workers=WORKERS,
                                    cache_dir=data.CACHE, extra={"cache": CACHE}).start()
        self.dataset = CocoMasks(images, annotations, preset)
        self.loader, self.order = make_loader(self.dataset, BS, WORKERS)
        self.sequential, self.sequential_order = make_loader(self.dataset, BS, 0)

    def warm_cache(self) -> float:
        """Stream every sample once through the cached server (so the timed batches are hits); seconds taken."""
        import batchd

        t0 = time.perf_counter()
        with batchd.RemoteDataLoader(self.cached.address, "det", batch_size=BS, transform=PRESET, timeout=600,
                                     prefetch=2 * WORKERS, collate_fn=batchd.detection_collate) as loader:
            for _ in loader:
                pass
        self.cached.wait_idle()
        return time.perf_counter() - t0

    def batches(self, method: str, count: int, seed: int):
        """An iterator of ``count`` (images, targets) batches (more may follow: a stream goes on)."""
        if method in ("dataloader", "sequential"):
            loader, order = (self.loader, self.order) if method == "dataloader" else (self.sequential, self.sequential_order)
            # a round of the workers' batches after the counted ones, consumed untimed: the window
            # closes with the workers as busy as when it opened (bench/peers/torch_loader.py::time_loader)
            tail = loader.num_workers * (loader.prefetch_factor or 2) if loader.num_workers else 0
            order.set(len(self.dataset), (count + tail) * BS, seed)
            return _drain(iter(loader))
        import batchd

        transport = "inline" if method == "batchd_tcp" else "shm"
        server = self.cached if method == "batchd_shm_cache" else self.server
        return _closing(common.remote(server.address, "det", batch_size=BS, pipeline=PRESET, workers=WORKERS,
                                      transport=transport, seed=seed, collate_fn=batchd.detection_collate),
                        server)

    def stop(self) -> None:
        del self.loader
        self.server.stop()
        self.cached.stop()


def _drain(it):
    """Yield from ``it``; when the consumer stops, read the rest (untimed) so no worker stays busy."""
    try:
        yield from it
    finally:
        for _ in it:
            pass


def _closing(loader, server):
    """Yield the loader's batches; when the consumer stops, close it and wait for the workers to idle."""
    try:
        with loader:
            yield from loader
    finally:
        server.wait_idle()


def throughput(setup: Setup, method: str, seed: int, warmup: int, timed: int):
    """``time_stream``'s timing, with ``.client_cpu``: CPU seconds of the training process alone
    (its every thread: batchd's receiver, the DataLoader's unpickling) in the same window."""
    it = setup.batches(method, warmup + timed, seed)
    marks = []
    try:
        r = time_stream(it, warmup, timed, on_start=lambda: marks.append(time.process_time()),
                        on_end=lambda: marks.append(time.process_time()))
    finally:
        it.close()
    r.client_cpu = marks[1] - marks[0]
    return r


def step_loop(setup: Setup, method: str, step: SleepStep, seed: int, warmup: int, steps: int) -> tuple[float, float]:
    it = setup.batches(method, warmup + steps, seed)
    try:
        return train_loop(it, step, warmup, steps)
    finally:
        it.close()


def run(s, log=print) -> dict:
    root = data.ensure_fashion_coco()
    warmup, timed, seq_timed = 2 * WORKERS, s.pick(24, 6), s.pick(8, 3)
    steps = s.pick(12, 3)
    setup = Setup(root)
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    client_cpus: dict[str, list[float]] = {}
    loops: dict[str, list[tuple[float, float]]] = {}
    try:
        for m in METHODS:  # first use: workers start, the server's workers build the pipeline
            throughput(setup, m, 0, 1, 1)
        warm = setup.warm_cache()
        log(f"  table13: the cache warmed in {warm:.0f} s (one pass over {len(setup.dataset)} images)")
        calibration = throughput(setup, "sequential", 1, 1, s.pick(6, 2))
        t1 = calibration.seconds / calibration.batches
        log(f"  table13: T1 = {t1 * 1e3:.0f} ms per batch of {BS} (sequential)")
        for rep in range(s.repeats):
            k = rep % len(METHODS)
            for m in METHODS[k:] + METHODS[:k]:
                n = seq_timed if m == "sequential" else timed
                r = measure(lambda: throughput(setup, m, 1000 * rep + 7, 1 if m == "sequential" else warmup, n))
                rates.setdefault(m, []).append(r.rate)
                cpus.setdefault(m, []).append(r.cpu_per_image)
                client_cpus.setdefault(m, []).append(r.client_cpu / r.images)
            for xi, x in enumerate(RATIOS):
                k = (rep + xi) % len(STEP_METHODS)
                for m in STEP_METHODS[k:] + STEP_METHODS[:k]:
                    seed = 100 * rep + xi
                    loops.setdefault(f"{x}|{m}", []).append(
                        measure(lambda: step_loop(setup, m, SleepStep(x * t1), seed, 2, steps)))
            log(f"  table13: repeat {rep + 1}/{s.repeats} done")
    finally:
        setup.stop()
    t1_measured = median(w for x in RATIOS for _, w in loops[f"{x}|sequential"])  # the loop's own loading time
    rows = [{"method": m, "rates": rates[m], "median": median(rates[m]), "spread": spread(rates[m]),
             "cpu_per_image": median(cpus[m]), "client_cpu_per_image": median(client_cpus[m])} for m in METHODS]
    step_rows = []
    for x in RATIOS:
        for m in STEP_METHODS:
            runs = loops[f"{x}|{m}"]
            per_step, wait = median(r[0] for r in runs), median(r[1] for r in runs)
            step_rows.append({"t2_over_t1": x, "t2": x * t1, "method": m, "per_step": per_step, "wait": wait,
                              "ratio": per_step / max(t1_measured, x * t1)})
    return {"rows": rows, "steps": step_rows, "t1_calibrated": t1, "t1": t1_measured, "batch_size": BS, "warm_s": warm,
            "timed_images": timed * BS, "seq_images": seq_timed * BS, "steps_timed": steps, "repeats": s.repeats,
            "images": len(setup.dataset)}


def render(r: dict) -> str:
    by = {row["method"]: row for row in r["rows"]}
    dl = by["dataloader"]
    head = ["method", "images/s", "vs DataLoader", "vs sequential", "CPU ms per image", "of it, training process"]
    rows = [[LABELS[m], f"{by[m]['median']:.0f}", fx(by[m]["median"] / dl["median"]),
             fx(by[m]["median"] / by["sequential"]["median"]), f"{by[m]['cpu_per_image'] * 1e3:.2f}",
             f"{by[m]['client_cpu_per_image'] * 1e3:.2f}" if "client_cpu_per_image" in by[m] else "-"]
            for m in METHODS]
    worst = max(row["spread"] for row in r["rows"])
    out = md_table(head, rows) + (
        f"\n\n{r['images']} canvases of 384-512 px, up to 8 objects each, masks decoded per object; batch "
        f"{r['batch_size']}; images/s over {r['timed_images']} images per measurement (sequential: "
        f"{r['seq_images']}) after a warm-up of {2 * WORKERS} batches; median of {r['repeats']} interleaved repeats "
        f"(largest spread (max-min)/median: {worst:.0%}). CPU per image: every process of the run in the timed "
        "window (client, server and its workers, DataLoader workers); of it, the training process's own (every "
        "thread: the DataLoader's receiving and unpickling, batchd's receiver; the sequential loop's loading).\n\n")
    head = ["step", "T2 / T1 (set)", "T2 / T1 (measured)", "method", "per step ms", "per step / max(T1, T2)",
            "data wait ms per sample", "data wait % of step"]
    rows = [[f"sleep {row['t2'] * 1e3:.0f} ms", f"{row['t2_over_t1']:g}", f"{row['t2'] / r['t1']:.2f}",
             {"sequential": "sequential (load, then train)", "dataloader": "DataLoader, 2 workers",
              "batchd_shm": "batchd shm, 2 workers"}[row["method"]], f"{row['per_step'] * 1e3:.0f}",
             f"{row['ratio']:.2f}", f"{row['wait'] / r['batch_size'] * 1e3:.1f}", f"{row['wait'] / row['per_step']:.1%}"]
            for row in r["steps"]]
    return out + md_table(head, rows) + (
        f"\n\nT1 = {r['t1'] * 1e3:.0f} ms per batch of {r['batch_size']}: the sequential loop's own loading time "
        f"in these runs (T2 was set from T1 = {r['t1_calibrated'] * 1e3:.0f} ms measured at the start). Data wait: "
        f"the time the loop is blocked in next(), per sample; {r['steps_timed']} steps timed after 2 warm-up steps; "
        f"median of {r['repeats']} interleaved repeats.")


def targets(r: dict) -> list[dict]:
    by = {row["method"]: row for row in r["rows"]}
    ratio = by["batchd_shm"]["median"] / by["dataloader"]["median"]
    best = max(by["batchd_shm"]["rates"]) / max(by["dataloader"]["rates"])
    cpu = by["dataloader"]["cpu_per_image"] / by["batchd_shm"]["cpu_per_image"]
    heavy = [row for row in r["steps"] if row["method"] == "batchd_shm" and row["t2"] >= r["t1"]]  # T1 as measured
    cached = by["batchd_shm_cache"]["median"] / by["dataloader"]["median"]
    return [
        {"name": "batchd shm, no cache >= 1.0x DataLoader images/s (COCO boxes in format coco + masks, cacheable "
                 "prefix, 2 workers)",
         "passed": ratio >= 1.0,
         "detail": f"{ratio:.2f}x ({by['batchd_shm']['median']:.0f} vs {by['dataloader']['median']:.0f} img/s; best of "
                   f"{r['repeats']} each: {best:.2f}x); the DataLoader uses {cpu:.2f}x batchd's CPU per image"},
        {"name": "batchd shm, cache (warm) >= 1.0x DataLoader images/s",
         "passed": cached >= 1.0,
         "detail": f"{cached:.2f}x ({by['batchd_shm_cache']['median']:.0f} vs {by['dataloader']['median']:.0f} img/s); "
                   f"the cache warmed in {r.get('warm_s', 0):.0f} s"},
        {"name": "data wait < 5% of the step when T2 >= T1 as measured (batchd shm, 2 workers, sleep step)",
         "passed": all(row["wait"] / row["per_step"] < 0.05 for row in heavy),
         "detail": ", ".join(f"{row['wait'] / row['per_step']:.1%} at T2={row['t2'] / r['t1']:.2f}xT1" for row in heavy)
                   or "no row with T2 >= T1 as measured"},
    ]


def main(argv=None) -> int:
    from bench.measure import pin_threads
    from bench.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer batches, 1 repeat")
    p.add_argument("--repeats", type=int, default=None)
    args = p.parse_args(argv)
    pin_threads()
    r = run(Settings(quick=args.quick, repeats=args.repeats or (1 if args.quick else 3)))
    print(TITLE)
    print(render(r))
    for t in targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
