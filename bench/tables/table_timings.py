"""Table 14: what per-batch timings cost (issue 21 §1: under 1% of throughput).

    python -m bench.tables.table_timings [--quick] [--repeats N]

Every batch carries its timings (``BatchTimings``) and the client adds its own; the code that does
it runs in four places. A. We time that code itself, in this process, with the real functions
and the calls each batch makes (timeit-style, best of ``repeats`` runs of many batches):

* worker: ``StageClock`` as the worker calls it (4 ``enter`` and a ``pause`` per timed sample onto a
  real ``StageBoard`` segment, one sample in ``every`` timed with ``every`` as the clock picks it
  for the work per sample measured in B, the guards on the others, ``start``, ``stop``) and the
  timings dict (less the bare loop over the samples, which the worker runs anyway);
* pool (server main process): the worker's busy flag twice, the timings merge;
* server main process: ``WireTimings`` built, summed per stage, encoded (``encode_timings``);
* client: the message's timings parsed (``decode_timings``), ``BatchTimes``, the receiver's
  clock reads, the wait range (``client.timings.waiting``), ``LoopTimings.add`` and the call
  record's ``loop_waited``.

B. Against what a batch costs: a real server (2 workers) and loader over Fashion-MNIST's training
split with ``FMNIST_PIPELINE`` (resized to 128 x 128, flipped, brightness and contrast; batch 64)
and with no pipeline (batch 256: the least work per sample, so the largest relative cost); CPU
seconds of the whole process tree (server, workers, client) per batch over the timed window. The cost to throughput of a machine whose cores are all busy is
added CPU / CPU per batch; that is the table's last column. (An end-to-end A/B of images/s
would need the two runs to differ by under 1%, far below this machine's run-to-run spread.)
"""

from __future__ import annotations

import os
import sys
import time
import timeit

import albumentations as A

from bench import common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, time_stream
from bench.noise import measure
from bench.report import md_table

NAME = "table14"
NEEDS_PHOTOS = False  # Fashion-MNIST only (bench/run_all.py)
TITLE = "Table 14: the cost of per-batch timings (CPU per batch, against a batch's own)"
TARGET = 0.01  # of throughput
FMNIST = {"kind": "fashion-mnist", "root": "/usr/share/datasets/fashion-mnist", "split": "train"}
FMNIST_PIPELINE = A.Compose([A.Resize(128, 128), A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=1.0)])
WORKLOADS = (("resize128", 64), (None, 256))  # (preset, batch size)


def _worker_cost(samples: int, work_per_sample: float, reads: bool) -> float:
    """Seconds per batch of ``samples`` samples of ``work_per_sample`` seconds each: the worker's clock
    as the worker calls it (one sample in ``every`` timed, ``every`` adapted to the work per sample),
    its board, the timings dict, the reader's io sums (``reads``: a dataset read from storage; Fashion-MNIST
    is in memory). The work itself is not counted."""
    from batchd.server.compute.stages import DECODE, PIPELINE, READ, WRITE, StageBoard, StageClock
    from batchd.server.data.reader import SampleReader, _Reads

    board = StageBoard.create(f"batchd-bench-{os.getpid()}-", 4)
    try:
        clock, reader = StageClock(board, 1), SampleReader(4)
        io = _Reads(lambda i: b"", range(samples))
        # what every is for this work (the clock adapts it after each batch from the loop's time)
        clock.every = max(1, min(samples, -(-clock._cost // (clock.BUDGET * work_per_sample))))

        def batch():
            clock.start(PIPELINE)
            every = clock.every
            for _ in clock.samples(samples, WRITE):  # the worker's loop (server/compute/stages.py)
                on = clock.on
                if on:
                    clock.enter(READ)
                if reads:
                    reader._add_io(io, 1e-5)
                if on:
                    clock.enter(DECODE)
                if on:
                    clock.enter(PIPELINE)
                if on:
                    clock.enter(WRITE)
            clock.every = every  # (here the loop's time is not the work's)
            return {**clock.stop(), "read_io": io.io_seconds, "started": clock.started, "cache_hits": 0.0}

        def bare():  # the loop the worker runs anyway: not the timings' cost
            for _ in range(samples):
                pass

        return max(0.0, _best(batch, number=200) - _best(bare, number=200))
    finally:
        board.close()


def _server_cost() -> float:
    """Seconds per batch in the server's main process: pool bookkeeping, the timings built and encoded."""
    from batchd import wire
    from batchd.server.compute.stages import work_seconds
    from batchd.server.compute.rates import BusyClock
    from batchd.server.serve.transport import STAGE_FIELDS

    busy, sums = BusyClock(), dict.fromkeys(STAGE_FIELDS, 0.0)
    timings = {"read": 1e-3, "decode": 2e-3, "pipeline": 3e-3, "cache": 0.0, "write": 1e-4, "read_io": 2e-3,
               "started": time.monotonic(), "cache_hits": 0.0}

    def batch():
        busy.set(True)
        work_seconds(timings)
        t = {**timings, "queued": 1e-4, "worker": 1}
        busy.set(False)
        w = wire.WireTimings(
            queued_seconds=t["queued"], read_seconds=t["read"], decode_seconds=t["decode"],
            pipeline_seconds=t["pipeline"], cache_seconds=t["cache"], write_seconds=t["write"], reorder_seconds=1e-3,
            send_seconds=time.perf_counter() - t["started"], read_io_seconds=t["read_io"],
            cache_hits=int(t["cache_hits"]), worker=int(t["worker"]), workers_busy_ratio=0.5)
        for stage, name in STAGE_FIELDS.items():
            sums[stage] += getattr(w, name)
        return wire.encode_timings(w)

    return _best(batch)


def _client_cost() -> float:
    """Seconds per batch in the client: the timings parsed, its own stages, the loop's accounting."""
    from batchd import wire
    from batchd.client.transport.leases import CallRecord
    from batchd.client.loader.timings import BatchTimes, LoopTimings, delivered, take_delivered, waiting

    encoded = memoryview(wire.encode_timings(wire.WireTimings(*[1e-3] * 9, 3, 1, 0.5)))
    loop, record = LoopTimings(), CallRecord("bench")
    loop.begin(0)

    def batch():
        t0 = time.perf_counter()
        server = wire.decode_timings(encoded)
        t1 = time.perf_counter()
        times = BatchTimes(server, receive=t1 - t0)
        times.unpack = time.perf_counter() - t1
        delivered(times, record, 8)
        asked = time.perf_counter()
        waiting(lambda: None, cuda=False)
        handed = time.perf_counter()
        times, rec, _ = take_delivered()
        wait = loop.add(handed - asked, 1e-3, times, rec)
        rec.loop_waited(wait, 1e-3, "trainer-bound")

    return _best(batch)


def _best(fn, number: int = 2000, repeat: int = 5) -> float:
    """The least CPU seconds (this thread's: time another process took is not counted) per call over
    ``repeat`` runs of ``number`` calls (timeit's advice: the least is the cost, the rest is noise)."""
    return min(timeit.Timer(fn, timer=time.thread_time).repeat(number=number, repeat=repeat)) / number


def _batch_cpu(s, pipeline: str | None, batch: int) -> dict:
    """CPU seconds (server tree + this client) and wall seconds per batch, real server and loader."""
    presets = {"resize128": A.to_dict(FMNIST_PIPELINE)} if pipeline else {}
    timed = s.pick(60, 16) if pipeline else s.pick(150, 40)
    runs = []
    with ServerProcess(datasets={"fmnist": FMNIST}, pipelines=presets, workers=2, cache_dir=data.CACHE) as srv:
        for rep in range(s.repeats):
            with common.remote(srv.address, "fmnist", batch_size=batch, pipeline=pipeline, workers=2, transport="shm",
                               seed=rep) as rl:
                marks = []  # the workers' seconds before and after the timed window (the loader's profile)

                def work():
                    marks.append(sum(rl.profile()["stages"][k] for k in ("read", "decode", "pipeline", "cache", "write")))

                t = measure(lambda: time_stream(rl, 4, timed, on_start=work, on_end=work))
            runs.append({"cpu_per_batch": t.cpu / timed, "wall_per_batch": t.seconds / timed, "rate": t.rate,
                         "work_per_sample": (marks[-1] - marks[-2]) / (timed * batch)})
    return {k: median(r[k] for r in runs) for k in ("cpu_per_batch", "wall_per_batch", "rate", "work_per_sample")}


def run(s, log=print) -> dict:
    rows = []
    client, server = _client_cost(), _server_cost()
    for pipeline, batch in WORKLOADS:
        real = _batch_cpu(s, pipeline, batch)
        worker = _worker_cost(batch, real["work_per_sample"], reads=False)
        added = worker + server + client
        name = "fmnist"
        rows.append({"dataset": name, "pipeline": pipeline or "none", "batch": batch, "worker_s": worker,
                     "server_s": server, "client_s": client, "added_s": added, **real,
                     "share": added / real["cpu_per_batch"]})
        log(f"  table14: {name} ({pipeline}): worker {real['work_per_sample'] * 1e6:.1f} us per sample; "
            f"{added * 1e6:.0f} us added per batch, {real['cpu_per_batch'] * 1e3:.1f} ms CPU "
            f"per batch ({added / real['cpu_per_batch']:.3%})")
    return {"rows": rows, "repeats": s.repeats, "cpus": os.cpu_count() or 1}


def render(r: dict) -> str:
    head = ["dataset (pipeline, batch)", "worker", "server main", "client", "added CPU / batch",
            "CPU / batch (all processes)", "images/s", "cost to throughput"]
    table = [[f"{x['dataset']} ({x['pipeline']}, {x['batch']})", f"{x['worker_s'] * 1e6:.0f} us",
              f"{x['server_s'] * 1e6:.0f} us", f"{x['client_s'] * 1e6:.0f} us", f"{x['added_s'] * 1e6:.0f} us",
              f"{x['cpu_per_batch'] * 1e3:.1f} ms", f"{x['rate']:,.0f}", f"{x['share']:.2%}"] for x in r["rows"]]
    return md_table(head, table) + (
        f"\n\nAdded CPU: the timing code's own calls per batch, this thread's CPU time, least of 5 runs of many "
        f"batches in one process; CPU per "
        f"batch: utime + stime of the server, its workers and the client over the timed window (2 workers, shared "
        f"memory, median of {r['repeats']}); {r['cpus']} CPUs. When every core is busy, throughput falls by the "
        f"added CPU over the CPU per batch. The worker times one sample in `every` (StageClock: about 0.1% of the "
        f"work per sample, every sample once they take milliseconds) and spreads the batch's loop time over the "
        f"stages by those; everything else is per batch.")


def targets(r: dict) -> list[dict]:
    worst = max(r["rows"], key=lambda x: x["share"])
    return [{"name": f"per-batch timings cost under {TARGET:.0%} of throughput", "passed": worst["share"] < TARGET,
             "detail": f"at most {worst['share']:.2%} ({worst['dataset']}: {worst['added_s'] * 1e6:.0f} us of "
                       f"{worst['cpu_per_batch'] * 1e3:.1f} ms CPU per batch)"}]


def main(argv=None) -> int:
    return common.table_main(sys.modules[__name__], argv, per="workload")


if __name__ == "__main__":
    sys.exit(main())
