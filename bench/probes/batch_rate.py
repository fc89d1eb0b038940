"""CPU per batch against the batch rate: the same loader's work costs more per batch when batches
come slowly (issues 26 and 28).

    python -m bench.probes.batch_rate [--batch-size B] [--batches N] [--rates R ...] [--repeats K]

One ``batchd serve`` process (bench/fixtures/server_proc.py), 2 workers, Fashion-MNIST's test split
without a pipeline (the workers are never the bottleneck), shared memory, one epoch read first to
warm up. A ``RemoteDataLoader`` in this process reads ``batches`` batches; the loop sleeps
``1 / rate`` seconds after each (no CPU of its own; rate 0: no sleep, as fast as the loader goes).
CPU per batch: this process's (``time.process_time``: the trainer, every thread of the client)
and the server main process's (``/proc/PID/task/*/schedstat``; workers are other processes).
Rates alternate between repeats; medians.

The work per batch is the same at every rate (one message each way, the same Python code on both
sides), so a difference is what a thread woken after an idle gap pays over one that ran a moment
ago: caches and branch predictors gone cold, the scheduler's wake-up. On the 2-core VM of the
README it was 2-4x (2026-11-28): a fixed count of thread hand-offs per batch, not the work in
them, sets the trainer's CPU at training rates.
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import batchd
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds
from bench.report import md_table

FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")


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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch-size", type=int, default=50)
    ap.add_argument("--batches", type=int, default=150, help="measured batches per row and repeat (at most 199)")
    ap.add_argument("--rates", type=float, nargs="+", default=[0, 200, 100, 50, 20])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    results: dict[float, list[tuple[float, float]]] = {r: [] for r in args.rates}
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp, ServerProcess(
            datasets={"f": {"kind": "fashion-mnist", "root": str(FMNIST), "split": "test"}}, workers=2,
            cache_dir=tmp) as srv:
        measure(srv.address, srv.pid, args.batch_size, 10_000 // args.batch_size - 1, 0, 0)  # warm up
        for k in range(args.repeats):
            rates = args.rates if k % 2 == 0 else args.rates[::-1]
            for rate in rates:
                results[rate].append(measure(srv.address, srv.pid, args.batch_size, args.batches, rate, k))
    full = {side: statistics.median(x[side] for x in results[args.rates[0]]) for side in (0, 1)}
    rows = []
    for rate, runs in results.items():
        trainer, server = (statistics.median(x[side] for x in runs) for side in (0, 1))
        rows.append(["as fast as it goes" if not rate else f"{rate:g}", f"{trainer * 1e3:.2f}",
                     f"{trainer / full[0]:.1f}x", f"{server * 1e3:.2f}", f"{server / full[1]:.1f}x"])
    print(f"CPU per batch against the loop's batch rate (batch {args.batch_size}, Fashion-MNIST, shared memory, "
          f"{args.batches} batches, median of {args.repeats})\n")
    print(md_table(["batches/s", "trainer ms", f"vs {rows[0][0]}", "server main ms", f"vs {rows[0][0]}"], rows))


if __name__ == "__main__":
    main()
