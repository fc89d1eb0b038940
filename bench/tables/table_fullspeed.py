"""Table 17: every server at full speed. Servers of unequal speed, a stalled server, a sidecar.

    python -m bench.tables.table_fullspeed [--quick] [--repeats N]

``batchd serve`` processes (bench/fixtures/server_proc.py) with one worker each and a sleep-bound operator
pipeline (tests/pydata/batchd_testdata.py ``paced``: a fixed sleep per sample, the sample
unchanged), so each server's speed is set by its config and several run on 2 cores: the figures
measure how the loader spreads the work, not the machine. Samples are ``Paced``'s (4 x 4 pixels:
nothing to copy). One ``RemoteDataLoader`` reads epoch after epoch as fast as it can (no
training step), after an untimed warm-up.

1. **Throughput**, images/s: each server alone, their sum, and all of them in one loader with
   the old static split (``assignment="stride"``: server i builds every n-th batch) and with
   dynamic assignment (the default: batches go to whichever server has room,
   client/assign.py). Two servers of 128 and 47 img/s (the issue's measurement on main), three
   servers (128, 47, 80), and a same-host sidecar over shared memory plus a server whose
   /dev/shm the client cannot see (its own mount namespace: its batches travel over TCP, as from
   another host; skipped where ``unshare -m`` is not allowed).
2. **A stalled server**: one of two, and one of three, equal servers (50 batches/s each) is
   stopped (SIGSTOP) 2 s of every 3 s. The batch wait is the time ``__next__`` took; p50, p99
   and max over the timed batches; extra grants: batch indices granted beyond one per batch
   yielded (StatsTotals.batches_granted; hedges and the lookahead at either end), an upper
   bound of the extra work (a revoked grant not yet started is never built).
"""

from __future__ import annotations

import itertools
import sys
import time

import numpy as np

import batchd
from batchd.client.transport.server_stats import get_stats
from bench import ROOT, common, noise
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess, private_shm_available
from bench.measure import median
from bench.report import md_table
from tests.stalls import Stalls

NAME = "table17"
TITLE = "Table 17: every server at full speed (sleep-bound servers of 1 worker, batches go to whoever has room)"
PYDATA = ROOT / "tests" / "pydata"
N = 200_000  # samples of the Paced dataset (never read to the end in a measurement)
BATCH = 8  # throughput rows
STALL_BATCH = 4  # stall rows: 4 x 5 ms = 20 ms a batch, 50 batches/s per server
SPEEDS = {"A": 128.0, "B": 47.0, "C": 80.0}  # images/s of each server alone
STALL_S, PERIOD_S = 2.0, 3.0
TIMEOUT_S = 2400  # run_all's hang guard for this table (it runs the slow servers alone, repeatedly)


def server(speed: float, *, private_shm: bool = False) -> ServerProcess:
    """A server of one worker whose pipeline "pace" takes 1 / speed seconds per sample."""
    return ServerProcess(
        datasets={"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": N}}},
        pipelines={"pace": {"python": "batchd_testdata:paced", "args": {"seconds": 1.0 / speed}}},
        workers=1, cache_dir=data.CACHE, extra={"python_path": [str(PYDATA)]}, private_shm=private_shm)


def _batches(loader):
    for epoch in itertools.count():
        loader.set_epoch(epoch)
        yield from loader


_seeds = itertools.count(1)


def _loader(addresses, **kw) -> batchd.RemoteDataLoader:
    kw = {"batch_size": BATCH, "shuffle": True, "seed": next(_seeds), "transform": "pace", "timeout": 300,
          "probe_interval": 60, "failover_timeout": 30, **kw}
    return batchd.RemoteDataLoader(addresses, "paced", **kw)


def images_per_second(addresses, warmup: int, timed: int, **kw) -> dict:
    with _loader(addresses, **kw) as ld:
        it = _batches(ld)
        for _ in range(warmup):
            next(it)
        t0 = time.perf_counter()
        for _ in range(timed):
            next(it)
        seconds = time.perf_counter() - t0
        shares = {a: s["share"] for a, s in ld.stats()["servers"].items()}
        it.close()
    return {"rate": timed * BATCH / seconds, "shares": shares}


def stalled(servers: list[ServerProcess], seconds: float, **kw) -> dict:
    addresses = [s.address for s in servers]
    with _loader(addresses, batch_size=STALL_BATCH, **kw) as ld:
        it = _batches(ld)
        for _ in range(50):
            next(it)
        granted = sum(get_stats(a).totals.batches_granted for a in addresses)
        waits = []
        with Stalls(servers[-1].pid, STALL_S, PERIOD_S) as stalls:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                next(it)
                waits.append(time.perf_counter() - t0)
        figures = ld.stats()
        it.close()
    extra = sum(get_stats(a).totals.batches_granted for a in addresses) - granted - len(waits)
    w = np.array(waits)
    p50, p99 = (float(v) for v in np.percentile(w, (50, 99)))
    return {"p50": p50, "p99": p99, "max": float(w.max()), "batches": len(w), "stops": stalls.stops,
            "extra": max(0, extra), "hedges": figures["hedges_issued"], "rate": len(w) * STALL_BATCH / seconds}


def run(s, log=print) -> dict:
    warmup, timed = s.pick(30, 20), s.pick(240, 120)  # (full: about 15 minutes, the slow server alone the most)
    stall_s = s.pick(15.0, 9.0)
    r: dict = {"throughput": {}, "stalls": {}, "warmup": warmup, "timed": timed, "stall_s": stall_s,
               "repeats": s.repeats}
    procs: list[ServerProcess] = []
    try:
        a, b, c = (server(SPEEDS[k]) for k in "ABC")
        procs += [a, b, c]
        sidecar, remote = server(SPEEDS["A"]), None
        procs.append(sidecar)
        if private_shm_available():
            remote = server(SPEEDS["B"], private_shm=True)
            procs.append(remote)
        equal = [server(50.0 * STALL_BATCH) for _ in range(3)]
        procs += equal
        for p in procs:
            p.start()
        groups = {"2 servers (128 + 47 img/s)": [a, b], "3 servers (128 + 47 + 80 img/s)": [a, b, c]}
        if remote is not None:
            groups["sidecar over shm + TCP server (128 + 47 img/s)"] = [sidecar, remote]
        for name, group in groups.items():
            rows = {}
            for rep in range(s.repeats):
                for p in group:
                    m = noise.measure(lambda: images_per_second([p.address], warmup, timed, transport="auto"))
                    rows.setdefault(p.address, []).append(m["rate"])
                for mode in ("stride", "dynamic"):
                    if mode == "stride" and "sidecar" in name:
                        continue
                    m = noise.measure(lambda: images_per_second([p.address for p in group], warmup, timed,
                                                                transport="auto", assignment=mode, hedge=False))
                    rows.setdefault(mode, []).append(m["rate"])
                    rows.setdefault(mode + " shares", []).append(m["shares"])
                log(f"  {NAME}: {name} repeat {rep + 1}/{s.repeats}: dynamic {rows['dynamic'][-1]:.0f} img/s")
            alone = [median(rows[p.address]) for p in group]
            r["throughput"][name] = {
                "alone": alone, "sum": sum(alone), "stride": median(rows["stride"]) if "stride" in rows else None,
                "dynamic": median(rows["dynamic"]),
                "shares": [rows["dynamic shares"][-1].get(p.address, 0.0) for p in group]}
        for n in (2, 3):
            group = equal[:n]
            rows = {}
            for rep in range(s.repeats):
                for mode, kw in (("stride, no hedging", {"assignment": "stride", "hedge": False}),
                                 ("dynamic, no hedging", {"hedge": False}), ("dynamic, hedging", {})):
                    m = stalled(group, stall_s, transport="inline", **kw)
                    rows.setdefault(mode, []).append(m)
                    log(f"  {NAME}: 1 of {n} stalled, {mode}: p99 {m['p99'] * 1e3:.0f} ms, max {m['max'] * 1e3:.0f} ms")
            r["stalls"][f"1 of {n} servers stalled"] = {
                mode: {k: median(m[k] for m in ms) for k in ("p50", "p99", "max", "rate")}
                | {k: sum(m[k] for m in ms) for k in ("batches", "stops", "extra", "hedges")}
                for mode, ms in rows.items()}
    finally:
        for p in procs:
            p.stop()
    r["sidecar_skipped"] = remote is None
    return r


def render(r: dict) -> str:
    head = ["servers", "alone, each (img/s)", "sum", "static split (stride)", "dynamic", "dynamic / sum",
            "stride / sum", "dynamic shares"]
    rows = []
    for name, t in r["throughput"].items():
        stride = t["stride"]
        rows.append([name, ", ".join(f"{x:.0f}" for x in t["alone"]), f"{t['sum']:.0f}",
                     "-" if stride is None else f"{stride:.0f}", f"{t['dynamic']:.0f}",
                     f"{t['dynamic'] / t['sum']:.2f}x", "-" if stride is None else f"{stride / t['sum']:.2f}x",
                     ", ".join(f"{x:.0%}" for x in t["shares"])])
    out = md_table(head, rows)
    head = ["stall", "loader", "batch wait p50", "p99", "max", "images/s", "stops", "hedges", "extra grants"]
    rows = []
    for name, modes in r["stalls"].items():
        for mode, m in modes.items():
            ms = lambda v: f"{v * 1e3:.0f} ms"  # noqa: E731
            rows.append([name, mode, ms(m["p50"]), ms(m["p99"]), ms(m["max"]), f"{m['rate']:.0f}", m["stops"],
                         m["hedges"], f"{m['extra']} of {m['batches']} ({m['extra'] / max(1, m['batches']):.1%})"])
    out += "\n\n" + md_table(head, rows)
    out += (f"\n\nServers of one worker with a sleep-bound pipeline (tests/pydata `paced`), batch {BATCH} (stall rows: "
            f"{STALL_BATCH}, 50 batches/s per server); {r['warmup']} batches untimed, then {r['timed']} timed per "
            f"throughput measurement; stall measurements {r['stall_s']:g} s each, one server stopped {STALL_S:g} s "
            f"every {PERIOD_S:g} s. Medians of {r['repeats']} repeats (stops, hedges, extra grants: sums). "
            "Extra grants: batch indices granted beyond one per batch yielded, an upper bound of the extra work."
            + (" The sidecar row was skipped: `unshare -m` is not allowed here." if r["sidecar_skipped"] else
               " The TCP server runs with a /dev/shm of its own (unshare -m): its batches come over TCP (the data plane)."))
    return out


def targets(r: dict) -> list[dict]:
    out = []
    for name, t in r["throughput"].items():
        ratio = t["dynamic"] / t["sum"]
        out.append({"name": f"{name}: dynamic >= 0.9x the sum of each alone", "passed": ratio >= 0.9,
                    "detail": f"{ratio:.2f}x ({t['dynamic']:.0f} of {t['sum']:.0f} img/s"
                              + (f"; stride {t['stride'] / t['sum']:.2f}x)" if t["stride"] else ")")})
    for name, modes in r["stalls"].items():
        m = modes["dynamic, hedging"]
        out.append({"name": f"{name}: p99 wait < 0.5 s with <= 10% extra work", "passed": m["p99"] < 0.5
                    and m["extra"] <= 0.1 * m["batches"],
                    "detail": f"p99 {m['p99'] * 1e3:.0f} ms (stride, no hedging: "
                              f"{modes['stride, no hedging']['p99'] * 1e3:.0f} ms); "
                              f"{m['extra']} extra grants of {m['batches']} batches"})
    return out


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
