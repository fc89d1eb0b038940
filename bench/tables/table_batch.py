"""Table 2: batch size 10..1000 at 2 workers, pipeline L3: speedup over the sequential loop.

Reads ``photos_x4`` (a manifest listing the 3,000 photos four times, 12,000 rows) so that a
measurement of batch 1000 has enough batches in one epoch. Each measurement times whole rounds
of the workers (``timed`` batches, a multiple of 2) after a warm-up of 2 batches.
"""

from __future__ import annotations

import math

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, spread, time_stream
from bench.noise import measure
from bench.peers import sequential
from bench.peers.torch_loader import PhotoDataset, make_loader, time_loader
from bench.report import fx, md_table

NAME = "table2"
TITLE = "Table 2: batch size (2 workers, L3)"
METHODS = ("sequential", "dataloader", "batchd_shm")
WORKERS = 2
PIPELINE = "L3"


def run(s, log=print) -> dict:
    sizes = s.pick((10, 50, 100, 300, 500, 1000), (10, 300))
    target = s.pick(1280, 300)        # images timed per measurement (at least)
    seq_target = s.pick(960, 200)
    w, p = WORKERS, PIPELINE
    cfg = common.photos_x4_config()
    ds = common.open_local("photos_x4", cfg)
    compose = pipelines.build(p)
    presets = pipelines.presets([p])
    torch_ds = PhotoDataset("photos_x4", cfg, data.LOCAL_CACHE, presets)
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    plan_of = {}
    srv = ServerProcess(datasets=common.server_datasets(photos_x4=cfg), pipelines=presets, workers=w,
                        cache_dir=data.CACHE).start()
    dl, plan = make_loader(torch_ds, w)
    try:
        for bs in sizes:
            timed = max(2 * w if bs >= 1000 else w, math.ceil(target / (bs * w)) * w)
            warmup = w
            plan_of[bs] = {"timed_batches": timed, "timed_images": timed * bs,
                           "seq_images": max(s.pick(2, 1), math.ceil(seq_target / bs)) * bs}
            assert (warmup + timed) * bs <= len(torch_ds), (bs, timed)
        # first use: DataLoader workers start, server workers build the pipeline
        plan.set(p, len(torch_ds), 64, w, seed=0)
        for _ in dl:
            pass
        with common.remote(srv.address, "photos_x4", batch_size=64, pipeline=p, workers=w, transport="shm") as rl:
            time_stream(rl, 0, w)
        for rep in range(s.repeats):
            for bi, bs in enumerate(sizes):
                k = (rep + bi) % len(METHODS)
                timed, warmup = plan_of[bs]["timed_batches"], w
                for m in METHODS[k:] + METHODS[:k]:
                    seed = 1000 * rep + bi
                    r = measure(lambda: _one(m, ds, compose, torch_ds, dl, plan, srv, w, p, bs, seed, warmup, timed,
                                             plan_of[bs]["seq_images"] // bs))
                    rates.setdefault(f"{bs}|{m}", []).append(r.rate)
                    cpus.setdefault(f"{bs}|{m}", []).append(r.cpu_per_image)
            log(f"  table2: repeat {rep + 1}/{s.repeats} done")
    finally:
        del dl
        srv.stop()
    rows = []
    for bs in sizes:
        cell = {m: rates[f"{bs}|{m}"] for m in METHODS}
        rows.append({"batch_size": bs, **plan_of[bs], "rates": cell,
                     "cpu_per_image": {m: median(cpus[f"{bs}|{m}"]) for m in METHODS},
                     "median": {m: median(v) for m, v in cell.items()},
                     "spread": {m: spread(v) for m, v in cell.items()}})
    return {"rows": rows, "workers": w, "pipeline": p, "repeats": s.repeats}


def _one(m, ds, compose, torch_ds, dl, plan, srv, w, p, bs, seed, warmup, timed, seq_batches):
    if m == "sequential":
        return time_stream(sequential.batches(ds, compose, bs, seq_batches, seed), 0, seq_batches)
    if m == "dataloader":
        return time_loader(dl, plan, p, len(torch_ds), bs, warmup, timed, seed)
    try:
        with common.remote(srv.address, "photos_x4", batch_size=bs, pipeline=p, workers=w, transport="shm",
                           seed=seed) as rl:
            return time_stream(rl, warmup, timed)
    finally:
        srv.wait_idle()  # the batches in flight when we stopped reading must not overlap the next measurement


def render(r: dict) -> str:
    head = ["batch size", "images timed", "sequential img/s", "DataLoader img/s", "DataLoader speedup",
            "batchd shm img/s", "batchd shm speedup", "shm / DataLoader", "CPU ms/image: seq, DataLoader, shm"]
    rows = []
    for row in r["rows"]:
        m = row["median"]
        seq = m["sequential"]
        rows.append([row["batch_size"], row["timed_images"], f"{seq:.0f}", f"{m['dataloader']:.0f}",
                     fx(m["dataloader"] / seq), f"{m['batchd_shm']:.0f}", fx(m["batchd_shm"] / seq),
                     fx(m["batchd_shm"] / m["dataloader"]),
                     ", ".join(f"{row['cpu_per_image'][k] * 1e3:.2f}" for k in METHODS) if "cpu_per_image" in row
                     else "-"])
    worst = max(max(row["spread"].values()) for row in r["rows"])
    return md_table(head, rows) + (
        f"\n\n{r['workers']} workers, pipeline {r['pipeline']}, dataset photos_x4 (12,000 rows: the photos four "
        f"times). After a warm-up of {r['workers']} batches, whole rounds of the workers are timed (at least "
        f"1,280 images, and 4 batches at batch 1000); sequential: the in-process loop over about 960 images "
        f"(at least two batches). Median of {r['repeats']} interleaved repeats (largest spread of any cell: "
        f"{worst:.0%}). CPU ms/image: CPU of every process of the measurement (client, server, workers) per "
        "image over the timed window, as under Table 1."
    )


def targets(r: dict) -> list[dict]:
    return []  # Table 2 has no target of its own
