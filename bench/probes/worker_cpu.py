"""CPU per image by process: batchd (shared memory) against PyTorch DataLoader on the same work.

    python -m bench.probes.worker_cpu [--rounds R] [--batches N] [--large] [--full-decode]

About a minute on a 2-core machine; prints a table (nothing written). Table 16's same-work rows
give the images/s of each; this splits the CPU behind them, so that a change to the workers'
code shows where it moved: the trainer (this process, every thread), the server's main process,
the server's workers, the DataLoader's workers. It is how the workers' read policy
(``server/data/reader.py``: samples of a page-cached disk read on the worker's own thread) was
measured: run it on the commit before that policy and on it.

The work: the photo set (bench/fixtures), decode + L3, batch 64, 2 workers, no cache on either
side; one ``batchd serve`` process (bench/fixtures/server_proc.py) and one DataLoader with 2
persistent forkserver workers (bench/peers/torch_loader.py), both warmed up first. Each round
times ``batches`` batches of each, alternating which goes first; CPU from ``time.process_time``
(this process) and ``/proc/PID/stat`` (the others), over the same window as the images/s.
Medians of the rounds.
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds, time_stream
from bench.report import md_table

WORKERS = 2
BATCH = 64
PARTS = ("trainer", "server main", "server workers", "DataLoader workers")


def run(rounds: int, batches: int, large: bool = False,
        reduced_decode: bool = True) -> dict[str, list[tuple[float, list[float]]]]:
    """``{"batchd" | "DataLoader": [(images/s, [ms of CPU per image for each of PARTS]), ...]}``.
    large: Table 20's work instead (large photos, RandomResizedCrop(224) + flip; the DataLoader
    with ``cv2.imread`` + Compose), under the preset name "L3". reduced_decode: the server's
    dataset setting."""
    from bench.peers.torch_loader import ImreadDataset, PhotoDataset, make_loader, time_loader, worker_pids

    if large:
        import albumentations as A

        from bench.tables import table_decode

        folder = data.ensure_large_photos()
        cfg = common.imagefolder_config(folder)
        presets = {"L3": A.to_dict(table_decode.compose())}
        files = data.photo_files(folder)
        torch_ds = ImreadDataset([str(folder / f) for f in files], [0] * len(files), presets)
    else:
        cfg = common.photos_config()
        presets = {"L3": pipelines.preset("L3")}
        torch_ds = PhotoDataset("photos", cfg, data.LOCAL_CACHE, presets)
    dl, plan = make_loader(torch_ds, WORKERS)
    datasets = common.server_datasets(photos=cfg)
    datasets["photos"]["reduced_decode"] = reduced_decode
    srv = ServerProcess(datasets=datasets, pipelines=presets, workers=WORKERS, cache_dir=data.CACHE).start()
    out: dict[str, list] = {"batchd": [], "DataLoader": []}
    try:
        with common.remote(srv.address, "photos", batch_size=BATCH, pipeline="L3", workers=WORKERS,
                           transport="shm") as rl:
            time_stream(rl, 0, WORKERS)  # the workers build L3 once
        time_loader(dl, plan, "L3", len(torch_ds), BATCH, WORKERS, 2 * WORKERS, 0)
        dl_pids = worker_pids(dl)

        def cpus() -> list[float]:
            return [time.process_time(), cpu_seconds(srv.pid), sum(cpu_seconds(p) for p in srv.worker_pids),
                    sum(cpu_seconds(p) for p in dl_pids)]

        for k in range(rounds):
            for name in ("batchd", "DataLoader") if k % 2 == 0 else ("DataLoader", "batchd"):
                marks: dict[str, list[float]] = {}
                hooks = {"on_start": lambda: marks.__setitem__("start", cpus()),
                         "on_end": lambda: marks.__setitem__("end", cpus())}
                if name == "DataLoader":
                    r = time_loader(dl, plan, "L3", len(torch_ds), BATCH, 2 * WORKERS, batches, 1000 + k, **hooks)
                else:
                    try:
                        with common.remote(srv.address, "photos", batch_size=BATCH, pipeline="L3",
                                           workers=WORKERS, transport="shm", seed=1000 + k) as rl:
                            r = time_stream(rl, 2 * WORKERS, batches, **hooks)
                    finally:
                        srv.wait_idle()
                ms = [(b - a) * 1e3 / r.images for a, b in zip(marks["start"], marks["end"])]
                out[name].append((r.images / r.seconds, ms))
    finally:
        srv.stop()
    return out


def render(out: dict, rounds: int, batches: int) -> str:
    rows = []
    for name, runs in out.items():
        parts = [statistics.median(ms[i] for _, ms in runs) for i in range(len(PARTS))]
        rows.append([name, f"{statistics.median(rate for rate, _ in runs):.0f}", *(f"{x:.3f}" for x in parts),
                     f"{sum(parts):.3f}"])
    head = ["loader", "images/s", *(f"{p} ms CPU / image" for p in PARTS), "all"]
    return md_table(head, rows) + (
        f"\n\nPhotos, decode + L3, batch {BATCH}, {WORKERS} workers, no cache; {batches} batches timed per round, "
        f"median of {rounds} alternated rounds.")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--batches", type=int, default=40, help="timed batches per round (at most 40: one epoch of 46)")
    ap.add_argument("--large", action="store_true", help="Table 20's work: large photos, RandomResizedCrop(224) + flip")
    ap.add_argument("--full-decode", action="store_true", help="the server's dataset with reduced_decode: false")
    args = ap.parse_args(argv)
    batches = min(args.batches, 20 if args.large else 40)
    print(render(run(args.rounds, batches, args.large, not args.full_decode), args.rounds, batches))


if __name__ == "__main__":
    main()
