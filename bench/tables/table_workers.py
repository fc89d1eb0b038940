"""Table 1: images/s for 1, 2 and 4 workers x pipelines L1-L4, and the speedup over a sequential loop.

Methods: the sequential loop (``bench/peers/sequential.py``), PyTorch DataLoader (persistent workers),
batchd over TCP as a remote trainer gets it by default (transport="socket": the socket data plane,
received by the relay process and mapped from its shared memory; Table 18 compares it with the
bytes in the gRPC messages, transport="inline") and batchd over shared memory (transport="shm"). Batch 64. One server and one DataLoader per worker count, started
once and reused; each measurement consumes ``warmup`` batches untimed (a multiple of the worker
count) and then times ``timed`` batches. Methods are interleaved (rotating order) within each
repeat so that the machine's noise hits all of them alike.

Peers (``bench/peers/tf_peer.py``, pipeline L3 only, when TensorFlow is installed): tf.data in-process
and tf.data service (a dispatcher and one worker on this host), doing L3's work with TF ops, in
one subprocess per worker count, interleaved with the methods above; without TensorFlow the
table says "skipped".
"""

from __future__ import annotations

import time

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, spread, time_stream
from bench.noise import measure
from bench.peers import sequential, tf_peer
from bench.peers.torch_loader import PhotoDataset, make_loader, time_loader
from bench.report import fx, md_table

NAME = "table1"
TITLE = "Table 1: workers x pipeline (batch 64)"
METHODS = ("sequential", "dataloader", "batchd_tcp", "batchd_shm")
LABELS = {"sequential": "sequential", "dataloader": "DataLoader", "batchd_tcp": "batchd TCP (data plane)",
          "batchd_shm": "batchd shm"}


def run(s, log=print) -> dict:
    workers_list = s.pick((1, 2, 4), (1, 2))
    pipes = s.pick(pipelines.NAMES, ("L3",))
    bs = 64
    timed = s.pick(16, 4)          # batches timed per measurement (1,024 images)
    seq_batches = s.pick(12, 4)    # the sequential loop is steady from the first batch
    cfg = common.photos_config()
    ds = common.open_local("photos", cfg)
    composes = {p: pipelines.build(p) for p in pipes}
    presets = pipelines.presets(pipes)
    torch_ds = PhotoDataset("photos", cfg, data.LOCAL_CACHE, presets)
    # the peers a user would pick instead (bench/peers/tf_peer.py): tf.data and tf.data service, L3 only
    peers = tf_peer.METHODS if tf_peer.available() and tf_peer.PIPELINE in pipes else ()
    photo_paths = [str(data.PHOTOS / f) for f in data.photo_files()]
    photo_labels = [int(f.split("/")[0].split("_")[1]) for f in data.photo_files()]
    tf_version, tf_isolated = "", False
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    startup = {}

    def key(w, p, m):
        return f"{w}|{p}|{m}"

    for w in workers_list:
        warmup = max(2, w)
        peer = tf_peer.TFPeer(photo_paths, photo_labels, w).start() if peers else None  # TF start-up not counted
        tf_version = peer.version if peer else tf_version
        tf_isolated = peer.isolated if peer else tf_isolated
        t0 = time.perf_counter()
        srv = ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=presets, workers=w,
                            cache_dir=data.CACHE).start()
        dl, plan = make_loader(torch_ds, w)
        try:
            # first use: DataLoader workers start, server workers build each pipeline
            for p in pipes:
                plan.set(p, len(torch_ds), bs, w, seed=0)
                for _ in dl:
                    pass
                with common.remote(srv.address, "photos", batch_size=bs, pipeline=p, workers=w, transport="shm") as rl:
                    time_stream(rl, 0, w)
            startup[w] = time.perf_counter() - t0
            for rep in range(s.repeats):
                for pi, p in enumerate(pipes):
                    methods = METHODS + (peers if p == tf_peer.PIPELINE else ())
                    k = (rep + pi) % len(methods)
                    order = methods[k:] + methods[:k]
                    for m in order:
                        seed = 1000 * rep + pi
                        r = measure(lambda: _one(m, ds, composes[p], torch_ds, dl, plan, srv, w, p, bs, seed,
                                                 warmup, timed, seq_batches, peer))
                        rates.setdefault(key(w, p, m), []).append(r.rate)
                        cpus.setdefault(key(w, p, m), []).append(r.cpu_per_image)
                log(f"  table1: workers={w} repeat {rep + 1}/{s.repeats} done")
        finally:
            del dl
            srv.stop()
            if peer is not None:
                peer.stop()
    rows = []
    for w in workers_list:
        for p in pipes:
            cell = {m: rates[key(w, p, m)] for m in METHODS + peers if key(w, p, m) in rates}
            cpu = {m: median(cpus[key(w, p, m)]) for m in cell}
            rows.append({"workers": w, "pipeline": p, "rates": cell, "cpu_per_image": cpu,
                         "median": {m: median(v) for m, v in cell.items()},
                         "spread": {m: spread(v) for m, v in cell.items()}})
    return {"rows": rows, "batch_size": bs, "timed_images": timed * bs, "seq_images": seq_batches * bs,
            "repeats": s.repeats, "startup_s": startup, "tf_version": tf_version, "tf_isolated": tf_isolated,
            "peers": "measured" if peers else tf_peer.SKIPPED if not tf_peer.available()
            else f"not run: no {tf_peer.PIPELINE} in this run"}


def _one(m, ds, compose, torch_ds, dl, plan, srv, w, p, bs, seed, warmup, timed, seq_batches, peer=None):
    if m in tf_peer.METHODS:
        try:
            return peer.measure(m, seed, warmup, timed)
        finally:
            peer.wait_idle()  # its prefetched batches must not overlap the next measurement
    if m == "sequential":
        return time_stream(sequential.batches(ds, compose, bs, seq_batches + 1, seed), 1, seq_batches)
    if m == "dataloader":
        return time_loader(dl, plan, p, len(torch_ds), bs, warmup, timed, seed)
    transport = "socket" if m == "batchd_tcp" else "shm"
    try:
        with common.remote(srv.address, "photos", batch_size=bs, pipeline=p, workers=w, transport=transport,
                           seed=seed) as rl:
            return time_stream(rl, warmup, timed)
    finally:
        srv.wait_idle()  # the batches in flight when we stopped reading must not overlap the next measurement


def render(r: dict) -> str:
    head = ["workers", "pipeline", "sequential img/s", "DataLoader img/s (speedup)", "batchd TCP img/s (speedup)",
            "batchd shm img/s (speedup)", "shm / DataLoader", "TCP / shm"]
    rows = []
    for row in r["rows"]:
        m = row["median"]
        seq = m["sequential"]
        rows.append([
            row["workers"], row["pipeline"], f"{seq:.0f}",
            *(f"{m[k]:.0f} ({fx(m[k] / seq)})" for k in ("dataloader", "batchd_tcp", "batchd_shm")),
            fx(m["batchd_shm"] / m["dataloader"]), fx(m["batchd_tcp"] / m["batchd_shm"]),
        ])
    worst = max(max(row["spread"].values()) for row in r["rows"])
    notes = (
        f"\nimages/s over {r['timed_images']} images per measurement after a warm-up of max(2, workers) "
        f"batches (sequential: {r['seq_images']} images after one batch); speedup = images/s over the sequential "
        f"loop measured in the same block; median of {r['repeats']} interleaved repeats (largest spread "
        f"(max-min)/median of any cell: {worst:.0%}). Pipelines: "
        + "; ".join(f"{k} = {v}" for k, v in pipelines.DESCRIPTIONS.items()) + "."
    )
    out = md_table(head, rows) + "\n" + notes + "\n" + tf_peer.render(r)
    if all("cpu_per_image" in row for row in r["rows"]):
        head = ["workers", "pipeline", "sequential", "DataLoader", "batchd TCP", "batchd shm", "DataLoader / shm",
                "TCP / shm"]
        rows = []
        for row in r["rows"]:
            c = row["cpu_per_image"]
            rows.append([row["workers"], row["pipeline"], *(f"{c[m] * 1e3:.2f}" for m in METHODS),
                         fx(c["dataloader"] / c["batchd_shm"]), fx(c["batchd_tcp"] / c["batchd_shm"])])
        out += ("\n\n**CPU cost per image** (ms of CPU per image, summed over every process of the measurement: "
                "the client, the batchd server and its workers, the DataLoader workers; same timed window, median of "
                "the repeats). Unlike images/s it hardly depends on what other processes on the shared machine "
                "do; on this CPU-bound 2-core machine, throughput with every core busy is about 2 cores / CPU per "
                "image. Ratios above 1x: more CPU than batchd shm.\n\n" + md_table(head, rows))
    return out


def _cell(r: dict, workers: int, pipeline: str, stat: str = "median"):
    for row in r["rows"]:
        if row["workers"] == workers and row["pipeline"] == pipeline:
            return row["median"] if stat == "median" else {m: max(v) for m, v in row["rates"].items()}
    return None


def targets(r: dict) -> list[dict]:
    c = _cell(r, 2, "L3")
    if c is None:
        return [{"name": "Table 1 targets", "passed": None, "detail": "no L3 / 2-worker cell in this run"}]
    b = _cell(r, 2, "L3", "best")  # other processes only ever slow a run down: the best run is the least disturbed
    row = next(x for x in r["rows"] if x["workers"] == 2 and x["pipeline"] == "L3")
    cpu = row.get("cpu_per_image")
    cpu_note = "" if cpu is None else "; CPU per image: {:.2f}x"
    shm_dl = c["batchd_shm"] / c["dataloader"]
    tcp_shm = c["batchd_tcp"] / c["batchd_shm"]
    best = f"; best of {r['repeats']} runs each: {{:.2f}}x"
    tcp_all = [row["median"]["batchd_tcp"] / row["median"]["batchd_shm"] for row in r["rows"]]
    return [
        {"name": "batchd shm >= 1.0x DataLoader images/s (L3, batch 64, 2 workers; aim 1.2x)",
         "passed": shm_dl >= 1.0,
         "detail": f"{shm_dl:.2f}x ({c['batchd_shm']:.0f} vs {c['dataloader']:.0f} img/s)"
                   + ("" if shm_dl >= 1.2 else "; below the 1.2x aim")
                   + best.format(b["batchd_shm"] / b["dataloader"])
                   + (cpu_note.format(cpu["dataloader"] / cpu["batchd_shm"]) + " as much CPU for the DataLoader"
                      if cpu else "")},
        {"name": "batchd TCP >= 0.9x the shm path (L3, batch 64, 2 workers)",
         "passed": tcp_shm >= 0.9,
         "detail": f"{tcp_shm:.2f}x ({c['batchd_tcp']:.0f} vs {c['batchd_shm']:.0f} img/s)"
                   + best.format(b["batchd_tcp"] / b["batchd_shm"])
                   + (cpu_note.format(cpu["batchd_tcp"] / cpu["batchd_shm"]) + " as much CPU for TCP" if cpu else "")
                   + f"; over all cells of Table 1 (medians): {min(tcp_all):.2f}x..{max(tcp_all):.2f}x"},
    ]
