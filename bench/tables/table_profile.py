"""Table 5: where the time of a batch goes (L3, batch 64), and the reduced-decoding experiment.

A. Per image, in this process, with batchd's code: read (``np.fromfile``), decode
   (``cv2.imdecode`` + BGR->RGB, as ``read_rgb``), the rest of ``read_rgb`` (size and truncation
   checks), the L3 pipeline, and the copy into the batch array.
B. Transport, at 2 workers: wall time per batch at the client, and CPU time per batch of each
   process over the same window (from /proc): the workers (sum), the batchd server's main
   process (gRPC, scheduler, encoding) and this client process (receiving, unpacking, reading the
   pages), for batchd inline (TCP), inline + lz4, inline over a unix socket, shared memory, and
   the PyTorch DataLoader. The
   wall-clock transport estimate is client time per batch minus compute per batch / workers; the
   CPU columns are the direct measure (on a 2-core machine every CPU-ms spent moving bytes is
   taken from the workers).
C. Decode smartly: ``cv2.IMREAD_REDUCED_COLOR_2`` (libjpeg's scaled IDCT, half size) + Resize(256,
   256) against full decode + Resize(256, 256), on the photo set and on larger 1024-px JPEGs.
"""

from __future__ import annotations

import math
import os
import pathlib
import time

import cv2
import numpy as np

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds, median, time_stream
from bench.noise import measure
from bench.peers.torch_loader import PhotoDataset, make_loader, time_loader, worker_pids
from bench.report import fx, md_table

NAME = "table5"
TITLE = "Table 5: profile of a batch (L3, batch 64) and reduced JPEG decoding"
BS = 64
PIPELINE = "L3"
WORKERS = 2
MATE = pathlib.Path("/usr/share/backgrounds/mate/nature")  # make_photos.py's sources
STAGES = ("read", "decode", "read_rgb checks", "pipeline", "copy")


def _stages(ds, compose, indices) -> tuple[dict[str, float], dict[str, float]]:
    """Mean (wall, CPU) seconds per image of each stage over ``indices``."""
    from batchd.server.data.decode import read_rgb

    wall = dict.fromkeys(STAGES, 0.0)
    cpu = dict.fromkeys(STAGES, 0.0)
    clock, tclock = time.perf_counter, time.thread_time
    batch = None
    for j, index in enumerate(indices):
        path = str(ds.path(int(index)))
        if j % BS == 0:
            compose.set_random_seed(j)
        t = [(clock(), tclock())]
        buf = np.fromfile(path, dtype=np.uint8)
        t.append((clock(), tclock()))
        image = cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        t.append((clock(), tclock()))
        image = read_rgb(path)  # the whole of batchd's read + decode, for the checks it adds
        t.append((clock(), tclock()))
        out = compose(image=image)["image"]
        t.append((clock(), tclock()))
        if batch is None:
            batch = np.empty((BS, *out.shape), out.dtype)
        batch[j % BS] = out
        t.append((clock(), tclock()))
        for acc, c in ((wall, 0), (cpu, 1)):
            read, decode, whole = t[1][c] - t[0][c], t[2][c] - t[1][c], t[3][c] - t[2][c]
            acc["read"] += read
            acc["decode"] += decode
            acc["read_rgb checks"] += whole - read - decode
            acc["pipeline"] += t[4][c] - t[3][c]
            acc["copy"] += t[5][c] - t[4][c]
    n = len(indices)
    return {k: v / n for k, v in wall.items()}, {k: v / n for k, v in cpu.items()}


def _transport(s, ds_cfg, presets, compute_per_batch: float) -> dict:
    timed = s.pick(24, 4)
    warmup = WORKERS
    methods = ("dataloader", "batchd_inline", "batchd_inline_lz4", "batchd_inline_unix", "batchd_shm")
    if s.quick:  # one server start less
        methods = tuple(m for m in methods if m != "batchd_inline_unix")
    torch_ds = PhotoDataset("photos", ds_cfg, data.LOCAL_CACHE, presets)
    srv = ServerProcess(datasets=common.server_datasets(photos=ds_cfg), pipelines=presets, workers=WORKERS,
                        cache_dir=data.CACHE).start()
    usrv = srv
    if "batchd_inline_unix" in methods:
        usrv = ServerProcess(datasets=common.server_datasets(photos=ds_cfg), pipelines=presets, workers=WORKERS,
                             cache_dir=data.CACHE, address=f"unix:/tmp/batchd-bench-{os.getpid()}.sock").start()
    dl, plan = make_loader(torch_ds, WORKERS)
    runs: dict[str, list[dict]] = {m: [] for m in methods}
    try:
        plan.set(PIPELINE, len(torch_ds), BS, WORKERS, seed=0)
        for _ in dl:
            pass
        for server in {srv, usrv}:
            with common.remote(server.address, "photos", batch_size=BS, pipeline=PIPELINE, workers=WORKERS,
                               transport="shm") as rl:
                time_stream(rl, 0, WORKERS)
        for rep in range(s.repeats):
            k = rep % len(methods)
            for m in methods[k:] + methods[:k]:
                server = usrv if m.endswith("unix") else srv
                runs[m].append(measure(lambda: _transport_one(m, dl, plan, torch_ds, server, 50 + rep, warmup, timed)))
    finally:
        del dl
        srv.stop()
        if usrv is not srv:
            usrv.stop()
    out = {}
    for m, rs in runs.items():
        med = {k: median(r[k] for r in rs) for k in rs[0]}
        med["transport_wall_estimate"] = med["wall"] - compute_per_batch / WORKERS
        out[m] = med
    return {"methods": out, "timed": timed}


def _transport_one(m, dl, plan, torch_ds, srv, seed, warmup, timed) -> dict:
    """One timed stream of ``m``: wall and per-process CPU seconds per batch."""
    snap = {}
    if m == "dataloader":
        pids, server_pid = worker_pids(dl), None
    else:
        source = common.remote(srv.address, "photos", batch_size=BS, pipeline=PIPELINE, workers=WORKERS,
                               transport="shm" if m == "batchd_shm" else "inline", seed=seed,
                               compression="lz4" if m.endswith("lz4") else None)
        pids, server_pid = srv.worker_pids, srv.pid

    def cpu():
        return (sum(cpu_seconds(p) for p in pids), cpu_seconds(server_pid) if server_pid else 0.0,
                time.process_time())

    marks = {"on_start": lambda: snap.__setitem__("a", cpu()), "on_end": lambda: snap.__setitem__("b", cpu())}
    if m == "dataloader":
        r = time_loader(dl, plan, PIPELINE, len(torch_ds), BS, warmup, timed, seed, **marks)
    else:
        try:
            r = time_stream(source, warmup, timed, **marks)
        finally:
            source.close()
            srv.wait_idle()  # the batches in flight when we stopped reading must not overlap the next measurement
    (wa, sa, ca), (wb, sb, cb) = snap["a"], snap["b"]
    return {"wall": r.seconds / timed, "workers_cpu": (wb - wa) / timed, "server_cpu": (sb - sa) / timed,
            "client_cpu": (cb - ca) / timed}


def _larger_jpegs(n: int) -> list[np.ndarray]:
    """``n`` JPEGs of 1024 x 768 (q90), cut from the source photos, as encoded bytes."""
    src = sorted(MATE.glob("*.jpg"))
    out = []
    rng = np.random.default_rng(0)
    for i in range(n):
        photo = cv2.imread(str(src[i % len(src)]), cv2.IMREAD_COLOR) if src else None
        if photo is None:
            return out
        h, w = photo.shape[:2]
        ch, cw = min(h, int(w * 0.75)), min(w, int(h / 0.75))
        y, x = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        img = cv2.resize(photo[y:y + ch, x:x + cw], (1024, 768), interpolation=cv2.INTER_AREA)
        out.append(cv2.imencode(".jpg", img, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].reshape(-1))
    return out


def _decode_experiment(bufs: list[np.ndarray], repeats: int) -> dict:
    import albumentations as A
    from batchd.server.data.decode import image_size

    resize = A.Resize(256, 256)

    def full(buf):
        return resize(image=cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB))["image"]

    def reduced(buf):
        return resize(image=cv2.cvtColor(cv2.imdecode(buf, cv2.IMREAD_REDUCED_COLOR_2), cv2.COLOR_BGR2RGB))["image"]

    # CPU time of this thread (OpenCV is pinned to 1 thread): other processes on the shared machine
    # barely change it, unlike the wall clock
    times = {"full": [], "reduced": []}
    for rep in range(repeats):
        for name, fn in (("full", full), ("reduced", reduced))[:: 1 if rep % 2 == 0 else -1]:
            t0 = time.thread_time()
            for b in bufs:
                fn(b)
            times[name].append((time.thread_time() - t0) / len(bufs))
    psnr = []
    for b in bufs:
        d = full(b).astype(np.float64) - reduced(b).astype(np.float64)
        mse = float(np.mean(d * d))
        psnr.append(99.0 if mse == 0 else 10 * math.log10(255**2 / mse))
    sizes = [image_size(b) or (0, 0) for b in bufs]  # (width, height) from the JPEG header
    eligible = sum(1 for w, h in sizes if w >= 512 and h >= 512)
    return {"full": median(times["full"]), "reduced": median(times["reduced"]), "psnr_db": median(psnr),
            "images": len(bufs), "eligible": eligible,
            "mean_size": [float(np.mean([s[0] for s in sizes])), float(np.mean([s[1] for s in sizes]))]}


def run(s, log=print) -> dict:
    cfg = common.photos_config()
    ds = common.open_local("photos", cfg)
    compose = pipelines.build(PIPELINE)
    presets = pipelines.presets([PIPELINE])
    n = s.pick(640, 96)
    rng = np.random.default_rng(0)
    stage_runs = []
    _stages(ds, compose, rng.permutation(len(ds))[:BS])  # warm the page cache and the pipeline
    for _ in range(s.repeats):
        stage_runs.append(_stages(ds, compose, rng.permutation(len(ds))[:n]))
    per_image = {k: median(r[0][k] for r in stage_runs) for k in STAGES}
    per_image_cpu = {k: median(r[1][k] for r in stage_runs) for k in STAGES}
    compute_per_batch = sum(per_image.values()) * BS
    compute_cpu_per_batch = sum(per_image_cpu.values()) * BS
    log(f"  table5: in-process compute {compute_per_batch * 1e3:.1f} ms per batch of {BS} "
        f"({compute_cpu_per_batch * 1e3:.1f} ms CPU)")
    transport = _transport(s, cfg, presets, compute_per_batch)
    log("  table5: transport done")
    files = [str(ds.path(int(i))) for i in rng.permutation(len(ds))[:s.pick(400, 80)]]
    photo_bufs = [np.fromfile(f, dtype=np.uint8) for f in files]
    decode = {"photos": _decode_experiment(photo_bufs, s.repeats),
              "1024x768": _decode_experiment(_larger_jpegs(s.pick(48, 12)), s.repeats)}
    return {"per_image": per_image, "per_image_cpu": per_image_cpu, "images": n,
            "compute_per_batch": compute_per_batch, "compute_cpu_per_batch": compute_cpu_per_batch,
            "transport": transport,
            "decode": decode, "repeats": s.repeats}


def render(r: dict) -> str:
    pi, pc = r["per_image"], r["per_image_cpu"]
    tot, tot_cpu = sum(pi.values()), sum(pc.values())
    rows = [[k, f"{max(0.0, v) * 1e6:.0f}", f"{max(0.0, pc[k]) * 1e6:.0f}", f"{max(0.0, v) * BS * 1e3:.2f}",
             f"{max(0.0, pc[k]) * BS * 1e3:.2f}", f"{max(0.0, pc[k]) / tot_cpu:.0%}"] for k, v in pi.items()]
    rows.append(["**total compute**", f"**{tot * 1e6:.0f}**", f"**{tot_cpu * 1e6:.0f}**", f"**{tot * BS * 1e3:.1f}**",
                 f"**{tot_cpu * BS * 1e3:.1f}**", "100%"])
    out = ["**A. Compute per image and per batch (in-process, 1 thread, batchd's code)**", "",
           md_table(["stage", "wall us / image", "CPU us / image", "wall ms / batch of 64", "CPU ms / batch of 64",
                     "share (CPU)"], rows), "",
           f"Mean over {r['images']} images, median of {r['repeats']} repeats. decode = cv2.imdecode + BGR->RGB; "
           "`read_rgb checks` = read_rgb's time minus read and decode (its header-size and truncated-JPEG checks; "
           "shown as 0 when the difference is below the noise). "
           "Wall above CPU means this process waited for a core (other processes on the shared machine).", ""]
    t = r["transport"]
    names = {"dataloader": "PyTorch DataLoader", "batchd_inline": "batchd TCP (inline)",
             "batchd_inline_lz4": "batchd TCP + lz4", "batchd_inline_unix": "batchd inline over a unix socket",
             "batchd_shm": "batchd shm"}
    rows = []
    for m, v in t["methods"].items():
        overhead = v["server_cpu"] + v["client_cpu"]
        rows.append([names[m], f"{v['wall'] * 1e3:.1f}", f"{v['transport_wall_estimate'] * 1e3:+.1f}",
                     f"{v['workers_cpu'] * 1e3:.1f}",
                     f"{(v['workers_cpu'] - r['compute_cpu_per_batch']) * 1e3:+.1f}",
                     f"{v['server_cpu'] * 1e3:.1f}" if m != "dataloader" else "-",
                     f"{v['client_cpu'] * 1e3:.1f}", f"{overhead * 1e3:.1f}"])
    out += ["**B. Transport at 2 workers (ms per batch of 64)**", "",
            md_table(["method", "client wall / batch", "wall - compute/2 (transport estimate)", "workers CPU",
                      "workers CPU - in-process compute CPU", "server main CPU", "client CPU",
                      "server + client CPU (transport + overhead)"], rows), "",
            f"{t['timed']} batches timed after a warm-up of {WORKERS}, median of {r['repeats']} repeats. Compute per "
            f"batch (A) = {r['compute_per_batch'] * 1e3:.1f} ms wall ({r['compute_cpu_per_batch'] * 1e3:.1f} ms CPU), so 2 perfectly busy "
            f"workers deliver a batch every {r['compute_per_batch'] / 2 * 1e3:.1f} ms. CPU times are per process from "
            "/proc/PID/task/*/schedstat (ns), over the timed window. The client CPU includes reading one byte per page of every "
            "batch (what a trainer would at least do) and, for the DataLoader, unpickling and mapping its "
            "shared-memory tensors; the DataLoader has no server process (its workers send batches straight to "
            "the client). On this 2-core machine the wall-clock estimate mixes transport with CPU contention, so "
            "the CPU columns are the better measure of what moving a batch costs.", ""]
    rows = []
    for name, d in r["decode"].items():
        rows.append([name, d["images"], f"{d['mean_size'][0]:.0f}x{d['mean_size'][1]:.0f}",
                     f"{d['eligible']} of {d['images']}", f"{d['full'] * 1e6:.0f}", f"{d['reduced'] * 1e6:.0f}",
                     fx(d["full"] / d["reduced"]), f"{d['psnr_db']:.1f}"])
    out += ["**C. Decode smartly: IMREAD_REDUCED_COLOR_2 + Resize(256, 256) vs full decode + Resize(256, 256)**", "",
            md_table(["JPEGs", "images", "mean size", "downscale >= 2x on both sides (the rule applies)",
                      "full decode + resize, CPU us", "reduced decode + resize, CPU us", "speedup", "PSNR of reduced vs full, dB"],
                     rows), "",
            "Times are CPU time of the decoding thread per image (decode + BGR->RGB + A.Resize; OpenCV on 1 thread), "
            "median of the repeats. batchd's workers now decode reduced JPEGs themselves when the pipeline starts "
            "with a Resize to at most half the size (server/data/datasets/_files.py read_rgb(min_size=...)); the "
            "sequential loop and the DataLoader baseline call load_image the same way. The photo set is 400-520 px "
            "wide, so Resize(256, 256) shrinks most images by less than 2x: decoding at half size and then "
            "*upscaling* to 256 is faster but loses detail (the PSNR column), and a rule 'reduce only when the "
            "pipeline downsizes >= 2x' would apply to the images counted in column 4 only. The 1024x768 row is "
            "where the rule does apply."]
    return "\n".join(out)


def targets(r: dict) -> list[dict]:
    return []  # the profile informs; it has no target
