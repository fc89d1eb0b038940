"""Table 4: memory of a server and its 2 workers with a 10-million-row manifest.

The CSV (``bench/data/manifest_10M.csv``, paths that do not exist) is made once and reused. The
server builds its packed index into an empty cache folder (so the build is part of what we see,
e.g. in the server's peak RSS), then we open streams until every worker has mapped the index
(each stream fails on the missing files: that is expected) and read, for the server and every
process under it, /proc/PID/status (VmRSS, RssAnon, RssFile, RssShmem, VmHWM) and
/proc/PID/smaps_rollup (Pss and its anon/file/shmem parts). RSS counts every mapped page of the
index file in every process that touched it; PSS divides shared pages among the processes
sharing them, so the sum of PSS is what the processes together cost.
"""

from __future__ import annotations

import os
import shutil
import time

from batchd.server.config import ManifestConfig

from bench import common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import cmdline, maps_file, proc_status, smaps_rollup
from bench.report import md_table

NAME = "table4"
TITLE = "Table 4: scale of the index (10M-row manifest, server + 2 workers)"
LIMIT = 1.5e9
FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem", "Pss", "Pss_Anon", "Pss_File", "Pss_Shmem", "VmHWM")


def _role(srv: ServerProcess, pid: int) -> str:
    if pid == srv.pid:
        return "server"
    if pid in srv.worker_pids:
        return f"worker {srv.worker_pids.index(pid)}"
    cmd = cmdline(pid)
    if "forkserver" in cmd:
        return "forkserver"
    if "resource_tracker" in cmd:
        return "resource tracker"
    return "other: " + cmd[:40]


def snapshot(srv: ServerProcess) -> list[dict]:
    out = []
    for pid in [srv.pid, *srv.descendants()]:
        try:
            mem = {**proc_status(pid), **smaps_rollup(pid)}
        except OSError:
            continue
        out.append({"pid": pid, "role": _role(srv, pid), **{k: mem.get(k, 0) for k in FIELDS}})
    return out


def total(procs: list[dict]) -> dict:
    return {k: sum(p[k] for p in procs) for k in FIELDS if k != "VmHWM"}


def _open_everywhere(srv: ServerProcess, index_name: str, tries: int = 12) -> tuple[int, list[str]]:
    """Open failing streams until every worker maps the index; returns (streams, errors seen)."""
    import batchd

    errors = []
    for i in range(1, tries + 1):
        try:
            with batchd.RemoteDataLoader(srv.address, "big", batch_size=64, shuffle=True, seed=i, prefetch=4,
                                         transport="inline", timeout=60) as rl:
                next(iter(rl))
        except Exception as e:  # SampleError: the files do not exist
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")
        if all(maps_file(pid, index_name) for pid in srv.worker_pids):
            return i, errors
        time.sleep(0.2)
    return tries, errors


def run(s, log=print) -> dict:
    rows = s.pick(10_000_000, 1_000_000)
    csv, made_s = data.ensure_big_manifest(rows)
    if made_s:
        log(f"  table4: wrote {csv} ({os.path.getsize(csv) / 1e6:.0f} MB) in {made_s:.1f} s")
    cfg = ManifestConfig(kind="manifest", path=csv)
    cache = data.DATA / "cache-scale"
    shutil.rmtree(cache, ignore_errors=True)
    states = {}
    result = {"rows": rows, "csv_bytes": os.path.getsize(csv), "csv_made_s": made_s}
    for phase in s.pick(("fresh", "reused"), ("fresh",)):
        with ServerProcess(datasets=common.server_datasets(big=cfg), workers=2, cache_dir=cache) as srv:
            result[f"startup_{phase}_s"] = srv.startup_s
            index = next(cache.glob("*.bidx"))
            result["index_bytes"] = index.stat().st_size
            states[f"{phase}: workers started"] = snapshot(srv)
            streams, errors = _open_everywhere(srv, index.name)
            mapped = {pid: maps_file(pid, index.name) for pid in srv.worker_pids}
            time.sleep(0.5)
            states[f"{phase}: workers opened the index"] = snapshot(srv)
            result[f"streams_{phase}"] = streams
            result[f"errors_{phase}"] = errors[:2]
            result[f"all_workers_mapped_{phase}"] = all(mapped.values())
        log(f"  table4: {phase} index: server ready in {result[f'startup_{phase}_s']:.1f} s")
    result["states"] = states
    return result


def _mb(x: int) -> str:
    return f"{x / 1e6:.0f}"


def render(r: dict) -> str:
    main = r["states"]["fresh: workers opened the index"]
    head = ["process", "RSS MB", "RssAnon", "RssFile", "RssShmem", "PSS MB", "Pss_Anon", "Pss_File", "Pss_Shmem",
            "peak RSS (VmHWM)"]
    rows = [[p["role"], *(_mb(p[k]) for k in FIELDS)] for p in main]
    t = total(main)
    rows.append(["**total**", *(f"**{_mb(t[k])}**" for k in FIELDS if k != "VmHWM"), ""])
    out = [md_table(head, rows), ""]
    head2 = ["state", "sum RSS MB", "sum RssAnon MB", "sum PSS MB", "sum Pss_Anon MB", "server RSS MB",
             "worker RSS MB (each)", "worker PSS MB (each)"]
    rows2 = []
    for state, procs in r["states"].items():
        t = total(procs)
        server = next(p for p in procs if p["role"] == "server")
        workers = [p for p in procs if p["role"].startswith("worker")]
        rows2.append([state, _mb(t["VmRSS"]), _mb(t["RssAnon"]), _mb(t["Pss"]), _mb(t["Pss_Anon"]),
                      _mb(server["VmRSS"]), ", ".join(_mb(w["VmRSS"]) for w in workers),
                      ", ".join(_mb(w["Pss"]) for w in workers)])
    out += [md_table(head2, rows2), ""]
    out.append(
        f"{r['rows']:,} rows; CSV {r['csv_bytes'] / 1e6:.0f} MB; packed index {r['index_bytes'] / 1e6:.0f} MB "
        f"(memory-mapped by the server and each worker). Server ready (CSV read + index build + 2 workers) in "
        f"{r['startup_fresh_s']:.1f} s with an empty cache"
        + (f", {r['startup_reused_s']:.1f} s reusing the index. " if "startup_reused_s" in r else ". ")
        + f"Workers opened the dataset through {r['streams_fresh']} stream request(s), each failing as expected "
        f"(e.g. `{(r['errors_fresh'] or ['none'])[0]}`); every worker mapped the index: "
        f"{r['all_workers_mapped_fresh']}. MB = 10^6 bytes. The first table is the fresh server after the "
        "workers opened the index; the forkserver (and resource tracker, if any) are processes the server "
        "started and are counted in the totals. VmHWM is the peak RSS since the process started (for the "
        "fresh server, the index build)."
    )
    before = next(p for p in r["states"]["fresh: workers started"] if p["role"] == "server")
    after = next(p for p in main if p["role"] == "server")
    grew = after["RssAnon"] - before["RssAnon"]
    order_mb = r["rows"] * 8 / 1e6
    kept = grew / 1e6 >= 0.5 * order_mb * r["streams_fresh"]
    out.append(
        f"\nThe server's RssAnon grew by {grew / 1e6:.0f} MB while the workers opened the index, over "
        f"{r['streams_fresh']} failed stream(s); a stream's sample order is {order_mb:.0f} MB (int64 per row), "
        + ("so the server seems to keep the orders of failed streams." if kept else
           "so the failed streams' orders were freed with them.")
    )
    return "\n".join(out)


def targets(r: dict) -> list[dict]:
    t = total(r["states"]["fresh: workers opened the index"])
    ok_pss, ok_rss = t["Pss"] < LIMIT, t["VmRSS"] < LIMIT
    label = f"{r['rows'] / 1e6:g}M-row manifest"
    return [{
        "name": f"{label}: server + all workers under 1.5 GB",
        "passed": ok_pss,
        "detail": f"sum of PSS {t['Pss'] / 1e9:.2f} GB ({'meets' if ok_pss else 'misses'} it); sum of RSS "
                  f"{t['VmRSS'] / 1e9:.2f} GB ({'meets' if ok_rss else 'misses'} it; counts the shared index pages "
                  f"once per process); sum of RssAnon {t['RssAnon'] / 1e9:.2f} GB"
                  + ("" if r["rows"] >= 10_000_000 else " (--quick: not the 10M-row table)"),
    }]
