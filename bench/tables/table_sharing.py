"""Table 7: one loader, several experiments (photo dataset, L3, batch 64, 2 workers).

    python -m bench.tables.table_sharing [--quick] [--repeats N]

Clients are separate processes (``python -m bench.tables.table_sharing --client ...``): each imports
torch, connects, reads one batch, then waits for a "go" line on stdin, so that the clients of
a scenario start together and import time is never timed. Each reads the rest of one epoch
and prints its images/s. Server CPU seconds (server + forkserver + workers, utime + stime) are
read over the same window. Scenarios:

* solo: one client alone (the reference);
* identical: two clients with the same request: one computation feeds both;
* different: two clients with different pipelines (L3 and L2): the workers are shared round robin;
* fast + slow: two identical clients, one sleeping 0.25 s per batch: it falls out of the
  sharing window and gets its batches recomputed; the fast one must not wait for it.

Targets (issue "One loader, many experiments"): identical: each >= 0.9x solo images/s and server
CPU <= 1.15x solo; different: each >= 0.4x solo and faster <= 1.5x slower; fast + slow: the fast
one >= 0.9x solo.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import common, module_argv, module_env
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, tree_cpu_seconds
from bench.report import md_table

NAME = "table7"
TITLE = "Table 7: one loader, several experiments (L3, batch 64, 2 workers, clients in separate processes)"
BATCH = 64
WORKERS = 2


def client_main(args: argparse.Namespace) -> int:
    import batchd

    loader = batchd.RemoteDataLoader(args.address, "photos", batch_size=BATCH, shuffle=True, seed=args.seed,
                                     drop_last=True, transform=args.pipeline, prefetch=2 * WORKERS, timeout=300)
    it = iter(loader)
    next(it)  # connected, stream open, first batch here
    print("ready", flush=True)
    sys.stdin.readline()
    t0 = time.perf_counter()
    images = 0
    for batch in it:
        images += batch["image"].shape[0]
        del batch
        if args.sleep:
            time.sleep(args.sleep)
    seconds = time.perf_counter() - t0
    print(json.dumps({"images": images, "seconds": seconds, "rate": images / seconds}), flush=True)
    loader.close()
    return 0


def _clients(address: str, specs: list[dict], server_pid: int) -> tuple[list[dict], float]:
    """Run one client process per spec together; returns their results and the server's CPU seconds."""
    procs = []
    for spec in specs:
        cmd = module_argv("bench.tables.table_sharing", "--client", "--address", address, "--pipeline", spec["pipeline"],
                          "--seed", str(spec["seed"]), "--sleep", str(spec.get("sleep", 0.0)))
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=module_env(dict(os.environ, OMP_NUM_THREADS="1"))))
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"client did not start: {line!r} (exit {p.poll()})")
    cpu0 = tree_cpu_seconds(server_pid)
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results, tree_cpu_seconds(server_pid) - cpu0


def run(s, log=print) -> dict:
    data.ensure_photos()
    presets = pipelines.presets(("L2", "L3"))
    scenarios = {
        "solo": [{"pipeline": "L3"}],
        "identical": [{"pipeline": "L3"}, {"pipeline": "L3"}],
        "different": [{"pipeline": "L3"}, {"pipeline": "L2"}],
        "fast + slow": [{"pipeline": "L3"}, {"pipeline": "L3", "sleep": 0.25}],
    }
    raw: dict = {name: {"rates": [[] for _ in specs], "cpu": []} for name, specs in scenarios.items()}
    with ServerProcess(datasets=common.server_datasets(photos=common.photos_config()), pipelines=presets,
                       workers=WORKERS, cache_dir=data.CACHE, extra={"share_window": 16}) as server:
        for r in range(s.repeats):
            for i, (name, specs) in enumerate(scenarios.items()):  # interleaved: every scenario once per repeat
                seed = 100 * r + i  # a fresh request each time: nothing is left over from earlier runs
                results, cpu = _clients(server.address, [dict(spec, seed=seed) for spec in specs], server.pid)
                for k, res in enumerate(results):
                    raw[name]["rates"][k].append(res["rate"])
                raw[name]["cpu"].append(cpu)
                log(f"  {NAME}: repeat {r + 1} {name}: " + ", ".join(f"{res['rate']:.0f}" for res in results)
                    + f" img/s, server CPU {cpu:.1f} s")
    return {"repeats": s.repeats,
            "scenarios": {name: {"rates": [median(x) for x in v["rates"]], "cpu": median(v["cpu"])}
                          for name, v in raw.items()}}


def targets(r: dict) -> list[dict]:
    res = r["scenarios"]
    solo, solo_cpu = res["solo"]["rates"][0], res["solo"]["cpu"]
    ident, diff, fs = res["identical"], res["different"], res["fast + slow"]
    rows = [
        ("2 identical clients: each >= 0.9x solo images/s", min(ident["rates"]) / solo, ">=", 0.9),
        ("2 identical clients: server CPU <= 1.15x solo", ident["cpu"] / solo_cpu, "<=", 1.15),
        ("2 different pipelines: each >= 0.4x solo images/s", min(diff["rates"]) / solo, ">=", 0.4),
        ("2 different pipelines: faster <= 1.5x slower", max(diff["rates"]) / min(diff["rates"]), "<=", 1.5),
        ("fast + slow identical clients: fast >= 0.9x solo images/s", fs["rates"][0] / solo, ">=", 0.9),
    ]
    return [{"passed": v >= limit if op == ">=" else v <= limit, "name": n, "detail": f"{v:.2f}x"}
            for n, v, op, limit in rows]


def render(r: dict) -> str:
    res = r["scenarios"]
    solo, solo_cpu = res["solo"]["rates"][0], res["solo"]["cpu"]
    rows = []
    for name, v in res.items():
        rates = v["rates"]
        rows.append([name, " / ".join(f"{x:.0f}" for x in rates), " / ".join(f"{x / solo:.2f}x" for x in rates),
                     f"{v['cpu']:.1f}", f"{v['cpu'] / solo_cpu:.2f}x"])
    table = md_table(["scenario", "images/s per client", "vs solo", "server CPU s (an epoch per client)", "vs solo"],
                     rows)
    return "\n".join([table, "", f"Median of {r['repeats']} interleaved repeats; each client reads one epoch of "
                      "the photo dataset (3,000 images) after its first batch. For 'identical', the CPU column "
                      "compares two epochs delivered with one; the slow client's rate is its own choice "
                      "(it sleeps 0.25 s per batch)."])


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--pipeline", default="L3", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sleep", type=float, default=0.0, help=argparse.SUPPRESS)


def main(argv=None) -> int:
    return common.table_or_client_main(sys.modules[__name__], argv, client_args=_client_args)


if __name__ == "__main__":
    sys.exit(main())
