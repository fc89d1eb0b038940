"""Table 9: images/s against storage latency added to every file open (0, 2, 10, 50 ms).

    python bench/table_latency.py [--quick] [--repeats N]

The photo set (bench/make_photos.py) is mounted through ``bench/fusefs.py``, a read-only FUSE
pass-through that sleeps in ``open`` (what NFS, Lustre metadata or an object store's first byte
cost per object); every row reads through the same mount, whose latency changes live between
measurements (0 ms is the FUSE pass-through without sleeping, not the local disk). Rows:

- batchd with 2 workers (shared-memory transport, prefetch 4): each worker reads the samples of its
  running and queued batches on ``reads_in_flight`` I/O threads (default 32) while it decodes;
- the same with ``reads_in_flight: 1`` (one read at a time, overlapping only the decode: about
  what batchd did before concurrent reads);
- PyTorch DataLoader with 2 and with 16 workers (``bench/torch_loader.py``: batchd's decode code,
  persistent workers, prefetch_factor 2), each worker reading its batch's files one after another.

L3 pipeline, batch 64. Each measurement consumes max(4, workers) batches untimed, then times
``timed`` batches (16 for batchd and DataLoader with 16 workers, 8 with 2; --quick: 4, 3). Memory: the batchd server's and its workers' PSS (proportional set size, so
shared pages count once) and RSS at the end of the timed window at each latency, and the
DataLoader workers' PSS, in MB. Targets (issue 11): at 10 ms batchd keeps >= 0.8x its 0 ms
images/s, at 50 ms >= 0.5x. Needs /dev/fuse, fusermount3 (Debian's fuse3) and mfusepy.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

from batchd.server.config import ImageFolderConfig  # noqa: E402
from bench import common, data, pipelines  # noqa: E402
from bench.fusefs import Mount  # noqa: E402
from bench.measure import median, smaps_rollup, time_stream  # noqa: E402
from bench.noise import measure  # noqa: E402
from bench.report import fx, md_table  # noqa: E402
from bench.server_proc import ServerProcess  # noqa: E402
from bench.torch_loader import PhotoDataset, make_loader, worker_pids  # noqa: E402

NAME = "table9"
TITLE = "Table 9: images/s against storage latency per file open (FUSE, L3, batch 64)"
LATENCIES_MS = (0, 2, 10, 50)
METHODS = ("batchd", "batchd_seq", "dataloader2", "dataloader16")
LABELS = {"batchd": "batchd, 2 workers", "batchd_seq": "batchd, 2 workers, reads_in_flight 1",
          "dataloader2": "DataLoader, 2 workers", "dataloader16": "DataLoader, 16 workers"}
WORKERS = {"batchd": 2, "batchd_seq": 2, "dataloader2": 2, "dataloader16": 16}
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


def run(s, log=print) -> dict:
    """Measure every (latency, method) cell ``s.repeats`` times, methods interleaved."""
    timed = {"batchd": s.pick(16, 4), "batchd_seq": s.pick(8, 3), "dataloader2": s.pick(8, 3),
             "dataloader16": s.pick(16, 4)}
    data.ensure_photos()
    presets = pipelines.presets((PIPELINE,))
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    memory: dict[str, dict[str, float]] = {}
    skipped = fuse_missing()
    if skipped:
        log(f"  table9: skipped: {skipped}")
        return {"skipped": skipped, "rows": [], "repeats": s.repeats}
    work = tempfile.mkdtemp(prefix="batchd-latency-")
    try:
        with Mount(data.PHOTOS, 0) as mnt:
            cfg = ImageFolderConfig(kind="imagefolder", root=mnt.path)
            servers = {m: ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=presets, workers=2,
                                        cache_dir=os.path.join(work, "cache"),
                                        extra={"reads_in_flight": 1} if m == "batchd_seq" else None).start()
                       for m in ("batchd", "batchd_seq")}
            torch_ds = PhotoDataset("photos", cfg, pathlib.Path(work, "cache-local"), presets)
            loaders = {m: make_loader(torch_ds, WORKERS[m]) for m in METHODS if m != "batchd"}
            try:
                for m in METHODS:  # start-up (DataLoader workers, the server's pipeline) not timed
                    _one(m, servers, loaders, torch_ds, seed=0, timed=1)
                log(f"  table9: started (servers {servers['batchd'].startup_s:.1f} s)")
                for rep in range(s.repeats):
                    for li, latency in enumerate(LATENCIES_MS):
                        mnt.set_latency(latency)
                        k = (rep + li) % len(METHODS)
                        for m in METHODS[k:] + METHODS[:k]:
                            snap = {}
                            r = measure(lambda: _one(m, servers, loaders, torch_ds, seed=1000 * rep + li + 1,
                                                     timed=timed[m], snapshot=snap))
                            rates.setdefault(f"{latency}|{m}", []).append(r.rate)
                            cpus.setdefault(f"{latency}|{m}", []).append(r.cpu_per_image)
                            for key, v in snap.items():
                                cell = memory.setdefault(f"{latency}|{m}", {})
                                cell[key] = max(cell.get(key, 0.0), v)
                        log(f"  table9: repeat {rep + 1}/{s.repeats}, {latency} ms done")
            finally:
                del loaders
                for srv in servers.values():
                    srv.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for latency in LATENCIES_MS:
        cell = {m: rates[f"{latency}|{m}"] for m in METHODS}
        rows.append({"latency_ms": latency, "rates": cell, "median": {m: median(v) for m, v in cell.items()},
                     "cpu_per_image": {m: median(cpus[f"{latency}|{m}"]) for m in METHODS},
                     "memory": {m: memory.get(f"{latency}|{m}", {}) for m in METHODS}})
    return {"rows": rows, "batch_size": BATCH, "timed_images": {m: t * BATCH for m, t in timed.items()}, "repeats": s.repeats,
            "pipeline": PIPELINE}


def _one(m: str, servers: dict[str, ServerProcess], loaders: dict, torch_ds, *, seed: int, timed: int,
         snapshot: dict | None = None):
    """One measurement of method ``m``; ``snapshot`` gets the memory (MB) at the end of the timed window."""
    warmup = max(4, WORKERS[m])  # batchd: two batches per worker, so its reads run ahead when the clock starts
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
    dl, plan = loaders[m]

    def dl_end():
        if snapshot is not None:
            snapshot["workers_pss"], snapshot["workers_rss"] = _pss(worker_pids(dl))
    plan.set(PIPELINE, len(torch_ds), BATCH, warmup + timed, seed)
    return time_stream(dl, warmup, timed, on_end=dl_end)


def render(r: dict) -> str:
    if r.get("skipped"):
        return f"skipped: {r['skipped']}"
    head = ["added latency per open", *(f"{LABELS[m]} img/s (x its 0 ms)" for m in METHODS),
            "batchd / DataLoader 16", "batchd server + workers PSS MB (RSS)", "DataLoader 16 workers PSS MB"]
    base = next(row["median"] for row in r["rows"] if row["latency_ms"] == 0)
    rows = []
    for row in r["rows"]:
        m, mem = row["median"], row["memory"]
        b = mem.get("batchd", {})
        rows.append([
            f"{row['latency_ms']} ms",
            *(f"{m[k]:.0f} ({fx(m[k] / base[k])})" for k in METHODS),
            fx(m["batchd"] / m["dataloader16"]),
            f"{b.get('server_pss', 0):.0f} + {b.get('workers_pss', 0):.0f} "
            f"({b.get('server_rss', 0):.0f} + {b.get('workers_rss', 0):.0f})" if b else "-",
            f"{mem.get('dataloader16', {}).get('workers_pss', 0):.0f}",
        ])
    cpu_rows = [[f"{row['latency_ms']} ms", *(f"{row['cpu_per_image'][k] * 1e3:.2f}" for k in METHODS)]
                for row in r["rows"] if "cpu_per_image" in row]
    cpu = ("\n\n**CPU per image** (ms, every process of the measurement: this client, the batchd servers and "
           "workers, the DataLoader workers, the FUSE daemon, all of them, idle or not, during each row's timed "
           "window; median of the repeats). It depends less than images/s on what other users of the machine do, "
           "but it also holds the idle rows' processes (the other server, 18 persistent DataLoader workers), "
           "which weigh more on slow rows: compare down a column, not across.\n\n"
           + md_table(["added latency per open", *(LABELS[m] for m in METHODS)], cpu_rows)) if cpu_rows else ""
    return md_table(head, rows) + cpu + (
        "\n\nimages/s over " + ", ".join(f"{n} ({LABELS[m]})" for m, n in r["timed_images"].items())
        + " images per measurement after max(4, workers) batches of warm-up; "
        f"median of {r['repeats']} interleaved repeats. Every row reads the photo set through the same FUSE "
        "pass-through (bench/fusefs.py, a Python daemon: its own CPU counts against the 2 cores), which sleeps the "
        "added latency in each open. batchd reads 32 samples at once per worker (reads_in_flight) while it decodes; "
        "a DataLoader worker reads its batch's files one after another. On a shared machine the kernel shares the "
        "cores per process, so 16 DataLoader processes take more of them from other users' work than 2 batchd "
        "workers do. Memory at the end of the timed window (the largest over the repeats)."
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
    return out


def main(argv=None) -> None:
    from bench.settings import Settings

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 timed batches per measurement")
    p.add_argument("--repeats", type=int, default=1)
    args = p.parse_args(argv)
    r = run(Settings(quick=args.quick, repeats=args.repeats))
    print(render(r))
    for t in targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")


if __name__ == "__main__":
    main()
