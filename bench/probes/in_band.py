"""What the data connection takes off the gRPC call: Batch messages in band and control frames,
on and off, for the trainer, the server and the relay.

    python -m bench.probes.in_band [--quick] [--repeats N]

Table 18's part 1 (``bench.tables.table_network._cost``: 9.6 MB batches of ready-made frames, a
pure-Python step per batch, the relay's data plane) at 0.1 and 0.3 GB/s, the same build three
times in alternation: as shipped (each batch's message in front of its payload on the data
connection, and the loop's grants, revokes and progress as frames there:
docs/design/network-path.md); with the messages on the call (the client's ``open`` does not ask
for ``data_messages``, as before in-band messages); and with the control frames' offer ignored
too (``batchd.client.transport.call``'s check of it replaced by one that says no: everything on the call,
as before control frames). Medians of the rounds: trainer, server main process and relay CPU
per GB, and the step's slowdown, as Table 18 counts them.
"""

from __future__ import annotations

import sys

from bench import ROOT
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median
from bench.noise import measure
from bench.report import md_table

NAME = "in_band"
TITLE = "Batch messages and control frames on the data connection, on and off: trainer, server and relay CPU per GB"
RATES = (0.1, 0.3)
MODES = ("in band", "frames", "call")  # messages and grants on the data connection; grants only; neither
KEYS = ("trainer", "server", "relay", "slowdown")


def run(s, log=print) -> dict:
    from batchd.client.transport import call
    from batchd.client.transport import connection
    from bench.tables import table_network as tn

    offered, request = call.datawire.controls, connection.ServerConnection.request

    def on_the_call(self, *a, **k):  # the messages on the call: the client does not ask for them in band
        r = request(self, *a, **k)
        r.data_messages = False
        return r

    rounds = s.pick(max(3, s.repeats), 1)
    batches = {r: s.pick(max(40, int(60 * r / 0.3)), 12) for r in RATES}
    steps = {r: tn.PyStep(tn.BATCH_BYTES / (r * 1e9)) for r in RATES}
    got: dict[tuple[float, str], list[dict]] = {}
    frames = {"frames": {"kind": "python", "factory": "bench.fixtures.synthetic:Frames"}}
    with ServerProcess(datasets=frames, workers=2, cache_dir=data.CACHE,
                       extra={"python_path": [str(ROOT)], "max_slots": 32}) as srv:
        tn._cost(srv, "relay", steps[RATES[0]], 4, seed=1)  # workers warm, the relay started
        try:
            for rnd in range(rounds):
                for k, mode in enumerate(MODES[rnd % 3:] + MODES[:rnd % 3]):
                    call.datawire.controls = offered if mode != "call" else (lambda metadata: False)
                    connection.ServerConnection.request = request if mode == "in band" else on_the_call
                    for r in RATES:
                        got.setdefault((r, mode), []).append(
                            measure(lambda: tn._cost(srv, "relay", steps[r], batches[r], seed=100 * rnd + k)))
                log(f"  {NAME}: round {rnd + 1}/{rounds} done")
        finally:
            call.datawire.controls, connection.ServerConnection.request = offered, request
    rows = {(r, m): {key: median(x[key] for x in got[(r, m)]) for key in KEYS} for r in RATES for m in MODES}
    return {"rows": [{"rate": r, "mode": m, **rows[(r, m)]} for r in RATES for m in MODES], "rounds": rounds,
            "batches": batches}


def render(r: dict) -> str:
    head = ["offered", "on the data connection", "trainer CPU s/GB", "server main CPU s/GB", "relay CPU s/GB",
            "step vs alone"]
    label = {"in band": "Batch messages and grants", "frames": "grants (messages on the call)",
             "call": "nothing (all on the call)"}
    rows = [[f"{x['rate']:g} GB/s", label[x["mode"]], f"{x['trainer']:.3f}", f"{x['server']:.3f}",
             f"{x['relay']:.3f}", f"{x['slowdown']:.3f}x"] for x in r["rows"]]
    return md_table(head, rows) + (
        f"\n\nTable 18's part 1 through the relay (9.6 MB batches, a pure-Python step per batch; "
        f"{', '.join(str(v) for v in r['batches'].values())} batches timed); medians of {r['rounds']} alternated "
        f"rounds.")


def targets(r: dict) -> list[dict]:
    def row(rate, mode):
        return next(x for x in r["rows"] if x["rate"] == rate and x["mode"] == mode)

    return [{"name": f"in-band messages save the {who} CPU at {rate:g} GB/s", "passed":
             row(rate, "in band")[key] < row(rate, "frames")[key],
             "detail": f"{row(rate, 'in band')[key]:.3f} vs {row(rate, 'frames')[key]:.3f} s/GB"}
            for rate in RATES for who, key in (("trainer", "trainer"), ("server's main", "server"))]


def main(argv=None) -> int:
    """Run the probe, print the table, keep it in results.json and write its fragment
    (``fragments/in_band.md``, which docs/design/network-path.md includes)."""
    import argparse
    import pathlib
    import time

    from bench import fragments, noise
    from bench.measure import pin_threads
    from bench.settings import Settings

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer batches, 1 round (not saved)")
    ap.add_argument("--repeats", type=int, help="rounds (default 3)")
    ap.add_argument("--out", type=pathlib.Path, default=ROOT / "bench" / "results",
                    help="results folder: results.json and fragments/ (default bench/results)")
    args = ap.parse_args(argv)
    settings = Settings(quick=args.quick, repeats=args.repeats or (1 if args.quick else 3))
    pin_threads()
    noise.configure(budget_s=5.0 if args.quick else 60.0)
    meter = noise.NoiseMeter()
    meter.start()
    t0 = time.perf_counter()
    r = run(settings)
    seconds = time.perf_counter() - t0
    meter.stop()
    print(f"\n## {TITLE}\n\n{render(r)}\n")
    for t in targets(r):
        print(f"- {'PASS' if t['passed'] else 'FAIL'} {t['name']}: {t['detail']}")
    if not args.quick:
        folder = fragments.keep_probe(args.out, NAME, r, seconds=seconds, foreign_cpu_s=meter.seconds())
        print(f"\nwrote {args.out / 'results.json'} and {folder / (NAME + '.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
