"""Table 17: every server at full speed. Servers of unequal speed, a sidecar beside a slow pool, stalled and hung servers.

    python -m bench.tables.table_fullspeed [--quick] [--repeats N]

``batchd serve`` processes (bench/fixtures/server_proc.py) with a sleep-bound operator pipeline
(tests/pydata/batchd_testdata.py ``paced``: a fixed sleep per sample, the sample unchanged), so
each server's speed is set by its config and several run on 2 cores: the figures measure how the
loader spreads the work (client/iteration/credit.py: credit sized by each server's own
capacity, the lowest batch to whoever delivers it soonest, a stalled server's batches granted to
the others at once, first copy wins), not the machine. Samples are ``Paced``'s (4 x 4 pixels:
nothing to copy). One ``RemoteDataLoader`` reads epoch after epoch as fast as it can (no
training step).

1. **Throughput**, images/s over a timed window after an untimed warm-up (both in seconds): each
   server alone, their sum, and all of them in one loader. Servers of one worker: two of 128 and
   47 img/s, three (128, 47, 80), and a same-host sidecar over shared memory plus a server whose
   /dev/shm the client cannot see (its own mount namespace, ``unshare -m``: its batches travel
   over TCP, the data plane, as from another host; both over TCP where ``unshare -m`` is not
   allowed). Then issue 36's case, **a fast sidecar beside a slow 4-worker pool**: a 1-worker
   sidecar at 8 ms per batch (shared memory) and a 4-worker pool at 200 ms per batch per worker
   (50 ms per batch alone), and at 800 ms per batch per worker (200 ms per batch alone; the issue's
   "8 ms and 200 ms per batch"), over TCP as above: each alone and together in every run, the
   ratio together / (sum of each alone) per run; the target is >= 0.9x in every one of the runs.
   Rounds rotate which measurement goes first.
2. **A hung server**: one of two servers (1 worker each, and 4 workers each) is stopped for good
   (SIGSTOP at the 30th batch of an epoch, not resumed until the loader is closed), ``timeout=20``:
   the wait of every batch of that epoch and the next (the time ``__next__`` took): max and p99;
   whether every sample of both epochs came exactly once; the loader's ``stalls`` and the hung
   server's ``regranted`` batches.
3. **A stalled server**: one of two, and one of three, equal servers (1 worker, 50 batches/s each)
   is stopped (SIGSTOP) 2 s of every 3 s from the epoch's first batch, ``hedge=False`` (a stalled
   server is waited for) against ``hedge=True`` (the default: its batches are granted to the
   others at its own deadline), alternated. Batch wait p50, p99 and max over every batch of the
   window; the batches' positions are checked to be the epoch's, in order, each once; extra grants:
   batch indices granted beyond one per batch yielded (``StatsTotals.batches_granted``: the
   stalled server's regrants and the grants at either end), an upper bound of the extra work (a
   revoked grant not yet started is never built).
"""

from __future__ import annotations

import contextlib
import sys
import time

from bench import common, noise
from bench.fixtures.server_proc import ServerProcess, private_shm_available
from bench.measure import median
from bench.report import md_table
from bench.tables.fullspeed_faults import (HUNG_AT, HUNG_N, HUNG_SECONDS, HUNG_TIMEOUT, PERIOD_S, STALL_BATCH,
                                           STALL_S, hung, stalled)
from bench.tables.fullspeed_servers import BATCH, _batches, _loader, server

NAME = "table17"
TITLE = ("Table 17: every server at full speed (sleep-bound servers; unequal speeds, a sidecar beside a slow pool, "
         "a hung and a stalled server)")
SPEEDS = {"A": 128.0, "B": 47.0, "C": 80.0}  # images/s of each 1-worker server alone
POOL_BATCH = 4  # sidecar and pool
SIDECAR_BATCH_S = 0.008  # the sidecar's seconds per batch (1 worker)
POOL_WORKERS = 4
POOL_BATCH_S = (0.2, 0.8)  # the pool's seconds per batch per worker (alone: / 4 per batch)
RATIO_TARGET = 0.9
TIMEOUT_S = 2400  # run_all's hang guard for this table


def images_per_second(addresses, warmup_s: float, timed_s: float, **kw) -> dict:
    """One loader over ``addresses``: images/s over ``timed_s`` seconds after ``warmup_s`` untimed
    (from the first batch), and each server's share of the timed window's batches."""
    with _loader(addresses, **kw) as ld:
        batch = ld.batch_size
        it = _batches(ld)
        next(it)
        start = time.perf_counter()
        end, warm = start + warmup_s, 0
        while time.perf_counter() < end:
            next(it)
            warm += 1
        warm_rate = warm * batch / (time.perf_counter() - start)
        before = dict(ld.stats()["batches_per_server"])
        t0 = time.perf_counter()
        end, n = t0 + timed_s, 0
        while True:
            next(it)
            n += 1
            if time.perf_counter() >= end:
                break
        seconds = time.perf_counter() - t0
        after = ld.stats()["batches_per_server"]
        it.close()
    got = {a: after.get(a, 0) - before.get(a, 0) for a in addresses}
    return {"rate": n * batch / seconds, "batches": n, "warm_rate": warm_rate,
            "shares": {a: got[a] / max(1, sum(got.values())) for a in addresses}}


def _throughput(groups: dict, repeats: int, warmup_s: float, timed_s: float, log) -> dict:
    """Each group of (servers, batch, transport): each server alone and all in one loader, per
    round, the measurements rotated between rounds."""
    out = {}
    for name, (group, batch, transport) in groups.items():
        runs = []
        for rep in range(repeats):
            cases = [(p.address,) for p in group] + [tuple(p.address for p in group)]
            k = rep % len(cases)
            rates, warm, shares = {}, {}, {}
            for case in cases[k:] + cases[:k]:
                m = noise.measure(lambda: images_per_second(list(case), warmup_s, timed_s, batch_size=batch,
                                                            transport=transport))
                rates[case], warm[case] = m["rate"], m["warm_rate"]
                if len(case) > 1:
                    shares = m["shares"]
            alone = [rates[(p.address,)] for p in group]
            together = rates[tuple(p.address for p in group)]
            warm_sum = sum(warm[(p.address,)] for p in group)
            runs.append({"alone": alone, "together": together, "sum": sum(alone), "ratio": together / sum(alone),
                         "shares": [shares.get(p.address, 0.0) for p in group],
                         "warm_ratio": warm[tuple(p.address for p in group)] / warm_sum})
            log(f"  {NAME}: {name} round {rep + 1}/{repeats}: alone {', '.join(f'{x:.0f}' for x in alone)}, "
                f"together {together:.0f} img/s ({together / sum(alone):.2f}x the sum)")
        out[name] = {"runs": runs, "batch": batch, "transport": transport,
                     "alone": [median(r["alone"][i] for r in runs) for i in range(len(group))],
                     "together": median(r["together"] for r in runs), "sum": median(r["sum"] for r in runs),
                     "ratio": median(r["ratio"] for r in runs),
                     "shares": [median(r["shares"][i] for r in runs) for i in range(len(group))]}
    return out


@contextlib.contextmanager
def running(procs: list[ServerProcess]):
    try:
        for p in procs:
            p.start()
        yield procs
    finally:
        for p in procs:
            p.stop()


def run(s, log=print) -> dict:
    # the warm-up: until a server's first batches arrive, its build time is taken as 0.1 s
    # (client/iteration/holder.py DEFAULT_BUILD_S), so a slow pool looks stalled at first
    warmup_s, timed_s = s.pick(5.0, 3.0), s.pick(10.0, 4.0)
    stall_s = s.pick(15.0, 9.0)
    private = private_shm_available()
    remote_transport = "auto" if private else "socket"  # the sidecar over shm, the other over TCP; else both TCP
    r: dict = {"throughput": {}, "pool": {}, "hung": {}, "stalls": {}, "warmup_s": warmup_s, "timed_s": timed_s,
               "stall_s": stall_s, "repeats": s.repeats, "private_shm": private}
    a, b, c = (server(1.0 / SPEEDS[k]) for k in "ABC")
    sidecar, remote = server(1.0 / SPEEDS["A"]), server(1.0 / SPEEDS["B"], private_shm=private)
    with running([a, b, c, sidecar, remote]):
        groups = {"2 servers (128 + 47 img/s)": ([a, b], BATCH, "auto"),
                  "3 servers (128 + 47 + 80 img/s)": ([a, b, c], BATCH, "auto"),
                  "sidecar over shm + TCP server (128 + 47 img/s)": ([sidecar, remote], BATCH, remote_transport)}
        r["throughput"] = _throughput(groups, s.repeats, warmup_s, timed_s, log)
    side = server(SIDECAR_BATCH_S / POOL_BATCH)
    pools = {t: server(t / POOL_BATCH, POOL_WORKERS, private_shm=private) for t in POOL_BATCH_S}
    with running([side, *pools.values()]):
        groups = {f"sidecar (1 worker, {SIDECAR_BATCH_S * 1e3:.0f} ms per batch) + pool ({POOL_WORKERS} workers, "
                  f"{t * 1e3:.0f} ms per batch per worker)": ([side, pool], POOL_BATCH, remote_transport)
                  for t, pool in pools.items()}
        r["pool"] = _throughput(groups, s.repeats, warmup_s, timed_s, log)
    for workers in (1, 4):
        with running([server(HUNG_SECONDS, workers, n=HUNG_N) for _ in range(2)]) as pair:
            runs = []
            for rep in range(s.repeats):
                m = hung(pair)
                runs.append(m)
                log(f"  {NAME}: 1 of 2 servers ({workers} workers) hung: max wait {m['max'] * 1e3:.0f} ms, p99 "
                    f"{m['p99'] * 1e3:.0f} ms, samples once: {m['once']}, close {m['close_s']:.2f} s")
            r["hung"][f"1 of 2 servers ({workers} worker{'s' if workers > 1 else ''} each) hung for good"] = runs
    with running([server(1.0 / (50.0 * STALL_BATCH)) for _ in range(3)]) as equal:
        for n in (2, 3):
            rows: dict[str, list] = {}
            for rep in range(s.repeats):
                modes = (False, True) if rep % 2 == 0 else (True, False)
                for hedge in modes:
                    mode = f"hedge={hedge}"
                    m = noise.measure(lambda: stalled(equal[:n], stall_s, hedge))
                    rows.setdefault(mode, []).append(m)
                    log(f"  {NAME}: 1 of {n} stalled, {mode}: p99 {m['p99'] * 1e3:.0f} ms, max {m['max'] * 1e3:.0f} ms")
            r["stalls"][f"1 of {n} servers stalled"] = {
                mode: {k: median(m[k] for m in ms) for k in ("p50", "p99", "max", "waited", "rate")}
                | {k: sum(m[k] for m in ms) for k in ("batches", "stops", "extra", "stalls", "regranted", "duplicates")}
                | {"once": all(m["once"] for m in ms), "p99s": [m["p99"] for m in ms]}
                for mode, ms in sorted(rows.items())}
    return r


def _shares(xs) -> str:
    return ", ".join(f"{x:.0%}" for x in xs)


def render(r: dict) -> str:
    head = ["servers", "alone, each (img/s)", "sum", "one loader", "one loader / sum", "shares in one loader"]
    rows = [[name, ", ".join(f"{x:.0f}" for x in t["alone"]), f"{t['sum']:.0f}", f"{t['together']:.0f}",
             f"{t['ratio']:.2f}x", _shares(t["shares"])] for name, t in r["throughput"].items()]
    out = md_table(head, rows)
    out += (f"\n\nServers of one worker, batch {BATCH}; medians of {r['repeats']} rounds (each server alone and the "
            f"loader over all of them in every round, rotated). Shares: of the timed window's batches.")
    head = ["sidecar + pool", "run", "sidecar alone (img/s)", "pool alone", "sum", "together", "together / sum",
            "shares (sidecar, pool)", "pool's share alone", "warm-up: together / sum"]
    rows = []
    for name, t in r["pool"].items():
        for k, run in enumerate(t["runs"]):
            rows.append([name if k == 0 else "", k + 1, f"{run['alone'][0]:.0f}", f"{run['alone'][1]:.0f}",
                         f"{run['sum']:.0f}", f"{run['together']:.0f}", f"{run['ratio']:.2f}x",
                         _shares(run["shares"]), f"{run['alone'][1] / run['sum']:.0%}", f"{run['warm_ratio']:.2f}x"])
    out += "\n\n**A fast sidecar beside a slow pool** (issue 36)\n\n" + md_table(head, rows)
    out += (f"\n\nBatch {POOL_BATCH}; the sidecar over shared memory, the pool over TCP"
            + (" (its own /dev/shm: `unshare -m`)" if r["private_shm"] else " (both over TCP: `unshare -m` is not "
               "allowed here)")
            + f"; each run measures each alone and both together (rotated), {r['warmup_s']:g} s untimed then "
            f"{r['timed_s']:g} s timed each. \"pool's share alone\": the pool's rate alone over the sum, the share it "
            f"would have if the loader used all of both. Warm-up: the same ratio over the untimed first "
            f"{r['warmup_s']:g} s from the first batch, while the pool's build time is not yet known (taken as 0.1 s "
            f"until its batches say otherwise, so it is first judged stalled).")
    head = ["hung server", "run", "max wait", "p99 wait", "batches timed", "each sample once", "stalls",
            "regranted from the hung server", "close()"]
    rows = []
    for name, runs in r["hung"].items():
        for k, m in enumerate(runs):
            rows.append([name if k == 0 else "", k + 1, f"{m['max'] * 1e3:.0f} ms", f"{m['p99'] * 1e3:.0f} ms",
                         m["batches"], "yes" if m["once"] else "**no**", m["stalls"], m["regranted"],
                         f"{m['close_s']:.2f} s"])
    out += "\n\n**A server hung for good**\n\n" + md_table(head, rows)
    out += (f"\n\nTwo servers, {HUNG_SECONDS * 1e3:g} ms per sample, batch {STALL_BATCH}, {HUNG_N} samples per epoch, "
            f"bytes inline, `timeout={HUNG_TIMEOUT:g}`: one untimed epoch, then the second server stopped (SIGSTOP) at "
            f"batch {HUNG_AT} of the next one and not resumed until the loader closed; the waits of that epoch and the "
            f"one after it. Each sample once: the sorted indices of every epoch are exactly 0..{HUNG_N - 1}.")
    head = ["stall", "loader", "batch wait p50", "p99", "max", "images/s", "stops", "stalls", "regranted",
            "duplicates", "extra grants", "in order, each once"]
    rows = []
    for name, modes in r["stalls"].items():
        for mode, m in modes.items():
            ms = lambda v: f"{v * 1e3:.0f} ms"  # noqa: E731
            rows.append([name, mode, ms(m["p50"]), ms(m["p99"]), ms(m["max"]), f"{m['rate']:.0f}", m["stops"],
                         m["stalls"], m["regranted"], m["duplicates"],
                         f"{m['extra']} of {m['batches']} ({m['extra'] / max(1, m['batches']):.1%})",
                         "yes" if m["once"] else "**no**"])
    out += "\n\n**A stalled server**\n\n" + md_table(head, rows)
    out += (f"\n\nEqual servers of one worker, batch {STALL_BATCH} (50 batches/s each), bytes inline; the last one "
            f"stopped {STALL_S:g} s every {PERIOD_S:g} s from the first batch of the timed epoch, {r['stall_s']:g} s "
            f"timed per measurement; hedge=False and hedge=True alternated. Medians of {r['repeats']} repeats (stops, "
            "stalls, regranted, duplicates, extra grants: sums). Extra grants: batch indices granted beyond one per "
            "batch yielded, the grants ahead of the loop at the window's end included: an upper bound of the extra "
            "work (which is at most the regranted batches and at least the duplicates). In order, each once: the "
            "batches' positions are 0, 1, 2, ... of the epoch and no sample index repeats. With hedge=False the "
            "batches a stopped server holds wait until it resumes (the max: about the stall); the p99 shows them "
            "where they are more than 1% of the batches.")
    return out


def targets(r: dict) -> list[dict]:
    out = []
    for name, t in r["throughput"].items():
        out.append({"name": f"{name}: one loader >= {RATIO_TARGET:g}x the sum of each alone",
                    "passed": t["ratio"] >= RATIO_TARGET,
                    "detail": f"{t['ratio']:.2f}x ({t['together']:.0f} of {t['sum']:.0f} img/s)"})
    for name, t in r["pool"].items():
        ratios = [run["ratio"] for run in t["runs"]]
        out.append({"name": f"{name}: together >= {RATIO_TARGET:g}x the sum of each alone in every run",
                    "passed": all(x >= RATIO_TARGET for x in ratios),
                    "detail": f"{sum(x >= RATIO_TARGET for x in ratios)} of {len(ratios)} runs: "
                              + ", ".join(f"{x:.2f}x" for x in ratios)})
    for name, runs in r["hung"].items():
        out.append({"name": f"{name} (timeout={HUNG_TIMEOUT:g}): every epoch completes, each sample once, longest "
                            "wait < 1 s", "passed": all(m["once"] and m["max"] < 1.0 for m in runs),
                    "detail": "max " + ", ".join(f"{m['max'] * 1e3:.0f}" for m in runs) + " ms; p99 "
                              + ", ".join(f"{m['p99'] * 1e3:.0f}" for m in runs) + " ms; samples once in "
                              f"{sum(m['once'] for m in runs)} of {len(runs)} runs"})
    for name, modes in r["stalls"].items():
        on, off = modes["hedge=True"], modes["hedge=False"]
        out.append({"name": f"{name} 2 s in every 3 s: p99 wait < 0.5 s, every sample once (hedge=True)",
                    "passed": on["p99"] < 0.5 and on["once"],
                    "detail": f"p99 {on['p99'] * 1e3:.0f} ms, max {on['max'] * 1e3:.0f} ms (hedge=False: p99 "
                              f"{off['p99'] * 1e3:.0f} ms, max {off['max'] * 1e3:.0f} ms); "
                              f"{on['extra']} extra grants of {on['batches']} batches"})
    return out


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv)


if __name__ == "__main__":
    sys.exit(main())
