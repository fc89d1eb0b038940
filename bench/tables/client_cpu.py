"""Table 22, part C: the control path's CPU per batch, measured from outside the processes
(bench/tables/table_client.py has the method and the report).

``control`` runs one ``batchd serve`` per batch size over photo manifests of ``b x k`` rows, warms
its in-memory cache, then times ``BATCHES`` shared-memory batches per case; ``Snapshot`` reads,
at one instant, the server main process's CPU three ways (psutil's group figure; its CPU-time clock,
to the nanosecond; Table 16's sum over live threads' schedstat) and the trainer's (this process and
its children other than the server's tree, less the harness's ``bench-*`` threads).
"""

from __future__ import annotations

import json
import os
import time

from batchd.server.config import ManifestConfig
from bench import ROOT, common, noise
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cpu_seconds, harness_tids, median
from bench.placement import tree
from bench.tables.table_control import _endless, r224

NAME = "table22"
WORKERS = 2
BATCH_SIZES = (64, 256)
SAMPLE_BYTES = 224 * 224 * 3  # one R224 sample in the cache
WARM_BATCHES = 8


def tasks(pid: int) -> set[int]:
    """The thread ids of process ``pid`` (``/proc/PID/task``); empty once it is gone."""
    try:
        return {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    except OSError:
        return set()


def _live(pid: int) -> dict[int, int]:
    """tid -> schedstat run time (ns) of every live thread of ``pid``."""
    out = {}
    for tid in tasks(pid):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                out[tid] = int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
    return out


def _psutil_cpu(p) -> float:
    t = p.cpu_times()
    return t.user + t.system


def _process_clock(pid: int) -> float | None:
    """CPU seconds of process ``pid``'s whole thread group, ended threads included, to the
    nanosecond: its CPU-time clock (``clock_getcpuclockid``: ``(~pid << 3) | CPUCLOCK_SCHED`` on
    Linux), or None where it cannot be read (psutil's 10 ms ticks are used then)."""
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError, ValueError):
        return None


class Snapshot:
    """CPU figures of the server's main process and the trainer at one instant."""

    def __init__(self, srv: ServerProcess, skip: set[int]):
        import psutil

        me = psutil.Process()
        self.server_live = _live(srv.pid)
        self.server_group = _psutil_cpu(psutil.Process(srv.pid))
        clock = _process_clock(srv.pid)
        self.server_clock = self.server_group if clock is None else clock
        self.server_t16 = cpu_seconds(srv.pid)  # Table 16's method
        harness = harness_tids()
        self.harness = {tid: ns for tid, ns in _live(me.pid).items() if tid in harness}
        self.process_time = time.process_time()  # Table 16's trainer figure
        t = me.cpu_times()
        self.trainer = t.user + t.system
        self.reaped = t.children_user + t.children_system  # children that ended (and were waited for)
        children = 0.0
        for c in me.children(recursive=True):
            if c.pid in skip:
                continue
            try:
                children += _psutil_cpu(c)
            except psutil.Error:
                pass
        self.children = children


def _control_one(srv: ServerProcess, dataset: str, bs: int, total: int, seed: int, loader_per_epoch: bool = False) -> dict:
    """``total`` batches of ``dataset`` at batch ``bs`` over shared memory, CPU measured around them."""
    from batchd.client.transport.server_stats import get_stats

    skip = set(tree(srv.pid))

    def loader():
        return common.remote(srv.address, dataset, batch_size=bs, pipeline="R224", workers=WORKERS, transport="shm",
                             seed=seed)

    def per_epoch_loaders():  # a new loader (one Batches call) per epoch: the server ends a thread per epoch
        for epoch in range(1 << 30):
            with loader() as ld:
                ld.set_epoch(epoch)
                yield from ld

    try:
        ld = None if loader_per_epoch else loader()
        it = per_epoch_loaders() if loader_per_epoch else _endless(ld)
        for _ in range(WARM_BATCHES):
            next(it)
        calls0 = get_stats(srv.address).totals.batches_calls_started
        a = Snapshot(srv, skip)
        t0 = time.perf_counter()
        for _ in range(total):
            next(it)
        t1 = time.perf_counter()
        b = Snapshot(srv, skip)
        calls = get_stats(srv.address).totals.batches_calls_started - calls0
        it.close()
        per_epoch = len(ld) if ld is not None else None
        if ld is not None:
            ld.close()
    finally:
        srv.wait_idle()
    harness = sum(ns - a.harness[tid] for tid, ns in b.harness.items() if tid in a.harness) / 1e9
    ended = set(a.server_live) - set(b.server_live)
    dead0 = a.server_clock - sum(a.server_live.values()) / 1e9  # the CPU of its threads that ended so far
    dead1 = b.server_clock - sum(b.server_live.values()) / 1e9
    return {
        "server_s": (b.server_group - a.server_group) / total,
        "server_clock_s": (b.server_clock - a.server_clock) / total,  # the same, to the nanosecond
        "trainer_s": ((b.trainer - a.trainer) + (b.children - a.children) + (b.reaped - a.reaped) - harness) / total,
        "children_s": ((b.children - a.children) + (b.reaped - a.reaped)) / total,
        "harness_s": harness / total,
        "t16_server_s": (b.server_t16 - a.server_t16) / total,
        "t16_trainer_s": (b.process_time - a.process_time) / total,
        "ended_s": (dead1 - dead0) / total,  # the CPU of the server's threads that ended in the window, whole life
        "ended": len(ended), "started": len(set(b.server_live) - set(a.server_live)),
        "calls": calls, "rate": total / (t1 - t0), "per_epoch": per_epoch,
    }


def control(s, log) -> dict:
    per_epoch = s.pick((3, 64), (3, 8))
    total = s.pick(1200, 120)
    out: dict[str, list[dict]] = {}
    for bs in BATCH_SIZES:
        cfgs = {f"b{bs}x{k}": ManifestConfig(kind="manifest", path=data.ensure_photo_manifest(bs * k)) for k in per_epoch}
        rows = bs * sum(per_epoch)
        cache_mib = rows * (SAMPLE_BYTES + 8192) // (1 << 20) + 256
        with ServerProcess(datasets=common.server_datasets(**cfgs), pipelines={"R224": r224()}, workers=WORKERS,
                           cache_dir=data.CACHE, extra={"cache": {"memory_bytes": f"{cache_mib}MiB"}}) as srv:
            t0 = time.perf_counter()
            for name in cfgs:
                with common.remote(srv.address, name, batch_size=bs, pipeline="R224", workers=WORKERS,
                                   transport="shm") as ld:  # fills the cache: every sample once
                    for _ in ld:
                        pass
            srv.wait_idle()
            log(f"  {NAME}: batch {bs}: cache warm ({rows} samples) in {time.perf_counter() - t0:.0f} s")
            for rep in range(s.repeats):
                order = per_epoch if rep % 2 == 0 else per_epoch[::-1]
                for k in order:
                    m = noise.measure(lambda: _control_one(srv, f"b{bs}x{k}", bs, total, seed=100 * rep + k))
                    m["per_epoch"] = k
                    out.setdefault(f"{bs}|{k}", []).append(m)
                    log(f"  {NAME}: batch {bs}, {k} per epoch, round {rep + 1}/{s.repeats}: server "
                        f"{m['server_s'] * 1e3:.2f} ms (Table 16's method {m['t16_server_s'] * 1e3:.2f}), trainer "
                        f"{m['trainer_s'] * 1e3:.2f} ms per batch; {m['ended']} server threads ended")
            if bs == BATCH_SIZES[0]:  # the diagnostic: a Batches call (a server thread) per epoch
                k = per_epoch[0]
                n = s.pick(150, 30)
                m = noise.measure(lambda: _control_one(srv, f"b{bs}x{k}", bs, n, seed=999, loader_per_epoch=True))
                m["per_epoch"] = k
                out[f"{bs}|{k}|per-epoch loader"] = [m]
                log(f"  {NAME}: a loader per epoch (diagnostic): server {m['server_s'] * 1e3:.2f} ms (Table 16's "
                    f"method {m['t16_server_s'] * 1e3:.2f}), {m['ended']} threads ended")
    return {"cases": out, "batches": total, "per_epoch": list(per_epoch)}


def table16_figures() -> dict | None:
    """Table 16's last stored figures for batchd over shared memory (bench/results/results.json)."""
    try:
        t16 = json.loads((ROOT / "bench" / "results" / "results.json").read_text())["table16"]
    except (OSError, ValueError, KeyError):
        return None
    rows = {}
    for key, runs in t16.get("control", {}).items():
        parts = key.split("|")
        if parts[0] != "batchd_shm":
            continue
        rows["|".join(parts[1:])] = {
            "server_s": median(r["server_s"] for r in runs), "trainer_s": median(r["trainer_s"] for r in runs),
            "per_epoch": runs[0].get("per_epoch"), "dataset": parts[2] if len(parts) > 2 else "photos_x4"}
    return {"rows": rows, "run_at": t16.get("run_at"), "quick": t16.get("quick", False)}
