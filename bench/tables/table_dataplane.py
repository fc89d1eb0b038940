"""Table 19: a remote trainer's images/s while idle connections flood the server's data port (issue 37).

    python -m bench.tables.table_dataplane [--quick] [--repeats N]

One ``batchd serve`` process (2 workers) with a /dev/shm of its own (a mount namespace: the
loader here cannot read its shared memory and reads over the data plane, as a trainer on another
host), serving ``bench.fixtures.synthetic.Frames`` (ready-made 224 x 224 frames, 9.6 MB batches
of 64: the transport is what is measured, the workers only copy). A ``RemoteDataLoader`` with
the defaults (``transport="auto"``: the data plane, through the relay) reads as fast as it can
while an attacker process (``python -m tests.adversary`` at ``nice 19``: from another host it
would take none of this host's CPU; its own open-file limit raised for its connections) holds 0, 64, 500 or 5,000 connections to the data port that never send a byte,
opening a new one as soon as the server closes one (its first-byte deadline, an eviction), at
most 1,000 a second, from 100 source addresses (127.0.0.2-101: a spread attacker that the
per-source cap alone does not stop; the server's table holds ``max_handshakes`` = 1,024 pending
connections, the oldest evicted beyond). On main (a thread per handshake, 64 at most, the
newest refused) 64 idle connections kept every trainer's data connection out.

Per row, medians of alternated rounds (the flood built up, then 8 batches untimed and the
timed ones): the trainer's images/s and its ratio to the row without attack (target >= 0.9x),
the connections the attacker opened per second and the server refused per second (Stats
``data_connections_refused``), the server main process's CPU (its accept thread reads every
pending connection) and the attacker's, each in cores; the server's threads and open
descriptors at the end of the window, from /proc; whether every batch came over the data plane
(no fallback to inline). The machine is shared (2 cores): the attacker's own CPU is taken from
the trainer and the server alike, so the ratio also shows what a flood from this host costs.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import batchd
from batchd.client.transport.server_stats import get_stats
from bench import ROOT, common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess, private_shm_available
from bench.measure import consume, cpu_seconds, median
from bench.noise import measure
from bench.report import md_table
from tests.adversary import process_counts

NAME = "table19"
TITLE = "Table 19: a remote trainer's images/s while idle connections flood the data port"
IDLE = (0, 64, 500, 5000)
BS = 64
RATE = 1000.0  # new attacker connections per second, at most
SOURCES = ",".join(f"127.0.0.{i}" for i in range(2, 102))
NEEDS_PHOTOS = False
TIMEOUT_S = 1800


def _attacker(port: int, n: int) -> subprocess.Popen | None:
    if n == 0:
        return None
    # (at the lowest priority: from another host it would take none of this one's CPU; its loopback
    # connections' kernel work still lands here)
    return subprocess.Popen(["nice", "-n", "19", sys.executable, "-m", "tests.adversary", str(port), str(n),
                             "--rate", str(RATE), "--sources", SOURCES], cwd=ROOT, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _stop(proc: subprocess.Popen | None) -> dict:
    if proc is None:
        return {"opened": 0, "seconds": 1.0, "bytes_received": 0, "errors": []}
    out, _ = proc.communicate(timeout=60)
    return json.loads(out.strip().splitlines()[-1])


def _window(srv: ServerProcess, data_port: int, n: int, seed: int, warmup: int, timed: int) -> dict:
    """One measurement: the flood of ``n`` built up, then the loader's timed batches."""
    attacker = _attacker(data_port, n)
    try:
        time.sleep(1.0 + n / RATE)  # (every connection opened once before the loader starts)
        refused0 = get_stats(srv.address).totals.data_connections_refused
        with batchd.RemoteDataLoader(srv.address, "frames", batch_size=BS, shuffle=True, seed=seed, drop_last=True,
                                     prefetch=4, timeout=120) as ld:
            it = iter(ld)
            for _ in range(warmup):
                consume(next(it))
            c_server, c_attacker = cpu_seconds(srv.pid), cpu_seconds(attacker.pid) if attacker else 0.0
            t0 = time.perf_counter()
            for _ in range(timed):
                consume(next(it))
            seconds = time.perf_counter() - t0
            c_server = cpu_seconds(srv.pid) - c_server
            c_attacker = (cpu_seconds(attacker.pid) - c_attacker) if attacker else 0.0
            threads, fds = process_counts(srv.pid)
            stats = ld.stats()
        refused = get_stats(srv.address).totals.data_connections_refused - refused0
    finally:
        flood = _stop(attacker)
    return {"rate": timed * BS / seconds, "server_cores": c_server / seconds, "attacker_cores": c_attacker / seconds,
            "opened_per_s": flood["opened"] / flood["seconds"], "refused_per_s": refused / seconds,
            "threads": threads, "fds": fds, "peak": flood.get("peak", 0),
            "socket_only": stats["bytes_received"]["inline"] == 0 and stats["data_plane_fallbacks"] == 0,
            "attacker_bytes": flood["bytes_received"], "attacker_errors": flood["errors"]}


def run(s, log=print) -> dict:
    if not private_shm_available():
        return {"skipped": "unshare -m is not allowed here: no server whose shared memory the loader cannot read"}
    rounds = s.pick(max(5, s.repeats), 2)
    warmup, timed = 8, s.pick(320, 160)  # (75 batches/s here: a window of seconds, not of a scheduler's hiccup)
    frames = {"frames": {"kind": "python", "factory": "bench.fixtures.synthetic:Frames"}}
    port = _free_port()
    rows: dict[int, list[dict]] = {n: [] for n in IDLE}
    with ServerProcess(datasets=frames, workers=2, cache_dir=data.CACHE, private_shm=True,
                       extra={"python_path": [str(ROOT)], "max_slots": 32, "data_plane": {"port": port}}) as srv:
        _window(srv, port, 0, seed=1, warmup=2, timed=4)  # first use: workers, relay, buffers
        for rnd in range(rounds):
            k = rnd % len(IDLE)
            for n in IDLE[k:] + IDLE[:k]:
                rows[n].append(measure(lambda: _window(srv, port, n, 100 * rnd + n, warmup, timed)))
            log(f"  {NAME}: round {rnd + 1}/{rounds}: " + ", ".join(f"{n} idle {rows[n][-1]['rate']:.0f} img/s"
                                                                  for n in IDLE))
    out = {"rows": {}, "rounds": rounds, "timed": timed, "rate_limit": RATE}
    for n, ms in rows.items():
        out["rows"][str(n)] = {k: median(m[k] for m in ms) for k in ("rate", "server_cores", "attacker_cores",
                                                                      "opened_per_s", "refused_per_s")}
        out["rows"][str(n)].update(threads=max(m["threads"] for m in ms), fds=max(m["fds"] for m in ms),
                                   socket_only=all(m["socket_only"] for m in ms),
                                   attacker_bytes=sum(m["attacker_bytes"] for m in ms),
                                   rates=[m["rate"] for m in ms],
                                   attacker_errors=[e for m in ms for e in m["attacker_errors"]][:3])
    return out


def _free_port() -> int:
    import socket

    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def render(r: dict) -> str:
    if "skipped" in r:
        return f"Skipped: {r['skipped']}."
    base, base_rates = r["rows"]["0"]["rate"], r["rows"]["0"]["rates"]
    head = ["idle connections", "trainer images/s", "vs no attack", "per round (min-max)", "attacker opened /s",
            "server refused /s", "server main process (cores)", "attacker (cores)", "server threads, fds",
            "all over the data plane"]
    rows = []
    for n, x in sorted(r["rows"].items(), key=lambda item: int(item[0])):
        ratios = [a / b for a, b in zip(x["rates"], base_rates)]
        rows.append([f"{int(n):,}", f"{x['rate']:.0f}", f"{x['rate'] / base:.2f}x",
                     f"{min(ratios):.2f}-{max(ratios):.2f}x", f"{x['opened_per_s']:.0f}", f"{x['refused_per_s']:.0f}",
                     f"{x['server_cores']:.2f}", f"{x['attacker_cores']:.2f}", f"{x['threads']}, {x['fds']}",
                     "yes" if x["socket_only"] else "NO"])
    return md_table(head, rows) + (
        f"\n\nFrames (9.6 MB batches of 64), 2 workers, the loader's defaults (data plane through the relay); "
        f"medians of {r['rounds']} alternated rounds of {r['timed']} timed batches (per round: that round's "
        f"images/s against the same round's without attack). The attacker (at nice 19) holds the "
        f"connections from 100 source addresses and opens at most {r['rate_limit']:.0f} a second; the server holds "
        f"1,024 pending at most (the oldest evicted) and closes one without a byte within 2 s. Bytes any attacker "
        f"connection received: {sum(x['attacker_bytes'] for x in r['rows'].values())}.")


def targets(r: dict) -> list[dict]:
    if "skipped" in r:
        return [{"name": "a trainer keeps >= 0.9x its images/s under an idle-connection flood", "passed": None,
                 "detail": r["skipped"]}]
    base = r["rows"]["0"]["rate"]
    out = []
    for n, x in sorted(r["rows"].items(), key=lambda item: int(item[0])):
        if n == "0":
            continue
        out.append({"name": f"{int(n):,} idle connections: the trainer keeps >= 0.9x its images/s",
                    "passed": x["rate"] >= 0.9 * base and x["socket_only"],
                    "detail": f"{x['rate'] / base:.2f}x ({x['rate']:.0f} of {base:.0f} img/s)"
                              + ("" if x["socket_only"] else "; fell back to inline")})
    return out


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, load_note=True)


if __name__ == "__main__":
    sys.exit(main())
