"""Table 16: the control path. CPU per batch of the server's main process and of the trainer's process.

    python -m bench.tables.table_control [--quick] [--repeats N]

batchd keeps the pixels out of the server's main process and out of the trainer's (workers write
each batch into a shared-memory slot; the trainer maps it), but the bookkeeping around every
batch still costs CPU on both sides: the scheduler's rounds, the gRPC messages, the leases. On a
machine where every core also runs a worker, that CPU comes straight out of throughput. This
table measures it, against PyTorch DataLoader's main process in the same run.

A. Control path. One ``batchd serve`` (2 workers) over the photo set with the decoded-sample
cache (``cache.memory_bytes``) and the pipeline ``R224`` (``Resize(224, 224)``, all of it a
cacheable prefix), warmed by one epoch: the workers then only copy cached samples into slots, so
batches come as fast as the control path lets them. A ``RemoteDataLoader`` (the one installed:
its numbers follow the client's code) reads ``timed`` batches over shared memory (``shm``) and
over TCP (``inline``), at batch 64 and 256, across epoch boundaries (each epoch opens a new
stream, as training does), from two datasets: ``photos_x4`` (the photos listed four times, 12,000
samples: 187 batches of 64 and 46 of 256 per epoch, the per-batch figures and targets) and the
photo set itself (3,000: 46 and 11 per epoch), where an epoch's fixed cost (a new call and stream
on each side) weighs more per batch. Over the timed window: the server's main process's CPU (every thread:
gRPC, the scheduler, the leases; ``/proc/PID/task/*/schedstat``), this process's CPU (the
trainer: ``time.process_time``, every thread of the client), divided by the batches. The
batches are dropped as they come (no page of them is read): what is measured is what the loader
itself costs, not reading the pixels, which costs the same whoever delivered them. DataLoader
(``bench/peers/torch_loader.py``: the same decode and ``R224`` in 2 persistent forkserver workers, no
cache) is timed the same way in this process: its main process's CPU per batch. Cases rotate
between repeats; medians.

B. Counts per batch. From the server's ``Stats`` before and after each window of A (outside it):
scheduler rounds, selector waits and timeouts, wake-ups and tasks sent (``PoolStats.scheduler_*``),
and, where the server counts them, control RPCs and stream control messages (``StatsTotals``
fields about RPCs, releases, describes and control messages); "n/a" where the server does not
export a count. From the trainer, in one more window per case after A's (its channels are then
wrapped by a counting interceptor, which costs the trainer CPU of its own, so A's windows have
none): the gRPC calls it made per batch, by method, and the messages it sent on streaming calls
(grants, releases, progress). A regression shows as a number here before it shows as a time.

C. Same work: images/s of batchd (shared memory) against DataLoader doing the same work (decode
+ L3 on the photo set, batch 64, 2 workers, no cache on either side), medians of ``repeats``
rounds alternating which goes first (as Table 1).

Targets (issue 26): server main process <= 1 ms CPU per batch on shared memory at 64 and 256;
trainer <= 1 ms per batch on shared memory, below DataLoader's main process in the same run
(both on ``photos_x4``, epoch boundaries included); same-work images/s >= 1.0x DataLoader.
"""

from __future__ import annotations

import os
import sys
import time

from bench import common
from bench.fixtures import data, pipelines
from bench.fixtures.grpc_calls import CallCounter
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds, median, time_stream
from bench.noise import measure
from bench.report import fx, md_table

NAME = "table16"
TITLE = "Table 16: the control path (CPU per batch of the server's main process and the trainer; 2 workers)"
WORKERS = 2
BATCHES = (64, 256)
CASES = ("batchd_shm", "batchd_tcp", "dataloader")
LABELS = {"batchd_shm": "batchd shm", "batchd_tcp": "batchd TCP (inline)", "dataloader": "DataLoader"}
SAME_WORK = ("batchd_shm", "dataloader")
CACHE_BYTES = "2560MiB"  # every sample's Resize(224, 224) output (3,000 + 12,000 x 147 KiB) and the cache's tables
LONG, SHORT = "photos_x4", "photos"  # the datasets of A: the figures and targets; shorter epochs
TARGET_MS = 1.0
# PoolStats fields (this table's counts per batch), and the words that mark StatsTotals fields as
# counts of control work (RPCs, lease releases, describes, stream control messages)
POOL_COUNTS = ("scheduler_rounds", "scheduler_waits", "scheduler_timeouts", "scheduler_wakeups", "scheduler_passes",
               "scheduler_dispatches")
CONTROL_WORDS = ("rpc", "release", "describe", "control", "message", "grant")


def r224() -> dict:
    import albumentations as A

    return A.to_dict(A.Compose([A.Resize(224, 224)]))


def run(s, log=print) -> dict:
    from bench.peers.torch_loader import PhotoDataset, make_loader

    cfg, cfg_x4 = common.photos_config(), common.photos_x4_config()
    # photos_x4: 2 epochs at 64 and 256 (1/2 and 1 with --quick); photos: 2 and 3 (1/2 and 1)
    timed = {LONG: {64: s.pick(374, 94), 256: s.pick(92, 46)}, SHORT: {64: s.pick(92, 23), 256: s.pick(33, 11)}}
    presets = {"R224": r224(), "L3": pipelines.preset("L3")}
    torch_ds = PhotoDataset("photos", cfg, data.LOCAL_CACHE, presets)
    dl, plan = make_loader(torch_ds, WORKERS)
    control: dict[str, list[dict]] = {}
    calls: dict[str, dict] = {}
    same: dict[str, list[float]] = {}
    counter = CallCounter()
    try:
        srv = ServerProcess(datasets=common.server_datasets(photos=cfg, photos_x4=cfg_x4), pipelines=presets,
                            workers=WORKERS, cache_dir=data.CACHE, extra={"cache": {"memory_bytes": CACHE_BYTES}}).start()
        try:
            t0 = time.perf_counter()
            for name in (SHORT, LONG):
                with common.remote(srv.address, name, batch_size=256, pipeline="R224", workers=WORKERS,
                                   transport="shm") as rl:  # fills the cache: every sample once
                    for _ in rl:
                        pass
            _dataloader(dl, plan, torch_ds, 64, 2 * WORKERS, 0)  # its workers start
            log(f"  {NAME}: cache warm in {time.perf_counter() - t0:.0f} s")
            for rep in range(s.repeats):
                for bi, bs in enumerate(BATCHES):
                    k = (rep + bi) % len(CASES)
                    for case in CASES[k:] + CASES[:k]:
                        seed = 100 * rep + bi
                        if case == "dataloader":
                            r = _dataloader(dl, plan, torch_ds, bs, timed[SHORT][bs], seed)
                            control.setdefault(f"{case}|{bs}", []).append(r)
                            continue
                        for name in (LONG, SHORT):
                            r = _batchd(srv, name, bs, "shm" if case == "batchd_shm" else "inline",
                                        timed[name][bs], seed)
                            control.setdefault(f"{case}|{bs}" + ("" if name == LONG else f"|{name}"), []).append(r)
                log(f"  {NAME}: control path, repeat {rep + 1}/{s.repeats} done")
            counter.on = True  # the trainer's calls, counted (channels made from now on)
            try:
                for bs in BATCHES:
                    for case in ("batchd_shm", "batchd_tcp"):
                        r = _batchd(srv, LONG, bs, "shm" if case == "batchd_shm" else "inline", timed[LONG][bs], 999,
                                    counter=counter)
                        calls[f"{case}|{bs}"] = r["calls"]
            finally:
                counter.on = False
        finally:
            srv.stop()
        srv = ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=presets, workers=WORKERS,
                            cache_dir=data.CACHE).start()
        try:
            with common.remote(srv.address, "photos", batch_size=64, pipeline="L3", workers=WORKERS,
                               transport="shm") as rl:
                time_stream(rl, 0, WORKERS)  # the workers build L3 once
            warmup, n = 2 * WORKERS, s.pick(24, 8)
            for rep in range(s.repeats):
                order = SAME_WORK if rep % 2 == 0 else SAME_WORK[::-1]
                for case in order:
                    seed = 1000 + rep
                    r = measure(lambda: _same_work(case, srv, dl, plan, torch_ds, warmup, n, seed))
                    same.setdefault(case, []).append(r.rate)
                log(f"  {NAME}: same work, round {rep + 1}/{s.repeats} done")
        finally:
            srv.stop()
    finally:
        dl = None  # its persistent workers stop
    return {"control": control, "calls": calls, "same": same,
            "timed": {name: {str(k): v for k, v in t.items()} for name, t in timed.items()},
            "repeats": s.repeats,
            "cpus": os.cpu_count()}


def _endless(loader):
    """The loader's batches, epoch after epoch (``set_epoch`` as a training loop calls it)."""
    epoch = 0
    while True:
        loader.set_epoch(epoch)
        yield from loader
        epoch += 1


def _batchd(srv: ServerProcess, dataset: str, bs: int, transport: str, timed: int, seed: int,
            counter: CallCounter | None = None) -> dict:
    from batchd.client.transport.server_stats import get_stats

    try:
        with common.remote(srv.address, dataset, batch_size=bs, pipeline="R224", workers=WORKERS,
                           transport=transport, seed=seed) as rl:
            per_epoch = len(rl)
            it = _endless(rl)
            for _ in range(2 * WORKERS):  # the stream is open and the workers busy
                next(it)
            before = get_stats(srv.address)
            if counter is not None:
                counter.take()
            s0, c0, t0 = cpu_seconds(srv.pid), time.process_time(), time.perf_counter()
            for _ in range(timed):
                next(it)
            t1, c1, s1 = time.perf_counter(), time.process_time(), cpu_seconds(srv.pid)
            calls, sent = counter.take() if counter is not None else ({}, {})
            after = get_stats(srv.address)
            it.close()
    finally:
        srv.wait_idle()
    return {"server_s": (s1 - s0) / timed, "trainer_s": (c1 - c0) / timed, "rate": timed * bs / (t1 - t0),
            "per_epoch": per_epoch,
            "counts": _counts(before, after, timed),
            "calls": {**{f"calls {m.rsplit('/', 1)[-1]}": n / timed for m, n in calls.items()},
                      **{f"sent on {m.rsplit('/', 1)[-1]}": n / timed for m, n in sent.items()}}}


def _counts(before, after, batches: int) -> dict[str, float | None]:
    """Per batch between two StatsResponses: the pool's scheduler counts (None where the server has no
    such field) and every StatsTotals count of control work the server exports."""
    out: dict[str, float | None] = {}
    pool_fields = {f.name for f in before.pool.DESCRIPTOR.fields}
    for name in POOL_COUNTS:
        out[name] = (getattr(after.pool, name) - getattr(before.pool, name)) / batches if name in pool_fields else None
    control = [f for f in before.totals.DESCRIPTOR.fields if any(w in f.name for w in CONTROL_WORDS)
               and f.cpp_type in (f.CPPTYPE_UINT64, f.CPPTYPE_UINT32, f.CPPTYPE_INT64, f.CPPTYPE_INT32)]
    for f in control:
        out[f"totals.{f.name}"] = (getattr(after.totals, f.name) - getattr(before.totals, f.name)) / batches
    if not control:
        out["server's control RPCs and messages"] = None  # this server does not count them: n/a
    return out


def _dataloader(dl, plan, torch_ds, bs: int, timed: int, seed: int) -> dict:
    """DataLoader's main process (this one) over ``timed`` batches, after a warm-up of 2 x workers."""
    warmup = 2 * WORKERS
    tail = dl.num_workers * (dl.prefetch_factor or 2)
    plan.set("R224", len(torch_ds), bs, warmup + timed + tail, seed)
    it = iter(dl)
    try:
        for _ in range(warmup):
            next(it)
        c0, t0 = time.process_time(), time.perf_counter()
        for _ in range(timed):
            next(it)
        t1, c1 = time.perf_counter(), time.process_time()
    finally:
        for _ in it:  # the tail, untimed: the workers are idle before the next measurement
            pass
    return {"server_s": None, "trainer_s": (c1 - c0) / max(1, timed), "rate": timed * bs / max(t1 - t0, 1e-9),
            "counts": {}}


def _same_work(case, srv, dl, plan, torch_ds, warmup, timed, seed):
    from bench.peers.torch_loader import time_loader

    if case == "dataloader":
        return time_loader(dl, plan, "L3", len(torch_ds), 64, warmup, timed, seed)
    try:
        with common.remote(srv.address, "photos", batch_size=64, pipeline="L3", workers=WORKERS, transport="shm",
                           seed=seed) as rl:
            return time_stream(rl, warmup, timed)
    finally:
        srv.wait_idle()


def _med(runs: list[dict], key: str) -> float | None:
    values = [r[key] for r in runs if r[key] is not None]
    return median(values) if values else None


def _ms(x: float | None) -> str:
    return "n/a" if x is None else f"{x * 1e3:.2f}"


def _cell(r: dict, case: str, bs: int, dataset: str = LONG) -> list[dict]:
    return r["control"].get(f"{case}|{bs}" + ("" if dataset == LONG else f"|{dataset}"), [])


def _n(r: dict, dataset: str, bs: int) -> str:
    runs = _cell(r, "batchd_shm", bs, dataset)
    return str(runs[0]["per_epoch"]) if runs else "?"


def render(r: dict) -> str:
    head = ["batch", "loader", "server main ms CPU / batch", "trainer ms CPU / batch", "trainer / DataLoader main",
            "batches/s", f"server / trainer ms per batch, {SHORT} (shorter epochs)"]
    rows = []
    for bs in BATCHES:
        dl = _med(_cell(r, "dataloader", bs), "trainer_s")
        for case in CASES:
            runs = _cell(r, case, bs)
            if not runs:
                continue
            trainer = _med(runs, "trainer_s")
            short = [_ms(_med(_cell(r, case, bs, SHORT), k)) for k in ("server_s", "trainer_s")]
            rows.append([bs, LABELS[case], _ms(_med(runs, "server_s")), _ms(trainer),
                         fx(trainer / dl) if dl and case != "dataloader" else "", f"{_med(runs, 'rate') / bs:.0f}",
                         "" if case == "dataloader" else " / ".join(short)])
    t = r["timed"]
    out = md_table(head, rows) + (
        f"\n\nCPU per batch over {t[LONG]['64']} batches of 64 and {t[LONG]['256']} of 256 of {LONG} (12,000 samples: "
        f"2 epochs each; epoch boundaries included, a new stream per epoch), median of {r['repeats']} rotated "
        f"repeats; the batches are not read (no page touched), so this is what the loader costs besides the "
        f"pixels. Server: the R224 pipeline from a warm decoded-sample cache. The {SHORT} column: the same over "
        f"{t[SHORT]['64']} and {t[SHORT]['256']} batches of the 3,000-photo set ({_n(r, SHORT, 64)} and "
        f"{_n(r, SHORT, 256)} batches per epoch, against {_n(r, LONG, 64)} and {_n(r, LONG, 256)}): an epoch costs a "
        f"few ms on each side besides its batches (a new call and stream), which shows at 11 batches per epoch. "
        f"DataLoader: the "
        f"same decode and R224 in its workers (no cache); its row is its main process, the trainer's "
        f"counterpart. {r['cpus']} CPUs, shared.")
    names: list[str] = []
    for runs in r["control"].values():
        for x in runs:
            names += [n for n in x["counts"] if n not in names]
    if names:
        head = ["batch", "loader", *names]
        rows = []
        for bs in BATCHES:
            for case in ("batchd_shm", "batchd_tcp"):
                runs = _cell(r, case, bs)
                if not runs:
                    continue
                cells = []
                for n in names:
                    values = [x["counts"].get(n) for x in runs]
                    values = [v for v in values if v is not None]
                    cells.append(f"{median(values):.2f}" if values else "n/a")
                rows.append([bs, LABELS[case], *cells])
        out += ("\n\n**Counts per batch, server** (its Stats before and after each timed window; n/a: this server "
                "does not count it)\n\n" + md_table(head, rows))
    names = sorted({n for c in r.get("calls", {}).values() for n in c})
    if names:
        rows = [[key.split("|")[1], LABELS[key.split("|")[0]], *(f"{c.get(n, 0):.2f}" for n in names)]
                for key, c in r["calls"].items()]
        out += ("\n\n**Counts per batch, trainer** (gRPC calls it made by method, and messages it sent on "
                "streaming calls; one window per case, its channels wrapped by a counting interceptor)\n\n"
                + md_table(["batch", "loader", *names], rows))
    if r["same"]:
        m = {k: median(v) for k, v in r["same"].items()}
        out += ("\n\n**Same work** (decode + L3, batch 64, 2 workers, no cache; images/s, median of "
                f"{len(r['same']['dataloader'])} alternated rounds)\n\n"
                + md_table(["batchd shm", "DataLoader", "batchd / DataLoader"],
                           [[f"{m['batchd_shm']:.0f}", f"{m['dataloader']:.0f}",
                             fx(m["batchd_shm"] / m["dataloader"])]]))
    return out


def targets(r: dict) -> list[dict]:
    out = []
    server = {bs: _med(_cell(r, "batchd_shm", bs), "server_s") for bs in BATCHES}
    trainer = {bs: _med(_cell(r, "batchd_shm", bs), "trainer_s") for bs in BATCHES}
    dl = {bs: _med(_cell(r, "dataloader", bs), "trainer_s") for bs in BATCHES}
    if all(v is not None for v in server.values()):
        out.append({"name": f"server main process <= {TARGET_MS:g} ms CPU per batch (shared memory, batch 64 and 256, "
                            f"{LONG})",
                    "passed": all(v * 1e3 <= TARGET_MS for v in server.values()),
                    "detail": ", ".join(f"{v * 1e3:.2f} ms at {bs}" for bs, v in server.items())})
    if all(v is not None for v in trainer.values()):
        out.append({"name": f"trainer <= {TARGET_MS:g} ms CPU per batch and below DataLoader's main process "
                            f"(shared memory, batch 64 and 256, {LONG})",
                    "passed": all(v * 1e3 <= TARGET_MS and (dl[bs] is None or v < dl[bs]) for bs, v in trainer.items()),
                    "detail": ", ".join(f"{v * 1e3:.2f} ms at {bs} (DataLoader {_ms(dl[bs])} ms)"
                                        for bs, v in trainer.items())})
    if r["same"]:
        ratio = median(r["same"]["batchd_shm"]) / median(r["same"]["dataloader"])
        out.append({"name": "same-work images/s >= 1.0x DataLoader (L3, batch 64, 2 workers)", "passed": ratio >= 1.0,
                    "detail": f"{ratio:.2f}x"})
    return out


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, photos=True, load_note=True)


if __name__ == "__main__":
    sys.exit(main())
