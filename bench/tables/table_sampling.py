"""Table 19: weighted and mixed epochs against the plain epoch on one server, and against DataLoader's sampler.

    python -m bench.tables.table_sampling [--quick] [--repeats N]

One server (2 workers, pipeline L3, batch 64) over the photo dataset (3,000 JPEGs) and two
manifests of the same files (listed twice and four times: three sources of one kind of work).
Four ways to read an epoch of 3,000 images (``--quick``: 768), each from a fresh seed:

* plain: ``RemoteDataLoader(shuffle=True)`` (the reference);
* weighted: ``sampler=batchd.WeightedRandomSampler(w, 3000)``, w uniform in [0, 3) with 30% zeros;
* mix: ``batchd.Mix({photos: 0.5, photos2: 0.3, photos4: 0.2}, num_samples=3000)``, L3 for each;
* DataLoader: ``DataLoader(sampler=torch.utils.data.WeightedRandomSampler(w, 3000), num_workers=2,
  batch_size=64, persistent_workers=True)`` over the same decode and L3 code in its workers
  (``bench/peers/torch_loader.py``'s dataset), on the same 2 cores.

Each reading consumes 4 batches untimed (the draw, the stream's start, the workers' first
round), times the next ones and drains the last 6 untimed (so the window closes with the workers
as busy as it opened). The four alternate within every repeat (the order rotating), never at
the same time: the machine is shared, and alternated rounds let its noise hit all four alike;
figures are medians over repeats. Targets (issue 39): weighted and mix >= 0.95x plain images/s.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np

from batchd.server.config import ManifestConfig
from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, spread, time_stream
from bench.noise import measure
from bench.report import md_table

NAME = "table19"
TITLE = "Table 19: weighted and mixed epochs vs the plain epoch (L3, batch 64, 2 workers)"
BATCH = 64
WORKERS = 2
WARMUP, TAIL = 4, 6
METHODS = ("plain", "weighted", "mix", "dataloader")
LABELS = {"plain": "batchd, plain epoch (shuffle)", "weighted": "batchd, WeightedRandomSampler",
          "mix": "batchd, Mix of 3 sources", "dataloader": "DataLoader(sampler=WeightedRandomSampler)"}
MIX = {"photos": 0.5, "photos2": 0.3, "photos4": 0.2}


class WeightedPhotos:
    """``dataset[i]`` = the photo dataset's sample i through ``pipeline`` (bench/peers/torch_loader.py's
    ``PhotoDataset``, keyed by index as torch's samplers yield it)."""

    def __init__(self, photos, pipeline: str):
        self.photos, self.pipeline = photos, pipeline

    def __len__(self) -> int:
        return len(self.photos)

    def __getitem__(self, i: int):
        return self.photos[(self.pipeline, int(i))]


def _dataloader(photos, weights: np.ndarray, images: int):
    import torch
    from torch.utils.data import DataLoader, WeightedRandomSampler

    from bench.peers.torch_loader import _init_worker

    warnings.filterwarnings("ignore", message="This DataLoader will create", category=UserWarning)
    sampler = WeightedRandomSampler(torch.as_tensor(weights), num_samples=images, generator=torch.Generator())
    loader = DataLoader(WeightedPhotos(photos, "L3"), batch_size=BATCH, sampler=sampler, num_workers=WORKERS,
                        persistent_workers=True, drop_last=True, worker_init_fn=_init_worker,
                        multiprocessing_context="forkserver")
    return loader, sampler


def _timed(batches, timed: int):
    """time_stream over ``batches`` (WARMUP untimed, ``timed`` timed), the rest drained untimed."""
    it = iter(batches)
    try:
        return time_stream(it, WARMUP, timed)
    finally:
        for b in it:
            del b
        close = getattr(it, "close", None)
        if close is not None:
            close()


def run(s, log=print) -> dict:
    from bench.peers.torch_loader import PhotoDataset

    import batchd

    images = s.pick(3000, 768)
    timed = images // BATCH - WARMUP - TAIL
    cfg = common.photos_config()
    x2 = ManifestConfig(kind="manifest", path=data.ensure_repeated_manifest(2))
    x4 = common.photos_x4_config()
    presets = pipelines.presets(("L3",))
    n = len(data.photo_files())
    rng = np.random.default_rng(0)
    weights = rng.uniform(0.0, 3.0, n)
    weights[rng.random(n) < 0.3] = 0.0
    photos = PhotoDataset("photos", cfg, data.LOCAL_CACHE, presets)
    rates: dict[str, list[float]] = {m: [] for m in METHODS}
    seeds = iter(range(1, 1_000_000))

    def batchd_loader(method: str, address: str):
        kw = dict(batch_size=BATCH, seed=next(seeds), drop_last=True, transform="L3", prefetch=2 * WORKERS,
                  transport="shm", timeout=300)
        if method == "plain":
            return batchd.RemoteDataLoader(address, "photos", shuffle=True, **kw)
        if method == "weighted":
            return batchd.RemoteDataLoader(address, "photos", sampler=batchd.WeightedRandomSampler(weights, images),
                                           **kw)
        return batchd.RemoteDataLoader(address, batchd.Mix(MIX, num_samples=images), **kw)

    with ServerProcess(datasets=common.server_datasets(photos=cfg, photos2=x2, photos4=x4), pipelines=presets,
                       workers=WORKERS, cache_dir=data.CACHE) as server:
        dl, sampler = _dataloader(photos, weights, images)
        for method in ("plain", "weighted", "mix"):  # first use: the workers build L3, the indexes open
            with batchd_loader(method, server.address) as ld:
                _timed(ld, 1)
        _timed(dl, 1)  # the DataLoader's workers start
        for r in range(s.repeats):
            order = METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]
            for method in order:
                if method == "dataloader":
                    sampler.generator.manual_seed(next(seeds))
                    t = measure(lambda: _timed(dl, timed))
                else:
                    def one():
                        with batchd_loader(method, server.address) as ld:
                            return _timed(ld, timed)
                    t = measure(one)
                rates[method].append(t.images / t.seconds)
                log(f"  {NAME}: repeat {r + 1} {method}: {rates[method][-1]:.0f} images/s")
        del dl
    return {"repeats": s.repeats, "images": images, "timed_batches": timed,
            "rates": {m: median(v) for m, v in rates.items()}, "spread": {m: spread(v) for m, v in rates.items()}}


def targets(r: dict) -> list[dict]:
    plain = r["rates"]["plain"]
    rows = [("weighted epoch >= 0.95x the plain epoch's images/s", r["rates"]["weighted"] / plain),
            ("3-source mix >= 0.95x the plain epoch's images/s", r["rates"]["mix"] / plain)]
    return [{"passed": v >= 0.95, "name": name, "detail": f"{v:.2f}x"} for name, v in rows]


def render(r: dict) -> str:
    rates, plain, dl = r["rates"], r["rates"]["plain"], r["rates"]["dataloader"]
    rows = [[LABELS[m], f"{rates[m]:.0f}", f"{r['spread'][m]:.0%}", f"{rates[m] / plain:.2f}x", f"{rates[m] / dl:.2f}x"]
            for m in METHODS]
    table = md_table(["loader", "images/s", "spread", "vs plain", "vs DataLoader"], rows)
    return "\n".join([table, "", f"Median of {r['repeats']} alternated repeats; each reads an epoch of {r['images']:,} "
                      f"images and times {r['timed_batches']} batches of {BATCH} after {WARMUP} untimed. Spread: "
                      "(max - min) / median over the repeats. Shared memory transport; the DataLoader runs the same "
                      "decode and L3 code in 2 workers on the same 2 cores."])


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, photos=True, load_note=True, per="loader")


if __name__ == "__main__":
    sys.exit(main())
