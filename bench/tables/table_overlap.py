"""Table 3: overlap of loading (T1 per batch) with a training step of fixed length T2.

T1 = the median time to build one L3 batch of 64 in this process (the sequential loop), measured
at the start of the table. For T2 = 0.5, 1 and 2 x T1: the sequential loop (load the batch, then
train: T1 + T2 per step) against batchd (RemoteDataLoader over shared memory, 2 workers; and 1
worker, where overlap alone has to bring the step down to max(T1, T2)). Reported per step: the
total time, the time blocked in next() ("data wait"), and total / max(T1, T2).

The primary step is ``time.sleep(T2)``: on a GPU the Python thread waits while the device
computes, and its core is free for the loader. The CPU-busy variant (a calibrated torch matmul
loop) shows what happens when the trainer itself needs a core: on 2 cores it competes with the
workers, so neither side gets the time it had when measured alone.
"""

from __future__ import annotations

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.fixtures.trainer import BusyStep, SleepStep, train_loop
from bench.measure import median
from bench.noise import measure
from bench.peers import sequential
from bench.report import md_table

NAME = "table3"
TITLE = "Table 3: overlap of loading and training (L3, batch 64)"
BS = 64
PIPELINE = "L3"


def run(s, log=print) -> dict:
    ratios = (0.5, 1.0, 2.0)
    steps = s.pick(20, 3)
    warmup = 2
    cfg = common.photos_config()
    ds = common.open_local("photos", cfg)
    compose = pipelines.build(PIPELINE)
    presets = pipelines.presets([PIPELINE])
    sequential.batch_seconds(ds, compose, BS, 2)
    t1 = median(sequential.batch_seconds(ds, compose, BS, s.pick(12, 4), seed=7))
    sleep_steps = {x: SleepStep(x * t1) for x in ratios}
    busy_steps = {x: BusyStep(x * t1) for x in ratios}
    log(f"  table3: T1 = {t1 * 1e3:.1f} ms; busy steps measured alone: "
        + ", ".join(f"{b.measured * 1e3:.0f} ms" for b in busy_steps.values()))
    cases = [("sleep", "sequential", 0), ("sleep", "batchd", 2), ("sleep", "batchd", 1),
             ("busy", "sequential", 0), ("busy", "batchd", 2)]
    if s.quick:
        cases.remove(("sleep", "batchd", 1))
    results: dict[str, list[tuple[float, float]]] = {}
    servers = {}
    try:
        for w in sorted({w for _, _, w in cases if w}):
            servers[w] = ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=presets, workers=w,
                                       cache_dir=data.CACHE).start()
            with common.remote(servers[w].address, "photos", batch_size=BS, pipeline=PIPELINE, workers=w,
                               transport="shm") as rl:
                train_loop(rl, lambda: None, 0, 2)
        for rep in range(s.repeats):
            for xi, x in enumerate(ratios):
                k = (rep + xi) % len(cases)
                for variant, method, w in cases[k:] + cases[:k]:
                    step = sleep_steps[x] if variant == "sleep" else busy_steps[x]
                    seed = 100 * rep + xi
                    r = measure(lambda: _one(method, ds, compose, servers.get(w), w, step, seed, warmup, steps))
                    results.setdefault(f"{variant}|{x}|{method}|{w}", []).append(r)
            log(f"  table3: repeat {rep + 1}/{s.repeats} done")
    finally:
        for srv in servers.values():
            srv.stop()
    # T1 as measured during the table: the sequential loop's own load time per batch (its "data wait")
    t1_measured = median(r[1] for k, runs in results.items() if "|sequential|" in k for r in runs)
    rows = []
    for variant, method, w in cases:
        for x in ratios:
            runs = results[f"{variant}|{x}|{method}|{w}"]
            per_step = median(r[0] for r in runs)
            wait = median(r[1] for r in runs)
            t2 = x * t1
            t1m = t1_measured
            rows.append({"variant": variant, "method": method, "workers": w, "t2_over_t1": x, "t1": t1m, "t2": t2,
                         "t2_busy_alone": busy_steps[x].measured if variant == "busy" else None,
                         "per_step": per_step, "wait": wait, "runs": runs,
                         "ratio": per_step / max(t1m, t2), "wait_fraction": wait / per_step})
    return {"rows": rows, "t1_calibrated": t1, "t1": t1_measured, "steps": steps, "warmup": warmup,
            "repeats": s.repeats}


def _one(method, ds, compose, srv, w, step, seed, warmup, steps):
    if method == "sequential":
        return train_loop(sequential.batches(ds, compose, BS, warmup + steps, seed), step, warmup, steps)
    # prefetch 2 x workers, as in Tables 1 and 2
    try:
        with common.remote(srv.address, "photos", batch_size=BS, pipeline=PIPELINE, workers=w, transport="shm",
                           seed=seed) as rl:
            return train_loop(rl, step, warmup, steps)
    finally:
        srv.wait_idle()  # the batches in flight when we stopped reading must not overlap the next measurement


def _method(row) -> str:
    if row["method"] == "sequential":
        return "sequential (load, then train)"
    return f"batchd shm, {row['workers']} worker{'s' if row['workers'] > 1 else ''}"


def render(r: dict) -> str:
    head = ["step", "T2 / T1 (set)", "T2 / T1 (measured)", "T1 ms", "T2 ms", "method", "per step ms", "per step / max(T1, T2)",
            "data wait ms", "data wait % of step"]
    rows = []
    for row in r["rows"]:
        t2 = f"{row['t2'] * 1e3:.0f}"
        if row["t2_busy_alone"] is not None:
            t2 += f" ({row['t2_busy_alone'] * 1e3:.0f} alone)"
        rows.append([row["variant"], f"{row['t2_over_t1']:g}", f"{row['t2'] / row['t1']:.2f}", f"{row['t1'] * 1e3:.0f}",
                     t2, _method(row),
                     f"{row['per_step'] * 1e3:.1f}", f"{row['ratio']:.2f}", f"{row['wait'] * 1e3:.1f}",
                     f"{row['wait_fraction']:.1%}"])
    return md_table(head, rows) + (
        f"\n\nT1 = {r['t1'] * 1e3:.1f} ms: the median time the sequential loop took to build one batch (read, decode, "
        f"L3, stack) in this table's sequential runs; T2 was set from T1 measured alone at the start of the table "
        f"({r['t1_calibrated'] * 1e3:.1f} ms), hence the two T2/T1 columns. Ratios are to max(T1, T2) with the "
        f"measured T1. {r['steps']} steps timed after {r['warmup']} warm-up steps; "
        f"median of {r['repeats']} interleaved repeats. `sleep` = time.sleep(T2), the model of a GPU step (the "
        "trainer's core is free while it waits); `busy` = a single-threaded torch matmul loop calibrated alone to "
        "T2, i.e. a CPU trainer that competes with the workers for this machine's 2 cores. The targets are "
        "checked on the sleep rows with 2 workers; the 1-worker rows show overlap alone (no parallel speedup), "
        "where the best possible is max(T1, T2)."
    )


def targets(r: dict) -> list[dict]:
    rows = [x for x in r["rows"] if x["variant"] == "sleep" and x["method"] == "batchd" and x["workers"] == 2]
    one = [x for x in r["rows"] if x["variant"] == "sleep" and x["method"] == "batchd" and x["workers"] == 1]
    worst = max(x["ratio"] for x in rows)
    heavy = [x for x in rows if x["t2"] >= x["t1"]]
    worst_wait = max(x["wait_fraction"] for x in heavy)
    return [
        {"name": "overlap: per-step time <= 1.1 x max(T1, T2) (batchd, 2 workers, sleep step)",
         "passed": worst <= 1.1,
         "detail": "per step / max(T1, T2) = " + ", ".join(f"{x['ratio']:.2f} at T2={x['t2_over_t1']:g}xT1" for x in rows)
                   + "; with 1 worker: " + ", ".join(f"{x['ratio']:.2f}" for x in one)},
        {"name": "data wait < 5% of the step when T2 >= T1 (batchd, 2 workers, sleep step)",
         "passed": worst_wait < 0.05,
         "detail": ", ".join(f"{x['wait_fraction']:.1%} at T2={x['t2_over_t1']:g}xT1" for x in heavy)
                   + "; with 1 worker: " + ", ".join(f"{x['wait_fraction']:.1%}" for x in one if x["t2"] >= x["t1"])},
    ]
