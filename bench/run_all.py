"""Run batchd's benchmark suite: tables to stdout as they complete, then bench/results/.

    python -m bench.run_all                  # everything (about 75 minutes on a 2-core machine)
    python -m bench.run_all --quick          # a smoke run: fewer images and repeats (under 2 minutes)
    python -m bench.run_all --only table1,table3

Tables: table1 (workers x pipeline), table2 (batch size), table3 (overlap with training),
table4 (memory with a 10M-row manifest; alias: scale), table5 (per-batch profile and reduced
JPEG decoding; alias: profile), table6 (one loader over 1-3 servers; alias: scaleout), table7
(several experiments on one loader; alias: sharing), table8 (cost of per-sample random
streams; alias: seeding), table9 (images/s against storage latency through FUSE and S3; alias: latency), table10
(the decoded-sample cache over 3 epochs; alias: cache), table11 (what batching samples as dicts of
fields costs a worker; alias: collate), table12 (a stalled server's batches granted to the others, one of 3
servers stalling; alias: hedge), table13 (COCO detection with boxes and masks: batchd vs DataLoader, and loading time per
sample beside a training step; alias: detection), table14 (the cost of per-batch timings; alias:
timings), table15 (workers sized to demand vs fixed pools; alias: autoscale), table16 (CPU per batch of
the server's main process and the trainer, against DataLoader's main process; alias: control), table17
(servers of unequal speed, a fast sidecar beside a slow pool, a hung and a stalled server in one loader; alias:
fullspeed), table18 (trainer and server CPU per GB and images/s over the socket data plane, inline TCP and shared
memory; alias: network), table19 (a remote trainer's images/s while idle connections flood the data
port; alias: dataplane), table20 (RandomResizedCrop(224) + flip on large photos: region decoding against a
DataLoader and tf.data's decode_and_crop_jpeg, decoded pixels per image; alias: decode), table21 (weighted
and mixed epochs vs the plain epoch and vs DataLoader's WeightedRandomSampler; alias: sampling), table22 (the
client after issue 36: threads per loader, lines of code, the control path's CPU per batch measured from
outside; alias: client). Results:
``results.json`` (raw numbers; a run replaces the tables it ran and keeps the others), ``results.md`` (tables
and PASS/FAIL targets), ``throughput.png`` and ``latency.png`` (Table 9), and ``fragments/`` (the tables the docs include, bench/fragments.py)
in ``--out`` (default bench/results; for --quick, /tmp/batchd-bench-quick, so that a smoke run never
overwrites the real results).
"""

from __future__ import annotations

import argparse
import datetime
import faulthandler
import gc
import os
import pathlib
import sys
import time

from bench import ROOT, chart, fragments, machine, measure, noise, report
from bench.fixtures import data
from bench.settings import Settings
from bench.tables import (table_autoscale, table_batch, table_cache, table_client, table_collate, table_control,
                          table_dataplane, table_decode, table_detection, table_fullspeed, table_hedge, table_latency,
                          table_network, table_overlap, table_profile, table_sampling, table_scale, table_scaleout,
                          table_seeding, table_sharing, table_timings, table_workers)

MODULES = (table_workers, table_batch, table_overlap, table_scale, table_profile, table_scaleout, table_sharing,
           table_seeding, table_latency, table_cache, table_collate, table_hedge, table_detection, table_timings,
           table_autoscale, table_control, table_fullspeed, table_network, table_dataplane, table_decode,
           table_sampling, table_client)
ALIASES = {"workers": "table1", "batch": "table2", "overlap": "table3", "scale": "table4", "profile": "table5",
           "scaleout": "table6", "sharing": "table7", "seeding": "table8", "latency": "table9", "cache": "table10",
           "collate": "table11", "hedge": "table12", "detection": "table13", "timings": "table14",
           "autoscale": "table15", "control": "table16", "fullspeed": "table17", "network": "table18",
           "dataplane": "table19", "decode": "table20", "sampling": "table21", "client": "table22"}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--quick", action="store_true", help="fewer images and 1 repeat: a smoke run")
    p.add_argument("--only", default="", help="comma-separated tables: " + ", ".join(m.NAME for m in MODULES))
    p.add_argument("--repeats", type=int, help="repeats per measurement (default: 3; --quick: 1)")
    p.add_argument("--out", type=pathlib.Path, help="results folder (default: bench/results; --quick: /tmp/batchd-bench-quick)")
    args = p.parse_args(argv)
    names = {m.NAME for m in MODULES}
    wanted = [ALIASES.get(x.strip(), x.strip()) for x in args.only.split(",") if x.strip()]
    unknown = [x for x in wanted if x not in names]
    if unknown:
        p.error(f"unknown table(s) {unknown}; choose from {sorted(names)} (aliases {sorted(ALIASES)})")
    args.tables = [m for m in MODULES if not wanted or m.NAME in wanted]
    if args.repeats is not None and args.repeats < 1:
        p.error("--repeats must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    out = args.out or (pathlib.Path("/tmp/batchd-bench-quick") if args.quick else ROOT / "bench" / "results")
    settings = Settings(quick=args.quick, repeats=args.repeats or (1 if args.quick else 3), out_dir=out)
    measure.pin_threads()
    # Garbage collection runs only between measurements (bench/noise.py), as timeit does, so that a
    # collection's pause lands in no timed window. (The client's shared-memory lease finalizers are
    # safe inside a collection: they only queue the lease, client/transport/link.py ``freed``; a thread releases it.)
    gc.disable()
    start = time.perf_counter()
    info = machine.info()
    print(machine.render(info), flush=True)
    if any(getattr(m, "NEEDS_PHOTOS", True) for m in args.tables):  # (tables 13-14 read Fashion-MNIST only)
        data.ensure_photos()
    results = report.load(out)
    wall = {}
    meter = noise.NoiseMeter()
    meter.start()
    noise.configure(budget_s=2.0 if settings.quick else 30.0)
    for m in args.tables:
        print(f"\n== {m.TITLE} ==", flush=True)
        # a hang in a table prints every thread's stack and ends the run (servers die with us); the
        # tables ran before it are saved. Re-armed per table: a whole run takes about 75 minutes here.
        faulthandler.dump_traceback_later(300 if settings.quick else getattr(m, "TIMEOUT_S", 1200), exit=True)
        t0, n0 = time.perf_counter(), meter.seconds()
        r = m.run(settings, log=lambda msg: print(msg, flush=True))
        seconds = time.perf_counter() - t0
        r.update(run_at=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), quick=settings.quick,
                 seconds=seconds, foreign_cpu=(meter.seconds() - n0) / (seconds * (os.cpu_count() or 1)),
                 guard=noise.GUARD.take(), machine=fragments.machine_line(info))
        gc.collect()
        results[m.NAME] = r
        wall[m.NAME] = r["seconds"]
        print(m.render(r), flush=True)
        print(f"({report.noise_note(r)})", flush=True)
        for t in m.targets(r):
            print(report.target_line(t), flush=True)
        report.save(out, results)
        report.write(out, report.render(results, MODULES, machine.render(info), wall))
        chart.draw(results, out / "throughput.png")
        chart.draw_latency(results, out / "latency.png")
    meter.stop()
    wall["total"] = time.perf_counter() - start
    path = report.write(out, report.render(results, MODULES, machine.render(info), wall))
    # what the docs include (bench/fragments.py), from results.json as saved: its keys are sorted,
    # and a fragment must read the same as ``python -m bench.fragments`` makes it from that file
    folder = fragments.write(out, report.load(out), MODULES)
    if out.resolve() == (ROOT / "bench" / "results").resolve():
        fragments.sync_readme((folder / "headline.md").read_text())
    png = chart.draw(results, out / "throughput.png")
    latency_png = chart.draw_latency(results, out / "latency.png")
    print(f"\nwrote {path}" + (f" and {png}" if png else "") + (f" and {latency_png}" if latency_png else "")
          + f" in {wall['total']:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
