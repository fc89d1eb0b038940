"""Table 10: decode once, augment many times (the decoded-sample cache; photo set, L3, batch 64, 2 workers).

    python -m bench.tables.table_cache [--quick]

Every scenario starts a fresh server (its own cache settings) and runs clients as separate
processes (``--client``: imports torch, connects, reads its first batch, then waits for "go"
on stdin so import and connection time are never timed); a client reads 3 epochs (the server's
shuffle differs per epoch) and prints images/s per epoch. Scenarios:

* off: no cache;
* RAM: ``cache.memory_bytes`` holds every prefix output (decoded JPEG + Resize(256, 256));
* 1/4 RAM + disk: RAM for a quarter of them, the rest spilled to ``cache.disk_dir``;
* 1/4 RAM + disk, lz4: the same with ``cache.compress`` (lz4 where it saves 10%);
* two experiments: on the RAM server once it is warm, L3 and L2 (same prefix, different random
  rests) read one epoch each at once; each is compared with itself reading alone.

Targets (issue "Decode once, augment many times"): epochs 2 and 3 >= 2.5x epoch 1 with the cache
in RAM; >= 1.5x with a quarter in RAM plus disk; two experiments at once each >= 0.8x alone.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

from bench import common, module_argv, module_env
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.report import md_table

NAME = "table10"
TITLE = "Table 10: decoded-sample cache (L3, batch 64, 2 workers; images/s per epoch, 3 epochs)"
BATCH = 64
WORKERS = 2
EPOCHS = 3
ENTRY_BYTES = 256 * 256 * 3 + 48  # one cached prefix output: Resize(256, 256), uint8 RGB, plus its header
WARM = 128                          # photos of the warm-up dataset, read before epoch 1 is timed
OVERHEAD = 4 << 20                 # header, counters and table of a cache this size (generous)


def subset_manifest(count: int, last: bool = False) -> pathlib.Path:
    """A CSV of the first (or ``last``) ``count`` photos (the whole set for count >= 3000)."""
    files = data.photo_files()
    files = files[-count:] if last else files[:count]
    out = data.DATA / f"photos_{'last' if last else 'first'}{len(files)}.csv"
    text = "path,label\n" + "".join(f"photos/{f},{int(f.split('/')[0].split('_')[1])}\n" for f in files)
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return out


def client_main(args: argparse.Namespace) -> int:
    import batchd

    if args.warm:  # start the workers' imports, dataset and pipeline set-up on another dataset
        with batchd.RemoteDataLoader(args.address, "warm", batch_size=BATCH, transform=args.pipeline, timeout=300) as w:
            for _ in w:
                pass
    loader = batchd.RemoteDataLoader(args.address, "photos", batch_size=BATCH, shuffle=True, seed=args.seed,
                                     drop_last=True, transform=args.pipeline, prefetch=2 * WORKERS, timeout=300)
    print("ready", flush=True)
    sys.stdin.readline()
    rates = []
    for _ in range(args.epochs):
        t0 = time.perf_counter()
        images = 0
        for batch in loader:
            images += batch["image"].shape[0]
            del batch
        rates.append(images / (time.perf_counter() - t0))
    print(json.dumps({"rates": rates}), flush=True)
    loader.close()
    return 0


def _clients(address: str, specs: list[dict]) -> list[list[float]]:
    """Run one client process per spec, together; returns each one's images/s per epoch."""
    procs = []
    for spec in specs:
        cmd = module_argv("bench.tables.table_cache", "--client", "--address", address, "--pipeline", spec["pipeline"],
                          "--seed", str(spec["seed"]), "--epochs", str(spec["epochs"])) + (["--warm"] if spec.get("warm") else [])
        procs.append(subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      env=module_env(dict(os.environ, OMP_NUM_THREADS="1"))))
    for p in procs:
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"client did not start: {line!r} (exit {p.poll()})")
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    for p in procs:
        text, _ = p.communicate(timeout=1200)
        out.append(json.loads(text.strip().splitlines()[-1])["rates"])
    return out


def run(s, log=print) -> dict:
    data.ensure_photos()
    count = 1280 if s.quick else data.PHOTO_COUNT
    manifest = subset_manifest(count)
    datasets = {"photos": {"kind": "manifest", "path": str(manifest)},
                "warm": {"kind": "manifest", "path": str(subset_manifest(WARM, last=True))}}
    presets = pipelines.presets(("L2", "L3"))
    full = (count + WARM) * ENTRY_BYTES + OVERHEAD  # the warm-up's entries come first and stay
    quarter = (count // 4 + WARM) * ENTRY_BYTES + OVERHEAD
    disk = pathlib.Path(tempfile.mkdtemp(prefix="batchd-bench-cache-"))
    scenarios = {
        "off": None,
        "RAM": {"memory_bytes": full},
        "1/4 RAM + disk": {"memory_bytes": quarter, "disk_dir": str(disk / "a"), "disk_bytes": 2 * full},
        "1/4 RAM + disk, lz4": {"memory_bytes": quarter, "disk_dir": str(disk / "b"), "disk_bytes": 2 * full,
                                "compress": True},
    }
    result: dict = {"images": count, "scenarios": {}, "stats": {}}
    try:
        for i, (name, cache) in enumerate(scenarios.items()):
            extra = {"share_window": 16, **({"cache": cache} if cache else {})}
            with ServerProcess(datasets=datasets, pipelines=presets, workers=WORKERS, cache_dir=data.CACHE,
                               extra=extra) as server:
                (rates,) = _clients(server.address, [{"pipeline": "L3", "seed": 10 + i, "epochs": EPOCHS, "warm": True}])
                result["scenarios"][name] = rates
                log(f"  {NAME}: {name}: " + ", ".join(f"{r:.0f}" for r in rates) + " img/s")
                if name == "RAM":  # warm: each experiment alone, then both at once
                    (alone_l2,) = _clients(server.address, [{"pipeline": "L2", "seed": 50, "epochs": 1}])
                    (alone_l3,) = _clients(server.address, [{"pipeline": "L3", "seed": 51, "epochs": 1}])
                    pair = _clients(server.address, [{"pipeline": "L3", "seed": 52, "epochs": 1},
                                                     {"pipeline": "L2", "seed": 53, "epochs": 1}])
                    result["two"] = {"alone": [alone_l3[0], alone_l2[0]], "together": [pair[0][0], pair[1][0]]}
                    log(f"  {NAME}: two experiments: alone L3 {alone_l3[0]:.0f}, L2 {alone_l2[0]:.0f}; "
                        f"together {pair[0][0]:.0f}, {pair[1][0]:.0f} img/s")
    finally:
        shutil.rmtree(disk, ignore_errors=True)
    return result


def _speedup(rates: list[float]) -> float:
    return min(rates[1:]) / rates[0]


def targets(r: dict) -> list[dict]:
    sc, two = r["scenarios"], r["two"]
    rows = [
        ("cache in RAM: epochs 2-3 >= 2.5x epoch 1", _speedup(sc["RAM"]), 2.5),
        ("1/4 in RAM + disk: epochs 2-3 >= 1.5x epoch 1",
         max(_speedup(sc["1/4 RAM + disk"]), _speedup(sc["1/4 RAM + disk, lz4"])), 1.5),
        ("two experiments at once (warm cache): each >= 0.8x one alone without the cache (epochs 2-3)",
         min(two["together"]) / min(sc["off"][1:]), 0.8),
    ]
    return [{"passed": v >= limit, "name": n, "detail": f"{v:.2f}x"} for n, v, limit in rows]


def render(r: dict) -> str:
    rows = []
    for name, rates in r["scenarios"].items():
        rows.append([name, *(f"{x:.0f}" for x in rates), f"{_speedup(rates):.2f}x"])
    table = md_table(["cache", *(f"epoch {e + 1} img/s" for e in range(EPOCHS)), "epochs 2-3 vs 1 (min)"], rows)
    two = r["two"]
    off = min(r["scenarios"]["off"][1:])
    pair = md_table(["experiment (warm RAM cache)", "alone img/s", "together img/s", "together / alone",
                     "together / L3 alone without cache"],
                    [[p, f"{a:.0f}", f"{t:.0f}", f"{t / a:.2f}x", f"{t / off:.2f}x"]
                     for p, a, t in zip(("L3", "L2"), two["alone"], two["together"])])
    return "\n".join([table, "", pair, "", f"One run, {r['images']} photos (manifest), each scenario on a fresh "
                      "server; 1/4 RAM holds a quarter of the prefix outputs, the rest goes to a disk directory "
                      "in /tmp. L2 and L3 share the prefix (decode + Resize(256, 256)) and differ in the rest. Each client "
                      f"first reads a {WARM}-photo warm-up dataset (worker set-up is not timed). Two experiments share "
                      "the same workers: with CPU-bound workers each gets at most 0.5x of what it gets alone with "
                      "the same warm cache; the target compares with one experiment alone without the cache."])


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help=argparse.SUPPRESS)
    p.add_argument("--pipeline", default="L3", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, default=EPOCHS, help=argparse.SUPPRESS)
    p.add_argument("--warm", action="store_true", help=argparse.SUPPRESS)


def main(argv=None) -> int:
    return common.table_or_client_main(sys.modules[__name__], argv, client_args=_client_args)


if __name__ == "__main__":
    sys.exit(main())
