"""Table 15: workers sized to demand (config workers: {min: 1, max: 2}) against fixed pools of 1 and 2.

    python -m bench.tables.table_autoscale [--quick] [--repeats N]

One ``batchd serve`` per pool (bench/fixtures/server_proc.py): ``workers: 1``, ``workers: {min: 1, max: 2,
cool_down_s: COOL_DOWN_S}`` and ``workers: 2``, over Fashion-MNIST's training split with a
CPU-heavy pipeline (``PIPELINE``: resize to 256 x 256, Gaussian and median blurs, brightness and
contrast: milliseconds a sample; batch 64), read through shared memory by one loader, with two
kinds of training loop:

* ``data-bound``: no training step (the loop always waits for data: the pool should grow);
* ``trainer-bound``: a step of ``SLOW_STEP`` x one worker's time per batch (slower than one
  worker: the pool should stay at one).

Each measurement opens a fresh stream once every pool is back at its minimum (the sized pool
retires its extra worker ``COOL_DOWN_S`` after its client stops), reads ``timed`` batches and
reports images/s over that whole read (the ramp included) and over its second half, CPU seconds
per image of the measured server's process tree and this client over the same window, and the
workers it ran on average (Stats' worker count sampled every 0.25 s).
"""

from __future__ import annotations

import os
import sys
import threading
import time

import albumentations as A

from bench import common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, tree_cpu_seconds
from bench.noise import measure
from bench.report import md_table

NAME = "table15"
NEEDS_PHOTOS = False  # Fashion-MNIST only (bench/run_all.py)
TITLE = "Table 15: workers sized to demand ({min: 1, max: 2}) vs fixed pools of 1 and 2 (Fashion-MNIST, batch 64)"
FMNIST = {"kind": "fashion-mnist", "root": "/usr/share/datasets/fashion-mnist", "split": "train"}
PIPELINE = A.Compose([A.Resize(256, 256), A.GaussianBlur(blur_limit=(9, 9), p=1.0), A.MedianBlur(blur_limit=7, p=1.0),
                      A.RandomBrightnessContrast(p=1.0)])
BATCH = 64
COOL_DOWN_S = 3.0
SLOW_STEP = 2.0  # the trainer-bound loop's step, in one worker's seconds per batch
POOLS = (("fixed 1", 1), ("{min: 1, max: 2}", {"min": 1, "max": 2, "cool_down_s": COOL_DOWN_S, "cpu_quota": 2}),
         ("fixed 2", 2))


def _read(srv: ServerProcess, timed: int, step_s: float, seed: int) -> dict:
    from batchd.client.transport.server_stats import get_stats

    workers: list[int] = []
    stop = threading.Event()

    def sample():
        while not stop.wait(0.25):
            try:
                workers.append(get_stats(srv.address, timeout=2).pool.workers)
            except Exception:  # noqa: BLE001  (a missed sample)
                pass

    sampler = threading.Thread(target=sample, daemon=True)

    def cpu() -> float:  # this server's tree and this client (another server's retired worker is not ours)
        return tree_cpu_seconds(srv.pid) + time.process_time()

    t0, c0 = time.perf_counter(), cpu()
    with common.remote(srv.address, "fmnist", batch_size=BATCH, pipeline="heavy", workers=2, transport="shm",
                       seed=seed) as rl:
        sampler.start()
        it = iter(rl)
        half = None
        for i in range(timed):
            next(it)
            if i + 1 == timed // 2:
                half = time.perf_counter()
            if step_s:
                time.sleep(step_s)
        t1, c1 = time.perf_counter(), cpu()
        stop.set()
        it.close()
        p = rl.profile()
    sampler.join(5)
    pool = get_stats(srv.address).pool
    return {"rate": timed * BATCH / (t1 - t0), "late_rate": (timed - timed // 2) * BATCH / (t1 - half),
            "cpu_per_image": (c1 - c0) / (timed * BATCH),
            "workers_mean": sum(workers) / len(workers) if workers else float("nan"),
            "scale_ups": pool.scale_ups, "wait_ratio": p["wait_ratio"], "verdict": p["verdict"]}


def _wait_for_min(srv: ServerProcess, timeout: float = 60.0) -> None:
    """Until the pool runs its minimum again (the sized pool retires its extra worker after the cool-down)."""
    from batchd.client.transport.server_stats import get_stats

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pool = get_stats(srv.address).pool
        if pool.workers == pool.min_workers:
            return
        time.sleep(0.5)


def run(s, log=print) -> dict:
    timed = s.pick(160, 80)
    presets = {"heavy": A.to_dict(PIPELINE)}
    servers = {name: ServerProcess(datasets={"fmnist": FMNIST}, pipelines=presets, workers=workers,
                                   cache_dir=data.CACHE) for name, workers in POOLS}
    results: dict[tuple[str, str], list[dict]] = {}
    try:
        for srv in servers.values():
            srv.start()
        for name, srv in servers.items():  # first use: the workers build the pipeline
            _read(srv, 2, 0.0, seed=999)
        one = _read(servers["fixed 1"], 6, 0.0, seed=998)["rate"]
        step = SLOW_STEP * BATCH / one  # seconds: slower than one worker
        loops = (("data-bound", 0.0), ("trainer-bound", step))
        for rep in range(s.repeats):
            for loop, step_s in loops:
                for name, srv in servers.items():
                    for other in servers.values():  # every pool at its minimum: no retiring worker runs meanwhile
                        _wait_for_min(other)
                    srv.wait_idle()
                    r = measure(lambda: _read(srv, timed, step_s, seed=100 * rep + len(results)))
                    results.setdefault((loop, name), []).append(r)
                    log(f"  table15: {loop}, {name}, repeat {rep + 1}/{s.repeats}: {r['rate']:.0f} img/s, "
                        f"{r['workers_mean']:.2f} workers on average, {r['scale_ups']} started so far")
    finally:
        for srv in servers.values():
            srv.stop()
    rows = []
    for (loop, name), rs in results.items():
        rows.append({"loop": loop, "pool": name, "rate": median(r["rate"] for r in rs),
                     "late_rate": median(r["late_rate"] for r in rs),
                     "cpu_per_image": median(r["cpu_per_image"] for r in rs),
                     "workers_mean": median(r["workers_mean"] for r in rs),
                     "wait_ratio": median(r["wait_ratio"] for r in rs), "verdict": rs[-1]["verdict"]})
    return {"rows": rows, "timed": timed, "batch": BATCH, "step_s": step, "repeats": s.repeats,
            "cpus": os.cpu_count() or 1, "cool_down_s": COOL_DOWN_S}


def render(r: dict) -> str:
    head = ["training loop", "pool", "images/s (whole read)", "vs fixed 1", "images/s, second half", "vs fixed 1",
            "CPU / image", "workers on average", "loop's wait", "verdict"]
    base = {row["loop"]: row["rate"] for row in r["rows"] if row["pool"] == "fixed 1"}
    late = {row["loop"]: row["late_rate"] for row in r["rows"] if row["pool"] == "fixed 1"}
    table = [[row["loop"], row["pool"], f"{row['rate']:,.0f}", f"{row['rate'] / base[row['loop']]:.2f}x",
              f"{row['late_rate']:,.0f}", f"{row['late_rate'] / late[row['loop']]:.2f}x",
              f"{row['cpu_per_image'] * 1e3:.2f} ms", f"{row['workers_mean']:.2f}", f"{row['wait_ratio']:.0%}",
              row["verdict"]] for row in r["rows"]]
    return md_table(head, table) + (
        f"\n\n{r['timed']} batches of {r['batch']} per measurement, from a fresh stream on a pool at its minimum "
        f"(the ramp is inside the window), median of {r['repeats']}; trainer-bound step {r['step_s'] * 1e3:.0f} ms "
        f"(slower than one worker). CPU: utime + stime of the server's tree and this client over the window, per "
        f"image. Workers on average: Stats' worker count sampled every 0.25 s. The sized pool starts its second "
        f"worker once the client has waited and the first was busy for 2 s, and retires it {r['cool_down_s']:g} s "
        f"after nobody waits; {r['cpus']} CPUs.")


def targets(r: dict) -> list[dict]:
    rows = {(x["loop"], x["pool"]): x for x in r["rows"]}
    sized, one, two = (rows[("data-bound", p)] for p in ("{min: 1, max: 2}", "fixed 1", "fixed 2"))
    slow = rows[("trainer-bound", "{min: 1, max: 2}")]
    return [
        {"name": "a data-bound loop, once grown: the sized pool beats one worker (>= 1.2x, second half)",
         "passed": sized["late_rate"] >= 1.2 * one["late_rate"],
         "detail": f"{sized['late_rate']:.0f} vs {one['late_rate']:.0f} img/s (fixed 2: {two['late_rate']:.0f}); "
                   f"whole read {sized['rate']:.0f} vs {one['rate']:.0f} (fixed 2: {two['rate']:.0f})"},
        {"name": "a trainer-bound loop: the sized pool stays near one worker (<= 1.25 on average)",
         "passed": slow["workers_mean"] <= 1.25, "detail": f"{slow['workers_mean']:.2f} workers on average"},
    ]


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
