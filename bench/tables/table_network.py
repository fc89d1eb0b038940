"""Table 18: what receiving batches costs the training process, per transport (issue 28).

    python -m bench.tables.table_network [--quick] [--repeats N]

Transports: the socket data plane received by the relay (``transport="socket"``, ``relay=True``:
the tensor bytes on a TCP connection beside the Batches call, read by a process of batchd's own
into a buffer the trainer maps; client/transport/relay.py), the data plane received in the trainer
(``relay=False``: ``recv_into`` a pooled buffer; docs/design/network-path.md), inline TCP
(``transport="inline"``: the bytes in the gRPC messages) and shared memory (``transport="shm"``),
all over loopback to one ``batchd serve`` process.

Part 1, the cost per GB. A server of 2 workers serves ``bench.fixtures.synthetic.Frames`` (ready-made
224 x 224 frames, no pipeline: 9.6 MB batches of 64 cost a worker a copy), so the transport is
what is measured. The training loop runs a fixed pure-Python step (an integer loop that holds
the GIL, calibrated alone to T) per batch, T chosen so that the loop asks for about 0.1, 0.3 and
1 GB/s (T = 96, 32 and 9.6 ms). Per transport and rate, alternated, medians of the rounds:

* trainer CPU s/GB: this process's CPU (every thread, /proc/PID/task/*/schedstat) over the timed
  batches, minus the steps' own (their thread's CPU time) and the harness's noise meter's
  (``bench.measure.trainer_cpu_seconds``: its /proc scans, about 1 ms twice a second, came to
  0.05 s/GB at 0.1 GB/s, charged to every transport alike before), per GB received; the loop also reads
  one byte per page of each batch (``bench.measure.consume``), as any trainer reads its batch;
* step slowdown: the median time of one step inside the loop against the median of as many
  steps run alone just before, with no loader open (what the GIL and the cores the receiving
  takes cost the step);
* server CPU s/GB: the server's main process (gRPC, scheduling, sending; not its workers);
* relay CPU s/GB: the relay process's (the copy the trainer no longer makes: the host still pays it);
* GB/s received (below the offered rate where the transport or the machine cannot keep up).

Part 2, images/s on real work: Table 1's L3 row (photos, pipeline L3, batch 64, 2 workers),
each network transport against shared memory, medians of alternated rounds.

Part 3, the step alone on its question: at 0.3 GB/s, within one open loader, alternated blocks of
steps after receiving and reading a new batch and of steps after reading a batch held in memory
(``_paired``): what batches arriving cost the step beyond reading them (the part-1 ratio also
counts the reading, which an in-memory dataset pays too, and the drift of a shared VM between
the steps alone and the loop). Twice: with the cores shared as the scheduler likes, and with the
loop's thread on a core of its own and everything else, the relay and the server included, on
the other (``bench.placement.loop_alone``; a remote server runs on another host, and a trainer's
host has a spare core for its relay).

Targets (issue 28), on the relayed data plane (the default for CPU batches): trainer <= 0.2 s/GB; a Python-bound step slowed <= 5% at
0.3 GB/s; the data plane >= 0.9x shared memory's images/s on L3; the server's main process
<= 0.3 s/GB sending.
"""

from __future__ import annotations

import contextlib
import sys
import time

from bench import ROOT

from bench import common, placement
from bench.fixtures import data, pipelines
from bench.fixtures.server_proc import ServerProcess
from bench.measure import consume, cpu_seconds, median, time_stream, trainer_cpu_seconds
from bench.noise import measure
from bench.report import md_table

NAME = "table18"
TITLE = "Table 18: the network path: trainer and server CPU per GB, and images/s, per transport"
TRANSPORTS = ("relay", "socket", "inline", "shm")  # relay: transport="socket", relay=True; socket: relay=False
LABELS = {"relay": "data plane, relay", "socket": "data plane, in the trainer", "inline": "TCP inline (gRPC)",
          "shm": "shared memory"}
RATES = (0.1, 0.3, 1.0)  # GB/s offered
STEP_RATE = 0.3  # GB/s offered in part 3 (issue 28's step target)
PLACEMENTS = ("shared", "alone")  # part 3: the scheduler's choice; the loop's thread on a CPU of its own
PAIRED_STEPS, PAIRED_SETTLE = 12, 4  # part 3: steps per block; in-memory steps not counted while the lookahead refills
PLACE_LABELS = {"shared": "cores shared (as parts 1 and 2)", "alone": "the loop's thread on a core of its own"}
BS, SIZE = 64, 224
BATCH_BYTES = BS * SIZE * SIZE * 3 + BS * 8 * 3  # image, label, index, position


class PyStep:
    """A fixed pure-Python step: ``iterations`` of an integer loop (holds the GIL throughout),
    calibrated alone to ``seconds`` (``alone``: its time per call then, median of 7)."""

    def __init__(self, seconds: float):
        probe = 200_000
        per = median(self._time(probe) for _ in range(5)) / probe
        self.iterations = max(1000, round(seconds / per))
        for _ in range(2):  # the long loop runs at another pace than the probe: rescale on it
            self.iterations = max(1000, round(self.iterations * seconds / median(self._time(self.iterations)
                                                                                  for _ in range(3))))
        self.alone = median(self._time(self.iterations) for _ in range(5))
        self.seconds = seconds

    @staticmethod
    def _loop(n: int) -> int:
        x = 0
        for i in range(n):
            x += i & 7
        return x

    def _time(self, n: int) -> float:
        t0 = time.perf_counter()
        self._loop(n)
        return time.perf_counter() - t0

    def __call__(self) -> None:
        self._loop(self.iterations)


def _how(case: str) -> dict:
    """RemoteDataLoader arguments of a case of TRANSPORTS."""
    if case in ("relay", "socket"):
        return {"transport": "socket", "relay": case == "relay"}
    return {"transport": case, "relay": False}


def _relay_cpu() -> float:
    """CPU seconds of this process's relay so far (0 without one)."""
    from batchd.client.transport import relay

    pid = relay.shared().pid
    return cpu_seconds(pid) if pid is not None and relay.shared().alive() else 0.0


def _loader(address: str, case: str, seed: int):
    import batchd

    return batchd.RemoteDataLoader(address, "frames", batch_size=BS, shuffle=True, seed=seed, drop_last=True,
                                   prefetch=4, timeout=120, **_how(case))


def _cost(srv: ServerProcess, transport: str, step: PyStep, batches: int, seed: int) -> dict:
    """One measurement of part 1: the step alone ``batches`` times (no loader open), then ``batches``
    steps timed after 4 warm-up ones with a loader over ``transport``."""
    alone = []
    for _ in range(batches):
        ts = time.perf_counter()
        step()
        alone.append(time.perf_counter() - ts)
    with _loader(srv.address, transport, seed) as loader:
        it = iter(loader)
        # warm-up: about 2.5 s of the loop, long enough for the batches received ahead to reach
        # the loader's lookahead (so the data plane's buffer pool holds all it will need: a
        # long-running loop allocates nothing; tests/client/test_dataplane_client.py)
        for _ in range(max(8, min(150, round(2.5 / step.alone)))):
            b = next(it)
            consume(b)
            step()
            del b
        pool = loader.servers.server.conn.data.pool
        allocated = pool.allocated
        c0, s0, t0, r0 = trainer_cpu_seconds(), cpu_seconds(srv.pid), time.perf_counter(), _relay_cpu()
        inside, step_cpu = [], 0.0
        for _ in range(batches):
            b = next(it)
            consume(b)
            tc, ts = time.thread_time(), time.perf_counter()
            step()
            inside.append(time.perf_counter() - ts)
            step_cpu += time.thread_time() - tc
            del b
        c1, s1, t1, r1 = trainer_cpu_seconds(), cpu_seconds(srv.pid), time.perf_counter(), _relay_cpu()
        allocated = pool.allocated - allocated
    gb = batches * BATCH_BYTES / 1e9
    return {"trainer": (c1 - c0 - step_cpu) / gb, "server": (s1 - s0) / gb, "relay": (r1 - r0) / gb,
            "slowdown": median(inside) / median(alone), "gbps": gb / (t1 - t0), "allocated": allocated}


def _paired(srv: ServerProcess, transport: str, step: PyStep, seed: int, alone_core: bool, blocks: int = 6,
            k: int = PAIRED_STEPS, settle: int = PAIRED_SETTLE) -> float:
    """Part 3, one measurement: within one open loader, ``blocks`` alternated pairs of ``k`` steps,
    each after receiving and reading (``consume``) a new batch, then ``k`` steps each after reading a
    batch held in memory, nothing arriving (the first ``settle`` of those, while the loader refills
    its lookahead, are not counted). Returns the median step of the first kind over the second's:
    what batches arriving cost the step beyond reading them, drift of the machine cancelled by the
    pairing. ``alone_core``: the loop's thread on a CPU of its own, the rest on the others
    (``bench.placement.loop_alone``)."""
    arriving, in_memory = [], []

    def timed(into: list) -> None:
        ts = time.perf_counter()
        step()
        into.append(time.perf_counter() - ts)

    with _loader(srv.address, transport, seed) as loader:
        it = iter(loader)
        for _ in range(max(8, round(2.5 / step.alone))):  # warm-up, as in _cost
            b = next(it)
            consume(b)
            step()
            del b
        with placement.loop_alone() if alone_core else contextlib.nullcontext():
            for _ in range(blocks):
                for _ in range(k):
                    b = next(it)
                    consume(b)
                    del b
                    timed(arriving)
                held = next(it)
                for j in range(settle + k):
                    consume(held)
                    timed(in_memory if j >= settle else [])
                del held
    return median(arriving) / median(in_memory)


def _images(srv: ServerProcess, transport: str, seed: int, warmup: int, timed: int) -> float:
    with common.remote(srv.address, "photos", batch_size=BS, pipeline="L3", workers=2, seed=seed,
                       **_how(transport)) as rl:
        return time_stream(rl, warmup, timed).rate


def run(s, log=print) -> dict:
    rounds = s.pick(max(5, s.repeats), 2)  # (issue 28: medians of 5 alternated rounds)
    batches = {r: s.pick(max(40, int(60 * r / 0.3)), max(12, int(20 * r / 0.3))) for r in RATES}
    steps = {r: PyStep(BATCH_BYTES / (r * 1e9)) for r in RATES}
    log("  table18: steps alone " + ", ".join(f"{steps[r].alone * 1e3:.1f} ms at {r:g} GB/s" for r in RATES))
    cost: dict[tuple[float, str], list[dict]] = {}
    paired: dict[tuple[str, str], list[float]] = {}
    frames = {"frames": {"kind": "python", "factory": "bench.fixtures.synthetic:Frames"}}
    with ServerProcess(datasets=frames, workers=2, cache_dir=data.CACHE,
                       extra={"python_path": [str(ROOT)], "max_slots": 32}) as srv:
        for t in TRANSPORTS:  # first use: workers warm, buffers and connections made
            _cost(srv, t, steps[RATES[0]], 4, seed=1)
        for rnd in range(rounds):
            for ri, r in enumerate(RATES):
                k = (rnd + ri) % len(TRANSPORTS)
                order = TRANSPORTS[k:] + TRANSPORTS[:k]
                for t in order:
                    cost.setdefault((r, t), []).append(
                        measure(lambda: _cost(srv, t, steps[r], batches[r], seed=100 * rnd + ri)))
            log(f"  table18: cost round {rnd + 1}/{rounds} done")
        placements = PLACEMENTS if placement.possible() else PLACEMENTS[:1]
        for rnd in range(rounds):  # part 3
            for pi, where in enumerate(placements):
                k = (rnd + pi) % len(TRANSPORTS)
                for t in TRANSPORTS[k:] + TRANSPORTS[:k]:
                    paired.setdefault((where, t), []).append(measure(
                        lambda: _paired(srv, t, steps[STEP_RATE], 500 + rnd, alone_core=where == "alone")))
            log(f"  table18: paired round {rnd + 1}/{rounds} done")
    rows = [{"rate": r, "transport": t, **{k: median(x[k] for x in cost[(r, t)])
                                           for k in ("trainer", "server", "relay", "slowdown", "gbps")},
             "allocated": sum(x["allocated"] for x in cost[(r, t)])}
            for r in RATES for t in TRANSPORTS]

    data.ensure_photos()
    cfg = common.photos_config()
    timed, warmup = s.pick(24, 8), 4
    rates: dict[str, list[float]] = {}
    with ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=pipelines.presets(["L3"]), workers=2,
                       cache_dir=data.CACHE) as srv:
        for t in TRANSPORTS:
            _images(srv, t, 1, 0, 2)
        for rnd in range(rounds):
            k = rnd % len(TRANSPORTS)
            order = TRANSPORTS[k:] + TRANSPORTS[:k]
            for t in order:
                rates.setdefault(t, []).append(measure(lambda: _images(srv, t, 1000 + rnd, warmup, timed)))
            log(f"  table18: L3 round {rnd + 1}/{rounds} done")
    images = {t: median(v) for t, v in rates.items()}
    return {"rows": rows, "paired": {f"{w}/{t}": median(v) for (w, t), v in paired.items()},
            "paired_rounds": {f"{w}/{t}": v for (w, t), v in paired.items()}, "images": images,
            "images_rounds": rates, "rounds": rounds, "batches": batches,
            "steps_alone": {r: steps[r].alone for r in RATES}, "l3_timed": timed * BS}


def render(r: dict) -> str:
    head = ["offered", "transport", "trainer CPU s/GB", "step vs alone", "server main CPU s/GB", "relay CPU s/GB",
            "GB/s received"]
    rows = [[f"{x['rate']:g} GB/s", LABELS[x["transport"]], f"{x['trainer']:.3f}", f"{x['slowdown']:.3f}x",
             f"{x['server']:.3f}", f"{x['relay']:.3f}" if x["transport"] == "relay" else "-", f"{x['gbps']:.2f}"]
            for x in r["rows"]]
    shm = r["images"]["shm"]
    img = md_table(["transport (L3, 2 workers, batch 64)", "images/s", "vs shared memory"],
                   [[LABELS[t], f"{v:.0f}", f"{v / shm:.2f}x"] for t, v in r["images"].items()])
    steps = ", ".join(f"{v * 1e3:.1f} ms" for v in r["steps_alone"].values())
    paired = r.get("paired", {})
    wheres = [w for w in PLACEMENTS if any(key.startswith(w + "/") for key in paired)]
    step = md_table([f"step at {STEP_RATE:g} GB/s: batches arriving vs a batch in memory"]
                    + [LABELS[t] for t in TRANSPORTS],
                    [[PLACE_LABELS[w]] + [f"{paired[f'{w}/{t}']:.3f}x" for t in TRANSPORTS] for w in wheres])
    return (md_table(head, rows) + f"\n\n{img}\n\n" + (f"{step}\n\n" if wheres else "") +
            f"Part 1: 9.6 MB batches (64 x 224 x 224 x 3 ready-made frames, 2 workers); a pure-Python step per batch "
            f"({steps} alone, for 0.1, 0.3 and 1 GB/s offered); trainer CPU is this process's beyond the steps' own "
            f"and the benchmark's noise meter's; "
            f"the server's is its main process's (not its workers'); the relay's is the relay process's; after about "
            f"2.5 s of warm-up, the data plane allocated "
            f"{sum(x['allocated'] for x in r['rows'] if x['transport'] in ('relay', 'socket'))} receive buffers in "
            f"the timed batches (0: all reused). Part 2: {r['l3_timed']} images timed per round. "
            f"Part 3: within one open loader, alternated blocks of {PAIRED_STEPS} steps after receiving and reading "
            f"a new batch and {PAIRED_STEPS} after reading a batch held in memory (nothing arriving; the first "
            f"{PAIRED_SETTLE} of those, while the lookahead refills, not counted), ratio of their median steps; a core "
            f"of its own: the loop's thread on one CPU, everything else (the loader's threads, the relay, the "
            f"server and its workers) on the other, as with a remote server and a spare core for the relay. "
            f"Medians of {r['rounds']} alternated rounds; loopback, one machine: the server's workers and the "
            f"trainer share its cores.")


def _row(r: dict, rate: float, transport: str) -> dict:
    return next(x for x in r["rows"] if x["rate"] == rate and x["transport"] == transport)


def targets(r: dict) -> list[dict]:
    new = [x for x in r["rows"] if x["transport"] == "relay"]
    worst = max(x["trainer"] for x in new)
    at03 = _row(r, 0.3, "relay")
    ratio = r["images"]["relay"] / r["images"]["shm"]
    server = max(x["server"] for x in new)

    def others(key: str, fmt: str, rate: float | None = None) -> str:
        rates = RATES if rate is None else (rate,)
        return "; ".join(f"{LABELS[t]}: " + ", ".join(fmt.format(_row(r, q, t)[key]) for q in rates)
                         for t in ("socket", "inline", "shm"))

    return [
        {"name": "data plane (relay): trainer CPU <= 0.2 s/GB received", "passed": worst <= 0.2,
         "detail": ", ".join(f"{x['trainer']:.3f} at {x['rate']:g} GB/s" for x in new)
                   + f" ({others('trainer', '{:.3f}')})"},
        {"name": "data plane (relay): a Python-bound step slowed <= 5% at 0.3 GB/s", "passed": at03["slowdown"] <= 1.05,
         "detail": f"{at03['slowdown']:.3f}x ({others('slowdown', '{:.3f}x', 0.3)})"},
        *([{"name": "data plane (relay): the same step slowed <= 5% by batches arriving at 0.3 GB/s beyond reading "
                    "them, the loop's thread on a core of its own (part 3)",
            "passed": r["paired"]["alone/relay"] <= 1.05,
            "detail": f"{r['paired']['alone/relay']:.3f}x (" + "; ".join(
                f"{LABELS[t]}: {r['paired']['alone/' + t]:.3f}x" for t in TRANSPORTS[1:]) + "; cores shared: "
                      + ", ".join(f"{LABELS[t]} {r['paired']['shared/' + t]:.3f}x" for t in TRANSPORTS) + ")"}]
          if "alone/relay" in r.get("paired", {}) else []),
        {"name": "data plane (relay) >= 0.9x shared memory's images/s (L3, 2 workers)", "passed": ratio >= 0.9,
         "detail": f"{ratio:.2f}x ({r['images']['relay']:.0f} vs {r['images']['shm']:.0f} img/s; in the trainer "
                   f"{r['images']['socket'] / r['images']['shm']:.2f}x, inline "
                   f"{r['images']['inline'] / r['images']['shm']:.2f}x)"},
        {"name": "server main process <= 0.3 s/GB sending (data plane)", "passed": server <= 0.3,
         "detail": ", ".join(f"{x['server']:.3f} at {x['rate']:g} GB/s" for x in new)},
    ]


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, photos=True)


if __name__ == "__main__":
    sys.exit(main())
