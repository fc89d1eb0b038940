"""CPU per batch against the batch rate: the same loader's work costs more per batch when batches
come slowly (issues 26 and 28).

    python -m bench.probes.batch_rate [--batch-size B] [--batches N] [--rates R ...] [--repeats K] [--out DIR]

About a minute on a 2-core machine. The table goes to stdout and, as the numbered tables' do, to
``--out`` (default bench/results): the raw figures into ``results.json`` under ``batch_rate`` (the
tables' entries kept), the rendered table into ``fragments/batch_rate.md``, which
docs/tuning-control-path.md includes (bench/fragments.py renders it from results.json too).

One ``batchd serve`` process (bench/fixtures/server_proc.py), 2 workers, Fashion-MNIST's test split
without a pipeline (the workers are never the bottleneck), shared memory, one epoch read first to
warm up. A ``RemoteDataLoader`` in this process reads ``batches`` batches; the loop sleeps
``1 / rate`` seconds after each (no CPU of its own; rate 0: no sleep, as fast as the loader goes).
CPU per batch: this process's (``time.process_time``: the trainer, every thread of the client)
and the server main process's (``/proc/PID/task/*/schedstat``; workers are other processes).
Rates alternate between repeats; medians.

The work per batch is the same at every rate (one message each way, the same Python code on both
sides), so a difference is what a thread woken after an idle gap pays over one that ran a moment
ago: caches and branch predictors gone cold, the scheduler's wake-up. A fixed count of thread
hand-offs per batch, not the work in them, sets the trainer's CPU at training rates (the figures:
``fragments/batch_rate.md``).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import batchd
from bench import ROOT, fragments, noise
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds
from bench.report import md_table

FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")

NAME = "batch_rate"
TITLE = "Batch-rate probe: CPU per batch against the loop's batch rate (shared memory, 2 workers)"


def measure(address: str, server_pid: int, batch_size: int, batches: int, rate: float, seed: int) -> tuple[float, float]:
    """(trainer, server main process) CPU seconds per batch over ``batches`` batches read at ``rate``
    batches per second (0: as fast as they come)."""
    with batchd.RemoteDataLoader(address, "f", batch_size=batch_size, shuffle=True, seed=seed, transport="shm") as ld:
        it = iter(ld)
        next(it)
        c0, s0 = time.process_time(), cpu_seconds(server_pid)
        for _ in range(batches):
            next(it)
            if rate:
                time.sleep(1 / rate)
        c1, s1 = time.process_time(), cpu_seconds(server_pid)
        it.close()
    return (c1 - c0) / batches, (s1 - s0) / batches


def run(batch_size: int = 50, batches: int = 150, rates=(0, 200, 100, 50, 20), repeats: int = 3) -> dict:
    """Measure every rate ``repeats`` times (alternating the order); the raw figures, as results.json
    keeps them: ``rows`` of {rate, trainer_s, server_s} (medians, CPU seconds per batch)."""
    results: dict[float, list[tuple[float, float]]] = {r: [] for r in rates}
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp, ServerProcess(
            datasets={"f": {"kind": "fashion-mnist", "root": str(FMNIST), "split": "test"}}, workers=2,
            cache_dir=tmp) as srv:
        measure(srv.address, srv.pid, batch_size, 10_000 // batch_size - 1, 0, 0)  # warm up
        for k in range(repeats):
            for rate in (rates if k % 2 == 0 else rates[::-1]):
                results[rate].append(measure(srv.address, srv.pid, batch_size, batches, rate, k))
    rows = [{"rate": rate, "trainer_s": statistics.median(x[0] for x in runs),
             "server_s": statistics.median(x[1] for x in runs)} for rate, runs in results.items()]
    return {"batch_size": batch_size, "batches": batches, "repeats": repeats, "rows": rows}


def render(r: dict) -> str:
    rows = r["rows"]
    first = "as fast as it goes" if not rows[0]["rate"] else f"{rows[0]['rate']:g}"
    table = md_table(["batches/s", "trainer ms", f"vs {first}", "server main ms", f"vs {first}"],
                     [["as fast as it goes" if not row["rate"] else f"{row['rate']:g}",
                       f"{row['trainer_s'] * 1e3:.2f}", f"{row['trainer_s'] / rows[0]['trainer_s']:.1f}x",
                       f"{row['server_s'] * 1e3:.2f}", f"{row['server_s'] / rows[0]['server_s']:.1f}x"]
                      for row in rows])
    return (f"{table}\n\nCPU per batch (ms) of the trainer (this process, every thread) and of the server's main "
            f"process; batch {r['batch_size']}, Fashion-MNIST's test split, no pipeline; {r['batches']} batches "
            f"per row, the loop sleeping 1 / rate after each; medians of {r['repeats']} alternated repeats.")


def targets(r: dict) -> list[dict]:
    """A probe checks no target: it shows a trend (tables' targets: bench/report.py)."""
    return []


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--batches", type=int, default=150, help="measured batches per row and repeat (at most 199)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0, 200, 100, 50, 20])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results",
                    help="results folder: results.json and fragments/ (default bench/results)")
    args = ap.parse_args(argv)
    meter = noise.NoiseMeter()
    meter.start()
    t0 = time.perf_counter()
    r = run(args.batch_size, args.batches, args.rates, args.repeats)
    seconds = time.perf_counter() - t0
    meter.stop()
    folder = fragments.keep_probe(args.out, NAME, r, seconds=seconds, foreign_cpu_s=meter.seconds())
    print(render(r))
    print(f"\nwrote {args.out / 'results.json'} and {folder / (NAME + '.md')}")


if __name__ == "__main__":
    main()
