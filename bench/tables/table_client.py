"""Table 22: the client after issue 36. Threads per loader, lines of code, the control path's CPU measured from outside.

    python -m bench.tables.table_client [--quick] [--repeats N]

A. **Threads per loader** for 1, 2 and 4 servers (``batchd serve`` processes of 1 worker over
Fashion-MNIST's test split, or the ``Paced`` test dataset where Fashion-MNIST is not installed),
transport ``shm`` and ``socket``: the Python threads that appear in this process between building
the loader and its 20th batch (``threading.enumerate``), split into batchd's own (named
``batchd-*``: client/iteration/servers.py, client/transport/link.py) and gRPC's (started by
``grpc._cython.cygrpc``: a channel's and a streaming call's request iterator's), and beside them
the operating system's threads added to this process (``/proc/self/task``: gRPC core's own
threads too, which it starts with its first channel and ends with its last) and, over
``socket``, the threads of batchd's relay process. Beside them, the client before the rewrite
(commit ``eb562ec``), measured on this machine with the same probe before it was replaced
(``BEFORE_THREADS``: the old code cannot run against today's server, so the figures are quoted).

B. **Lines of the client**: ``client/**/*.py`` at ``eb562ec`` (``git ls-tree`` / ``git show``;
"n/a" without the history) and in this checkout, in lines and in Python statements (``ast.stmt``
nodes); the lines of the files of features added since (``ADDED_SINCE``) are given apart.

C. **The control path's CPU per batch, measured from outside** (issue 36, point 6;
bench/tables/client_cpu.py). One ``batchd serve`` (2 workers) per batch size over a manifest of
the bench photos with exactly ``b x k`` rows (bench/fixtures/data.py ``ensure_photo_manifest``)
for k = 3 and 64 batches per epoch, the
decoded-sample cache in memory warmed by one pass, the preset ``R224`` (``Resize(224, 224)``,
Table 16's), shared memory. A ``RemoteDataLoader`` (``bench.common.remote``: shuffled, prefetch
2 x workers) reads ``BATCHES`` batches across epochs (``set_epoch`` each epoch, as training does)
at batch 64 and 256, after 8 untimed ones; the batches are dropped as they come. CPU, user +
system from psutil (``/proc/PID/stat``: the whole thread group, threads that ended included):
the server's main process (not its workers), and the trainer: this process plus its children
other than the server's tree, less the benchmark harness's own threads (``bench-*``: run_all's
noise meter, per thread from schedstat). Target: <= 1.0 ms per batch each side. Per-epoch cases
alternate, medians of ``repeats`` rounds.

In the same window, Table 16's own method (bench/measure.py ``cpu_seconds``: the sum of
``/proc/PID/task/*/schedstat`` over the server's threads *alive* at each end; ``time.process_time``
for the trainer), and what it leaves out: the server's threads that ended during the window.
A thread alive at the start and gone at the end has its CPU before the window subtracted and its
CPU in the window lost; one that starts and ends inside it is never seen. The whole group's CPU
less its live threads' is exactly the CPU of its ended threads (the kernel keeps it in the
process's totals), so its growth over the window is what the schedstat sum misses. A diagnostic
row makes the server end one thread per epoch as the client before issue 36 did (a Batches call
per epoch: the server's ``batchd-batches`` request reader lives as long as its call): there a new
loader per epoch, each one call. Table 16's last figures (``bench/results/results.json``,
``table16`` ``control``, batchd over shared memory at 64 and 256, both its epoch lengths) are
quoted beside them with their date.
"""

from __future__ import annotations

import ast
import os
import pathlib
import subprocess
import sys
import threading
import time

import batchd
from bench import ROOT, common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median
from bench.placement import tree
from bench.report import md_table
from bench.tables.client_cpu import WARM_BATCHES, WORKERS, control, table16_figures, tasks

NAME = "table22"
TITLE = "Table 22: the client after issue 36 (threads per loader, lines of code, control-path CPU per batch from outside)"
TIMEOUT_S = 2400  # run_all's hang guard for this table (the warm passes decode about 21,000 photos)
BEFORE = "eb562ec"  # the client before issue 36's rewrite
# Client files of features that came after BEFORE (counted apart in part B): issue 39's weighted sampling and
# mixing (the loader's side and the wire order), issue 37's redial of a data connection.
ADDED_SINCE = {"client/loader/sampling.py": "issue 39", "client/transport/orders.py": "issue 39",
               "client/transport/redial.py": "issue 37"}
# Threads per loader of the client at eb562ec: measured on this machine with the probe of part A (Python
# threads new after 20 batches, shm and socket alike), before the rewrite replaced that code (quoted).
BEFORE_THREADS = {1: {"total": 5, "batchd": 3}, 2: {"total": 10, "batchd": 6}, 4: {"total": 18, "batchd": 10}}
BEFORE_NAMES = ("a batchd-convert, a batchd-lane and a batchd-report per server, a batchd-probe with several "
                "servers; gRPC's 2 per server")
SERVER_COUNTS = (1, 2, 4)
TRANSPORTS = ("shm", "socket")
PROBE_BATCHES = 20
FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")
TARGET_MS = 1.0


# --- A. threads ------------------------------------------------------------------------------

def _kind(t: threading.Thread) -> str:
    if t.name.startswith("batchd-"):
        return "batchd"
    target = getattr(t, "_target", None)
    module = getattr(target, "__module__", None) or type(t).__module__
    return "grpc" if module.startswith("grpc") else "other"


def _probe(addresses: list[str], dataset: str, transport: str, servers: set[int]) -> dict:
    """The threads a loader over ``addresses`` adds to this process once it has read 20 batches, and
    the threads of this process's other children than ``servers`` (pids): batchd's relay, one per
    trainer process (client/transport/relay.py ``shared``), started by the first socket loader."""
    me = os.getpid()
    base, base_tasks = {t.ident for t in threading.enumerate()}, tasks(me)
    loader = batchd.RemoteDataLoader(addresses if len(addresses) > 1 else addresses[0], dataset, batch_size=64,
                                     transport=transport)
    try:
        it = iter(loader)
        for _ in range(PROBE_BATCHES):
            next(it)
        new = [t for t in threading.enumerate() if t.ident not in base]
        kinds = {k: sorted(t.name for t in new if _kind(t) == k) for k in ("batchd", "grpc", "other")}
        os_threads = len(tasks(me) - base_tasks)
        relay = sum(len(tasks(p)) for p in set(tree(me)) - servers - {me})
        it.close()
    finally:
        loader.close()
    return {"batchd": kinds["batchd"], "grpc": len(kinds["grpc"]), "other": kinds["other"], "total": len(new),
            "os": os_threads, "relay": relay}


def threads(log) -> dict:
    if FMNIST.exists():
        datasets, name, what = ({"fm": {"kind": "fashion-mnist", "root": str(FMNIST), "split": "test"}}, "fm",
                                "Fashion-MNIST (test split)")
    else:
        datasets, name, what = ({"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": 5000}}},
                                "paced", "the Paced test dataset")
    extra = {"python_path": [str(ROOT / "tests" / "pydata")]}
    servers = [ServerProcess(datasets=datasets, workers=1, cache_dir=data.CACHE, extra=extra)
               for _ in range(max(SERVER_COUNTS))]
    out = {}
    try:
        for srv in servers:
            srv.start()
        for n in SERVER_COUNTS:
            for transport in TRANSPORTS:
                server_pids = {p for srv in servers for p in tree(srv.pid)}
                m = _probe([s.address for s in servers[:n]], name, transport, server_pids)
                out[f"{transport}|{n}"] = m
                log(f"  {NAME}: {n} server(s), {transport}: {m['total']} threads ({len(m['batchd'])} batchd's, "
                    f"{m['grpc']} gRPC's), {m['os']} OS threads")
                time.sleep(0.5)  # the closed loader's threads end
    finally:
        for srv in servers:
            srv.stop()
    return {"rows": out, "dataset": what}


# --- B. lines -------------------------------------------------------------------------------

def _git(*args: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True, check=True).stdout


def _statements(source: str) -> int:
    """Python statements in ``source`` (``ast.stmt`` nodes): what lines count less comments, docstrings and wrapping."""
    return sum(isinstance(n, ast.stmt) for n in ast.walk(ast.parse(source)))


def _count(sources: dict[str, str]) -> dict:
    return {"files": len(sources), "lines": sum(t.count("\n") for t in sources.values()),
            "statements": sum(_statements(t) for t in sources.values()),
            "added": {p: t.count("\n") for p, t in sources.items() if p in ADDED_SINCE}}


def lines() -> dict:
    now = {str(p.relative_to(ROOT)): p.read_text() for p in sorted((ROOT / "client").rglob("*.py"))}
    out = {"now": _count(now), "before": None, "before_commit": BEFORE}
    try:
        paths = [p for p in _git("ls-tree", "-r", "--name-only", BEFORE, "--", "client").split() if p.endswith(".py")]
        out["before"] = _count({p: _git("show", f"{BEFORE}:{p}") for p in paths})
    except (OSError, subprocess.CalledProcessError):
        pass  # no git, or no history: "n/a"
    return out


def run(s, log=print) -> dict:
    r = {"threads": threads(log), "lines": lines()}
    data.ensure_photos()
    r["control"] = control(s, log)
    r["table16"] = table16_figures()
    r["repeats"] = s.repeats
    return r


# --- the report ------------------------------------------------------------------------------------

def _ms(x) -> str:
    return "n/a" if x is None else f"{x * 1e3:.2f}"


def _med(runs: list[dict], key: str) -> float:
    return median(m[key] for m in runs)


def _lines_table(ln: dict) -> str:
    b, now = ln["before"], ln["now"]
    if b is None:
        return md_table(["", "files", "lines", "statements"], [["now", now["files"], f"{now['lines']:,}",
                                                                 f"{now['statements']:,}"]]) + "\n\n(no git history: n/a before)"
    added = sum(now["added"].values())

    def change(key: str, less: int = 0) -> str:
        d = now[key] - less - b[key]
        return f"{d:+,} ({d / b[key]:+.0%})"
    rows = [[f"before ({ln['before_commit']})", b["files"], f"{b['lines']:,}", f"{b['statements']:,}"],
            ["now", now["files"], f"{now['lines']:,}", f"{now['statements']:,}"],
            ["change", f"{now['files'] - b['files']:+d}", change("lines"), change("statements")]]
    out = md_table(["", "files", "lines", "statements"], rows) + (
        "\n\nStatements: Python statements (`ast.stmt` nodes), which comments, docstrings and line wrapping do not "
        "move.")
    if added:
        parts = ", ".join(f"{p} ({n}, {ADDED_SINCE[p]})" for p, n in sorted(now["added"].items()))
        out += (f"\n\nOf today's lines, {added:,} are in files of features that came after {ln['before_commit']}: "
                f"{parts}. Without them the change in lines is {change('lines', added)}.")
    return out


def render(r: dict) -> str:
    t = r["threads"]
    head = ["transport", "servers", "batchd's own", "gRPC's", "Python threads in all", "before (eb562ec): in all "
            "(batchd's own)", "OS threads added", "relay process"]
    rows, others = [], []
    for transport in TRANSPORTS:
        for n in SERVER_COUNTS:
            m = t["rows"].get(f"{transport}|{n}")
            if m is None:
                continue
            before = BEFORE_THREADS[n]
            names = ", ".join(f"{x} x{m['batchd'].count(x)}" for x in sorted(set(m["batchd"])))
            rows.append([transport, n, f"{len(m['batchd'])} ({names})", m["grpc"], m["total"],
                         f"{before['total']} ({before['batchd']})", m["os"],
                         (m["relay"] or "-") if transport == "socket" else "-"])
            others += m["other"]
    out = "**A. Threads per loader**\n\n" + md_table(head, rows)
    out += (f"\n\nPython threads new in this process after {PROBE_BATCHES} batches of a loader over n servers of 1 "
            f"worker ({t['dataset']}): batchd's own (named batchd-*) and gRPC's (a channel's and a streaming call's "
            f"request iterator's, per server). Before: the client at {BEFORE}, measured on this machine with the same "
            f"probe before the rewrite ({BEFORE_NAMES}); quoted, since that client cannot run against today's server. "
            "OS threads added: /proc/self/task, gRPC core's own threads included (it starts them with its first "
            "channel and ends them with its last). Relay process: over socket, the threads of batchd's relay, a "
            "process of its own (one per trainer process, whatever its loaders), not in the trainer's."
            + (f" Other new threads (counted in all): {', '.join(sorted(set(others)))}." if others else ""))
    out += "\n\n**B. Lines of the client** (`client/**/*.py`)\n\n" + _lines_table(r["lines"])
    c = r["control"]
    head = ["batch", "batches per epoch", "server main ms / batch (psutil)", "trainer ms / batch (psutil)",
            f"<= {TARGET_MS:g} ms each", "Table 16's method, same window: server / trainer",
            "CPU of server threads that ended (ms / batch)", "Batches calls started", "batches/s"]
    rows = []
    for key, runs in sorted(c["cases"].items(), key=lambda kv: (int(kv[0].split("|")[0]), int(kv[0].split("|")[1]),
                                                                 kv[0])):
        bs, k, *diag = key.split("|")
        server, trainer = _med(runs, "server_s"), _med(runs, "trainer_s")
        rows.append([bs, k + (f" ({diag[0]}: diagnostic)" if diag else ""), _ms(server), _ms(trainer),
                     "" if diag else ("PASS" if max(server, trainer) * 1e3 <= TARGET_MS else "FAIL"),
                     f"{_ms(_med(runs, 't16_server_s'))} / {_ms(_med(runs, 't16_trainer_s'))}",
                     _ms(_med(runs, "ended_s")),
                     f"{median(m['calls'] for m in runs):g}", f"{_med(runs, 'rate'):.0f}"])
    out += "\n\n**C. The control path's CPU per batch, measured from outside**\n\n" + md_table(head, rows)
    harness = max((m["harness_s"] for runs in c["cases"].values() for m in runs), default=0.0)
    out += (f"\n\n{c['batches']:,} batches per measurement across epochs (set_epoch each), after {WARM_BATCHES} untimed; "
            f"a `batchd serve` of {WORKERS} workers per batch size, warm decoded-sample cache in memory, `R224`, shared "
            f"memory, the batches dropped as they come. Medians of {r['repeats']} rounds (the per-epoch cases "
            "alternated). Server main: psutil user + system of its main process (every thread, those that ended "
            "included; not its workers). Trainer: this process and its children other than the server's tree, less "
            f"the harness's own threads (at most {_ms(harness)} ms per batch). Table 16's method in the same window: "
            "the server's live threads' schedstat (bench/measure.py `cpu_seconds`), the trainer's "
            "`time.process_time()`. Diagnostic row: a new loader per epoch, so one Batches call per epoch as the "
            f"client before issue 36 made (its figures are not the client's: a loader per {c['per_epoch'][0]} batches "
            "also connects and describes each time).")
    t16 = r.get("table16")
    if t16 and t16["rows"]:
        head = ["batch", "batches per epoch", "dataset", "server main ms / batch", "trainer ms / batch"]
        rows = [[key.split("|")[0], v["per_epoch"], v["dataset"], _ms(v["server_s"]), _ms(v["trainer_s"])]
                for key, v in sorted(t16["rows"].items(), key=lambda kv: (int(kv[0].split("|")[0]), kv[1]["dataset"]))]
        out += (f"\n\n**Table 16's own figures** (bench/results/results.json, batchd over shared memory; run "
                f"{t16['run_at']}{', --quick' if t16['quick'] else ''}, with the client of that date)\n\n"
                + md_table(head, rows))
    out += "\n\n" + left_out(r)
    return out


def left_out(r: dict) -> str:
    """What Table 16's method leaves out, in words, with this run's figures."""
    cases = r["control"]["cases"]
    main = {k: v for k, v in cases.items() if len(k.split("|")) == 2}
    diag = next((v for k, v in cases.items() if len(k.split("|")) == 3), None)
    ended = max((m["ended"] + m["started"] for runs in main.values() for m in runs), default=0)
    lost = max((m["ended_s"] for runs in main.values() for m in runs), default=0.0)
    gap = max((abs(_med(v, "server_s") - _med(v, "t16_server_s")) for v in main.values()), default=0.0)
    text = ("**What Table 16 leaves out.** Its server figure (bench/measure.py `cpu_seconds`) sums "
            "/proc/PID/task/*/schedstat over the threads alive when it reads; the difference of two readings drops "
            "every thread that ends in between: its CPU in the window is lost and its CPU before the window is "
            "subtracted; a thread that starts and ends inside the window is never seen. psutil reads the process's "
            "own totals, which keep the CPU of ended threads; their difference is exactly the ended threads' CPU. "
            "Its trainer figure, `time.process_time()`, counts every thread of the process, ended ones too, but no "
            "child process (none over shared memory). ")
    calls = max((m["calls"] for runs in main.values() for m in runs), default=0)
    text += (f"With one Batches call per server for the loader's life ({calls} calls started in the windows above), "
             f"the server's threads that ended in them used at most {_ms(lost)} ms per batch "
             + ("(no thread came or went between the readings)" if ended == 0 else
                f"(up to {ended} threads came or went between the readings)")
             + f", and the two server figures differ by at most {gap * 1e3:.2f} ms per batch (the rest of the gap: "
             "psutil's 10 ms ticks). ")
    if diag:
        m = diag[0]
        text += (f"With a call per epoch (the diagnostic row: {m['calls']} Batches calls, each with a `batchd-batches` "
                 f"request reader that ends with it, server/serve/control.py; most start and end inside the window, "
                 f"where no reading sees them), Table 16's method reads "
                 f"{_ms(m['t16_server_s'])} ms per batch where the process used {_ms(m['server_clock_s'])} (its CPU "
                 f"clock; psutil: {_ms(m['server_s'])}): the ended threads' {_ms(m['ended_s'])} ms per batch are "
                 f"missing. The client before issue 36 opened a call "
                 f"per server per epoch, so Table 16's server figures left out each epoch's request reader, and more "
                 f"of it the shorter the epochs.")
    return text


def targets(r: dict) -> list[dict]:
    out = []
    cases = {k: v for k, v in r["control"]["cases"].items() if len(k.split("|")) == 2}
    for side, key in (("server main process", "server_s"), ("trainer", "trainer_s")):
        figures = {k: _med(v, key) for k, v in sorted(cases.items(), key=lambda kv: tuple(map(int, kv[0].split("|"))))}
        out.append({"name": f"control path from outside (psutil): {side} <= {TARGET_MS:g} ms CPU per batch (shared "
                            f"memory, batch 64 and 256, {' and '.join(map(str, r['control']['per_epoch']))} batches "
                            "per epoch)",
                    "passed": all(v * 1e3 <= TARGET_MS for v in figures.values()),
                    "detail": ", ".join(f"{v * 1e3:.2f} ms at {k.replace('|', ' x ')}" for k, v in figures.items())})
    rows = r["threads"]["rows"]
    own = {k: len(m["batchd"]) for k, m in rows.items()}
    out.append({"name": "batchd's own threads per loader <= 2 + n for n servers (shm and socket)",
                "passed": all(v <= 2 + int(k.split("|")[1]) for k, v in own.items()),
                "detail": ", ".join(f"{v} for {k.split('|')[1]} ({k.split('|')[0]})" for k, v in own.items()
                                    if k.startswith("shm"))})
    out.append({"name": f"fewer threads per loader in all than the client at {BEFORE}",
                "passed": all(m["total"] < BEFORE_THREADS[int(k.split("|")[1])]["total"] for k, m in rows.items()),
                "detail": ", ".join(f"{m['total']} vs {BEFORE_THREADS[int(k.split('|')[1])]['total']} for "
                                    f"{k.split('|')[1]}" for k, m in rows.items() if k.startswith("shm"))})
    ln = r.get("lines", {})
    if ln.get("before") and "statements" in ln["now"]:
        b, now = ln["before"], ln["now"]
        out.append({"name": f"a smaller client than at {BEFORE}: fewer lines and fewer statements in client/",
                    "passed": now["lines"] < b["lines"] and now["statements"] < b["statements"],
                    "detail": f"{now['lines']:,} vs {b['lines']:,} lines, {now['statements']:,} vs "
                              f"{b['statements']:,} statements"})
    return out


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, photos=True, load_note=True)


if __name__ == "__main__":
    sys.exit(main())
