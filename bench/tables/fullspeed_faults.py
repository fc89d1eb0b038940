"""Table 17's failure rows (bench/tables/table_fullspeed.py): a server stopped for good in the
middle of an epoch (``hung``), and one stopped 2 s of every 3 s (``stalled``); every batch's wait
timed, every sample checked to come exactly once.
"""

from __future__ import annotations

import itertools
import signal
import time

import numpy as np

from batchd.client.transport.server_stats import get_stats
from bench.fixtures.server_proc import ServerProcess
from bench.tables.fullspeed_servers import _loader
from tests.stalls import Stalls

HUNG_N = 1600  # samples per epoch of the hung rows (400 batches of 4)
HUNG_AT = 30  # the batch of the timed epoch at which one server is stopped for good
HUNG_TIMEOUT = 20.0
HUNG_SECONDS = 0.005  # per sample: 20 ms per batch per worker
STALL_BATCH = 4  # stall rows: 4 x 5 ms = 20 ms a batch, 50 batches/s per server
STALL_S, PERIOD_S = 2.0, 3.0


def _epoch(it, on_batch=None) -> tuple[list[int], list[float]]:
    """One epoch from a fresh iterator ``it``: its sample indices and the wait for each batch (s)."""
    indices, waits = [], []
    for k in itertools.count():
        if on_batch is not None:
            on_batch(k)
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return indices, waits
        waits.append(time.perf_counter() - t0)
        indices.extend(batch["index"].tolist())


def hung(pair: list[ServerProcess]) -> dict:
    """One of ``pair`` (the second) stopped for good at batch ``HUNG_AT`` of an epoch; that epoch
    and the next timed (an untimed epoch first: connected, build times known)."""
    live, stopped = pair
    addresses = [live.address, stopped.address]
    stops = []

    def stop_at(k: int) -> None:
        if k == HUNG_AT and not stops:
            stopped.send_signal(signal.SIGSTOP)
            stops.append(time.perf_counter())

    ok = True
    try:
        with _loader(addresses, batch_size=STALL_BATCH, transport="inline", timeout=HUNG_TIMEOUT) as ld:
            ok &= sorted(_epoch(iter(ld))[0]) == list(range(HUNG_N))
            indices, waits = _epoch(iter(ld), stop_at)
            hung_stats = dict(ld.stats()["servers"][stopped.address])
            ok &= sorted(indices) == list(range(HUNG_N))
            indices, more = _epoch(iter(ld))
            ok &= sorted(indices) == list(range(HUNG_N))
            figures = ld.stats()
            t_close = time.perf_counter()
        close_s = time.perf_counter() - t_close
    finally:
        stopped.send_signal(signal.SIGCONT)
    for p in pair:
        p.wait_idle()
    w = np.array(waits + more)
    return {"max": float(w.max()), "p99": float(np.percentile(w, 99)), "batches": len(w), "once": bool(ok),
            "stalls": figures["stalls"], "failovers": figures["failovers"], "regranted": hung_stats["regranted"],
            "close_s": close_s}


def stalled(servers: list[ServerProcess], seconds: float, hedge: bool) -> dict:
    """One loader over ``servers``, the last one stopped 2 s in every 3 s from the first batch of an
    epoch (after 50 untimed batches of the epoch before); every batch of ``seconds`` timed."""
    addresses = [s.address for s in servers]
    with _loader(addresses, batch_size=STALL_BATCH, transport="inline", hedge=hedge) as ld:
        it = iter(ld)
        for _ in range(50):
            next(it)
        it.close()
        ld.set_epoch(1)
        granted = sum(get_stats(a).totals.batches_granted for a in addresses)
        before = ld.stats()
        waits, positions, indices = [], [], []  # (from the epoch's first batch)
        it = iter(ld)
        with Stalls(servers[-1].pid, STALL_S, PERIOD_S, first_s=0.0) as stalls:
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                t0 = time.perf_counter()
                batch = next(it)
                waits.append(time.perf_counter() - t0)
                positions.append(batch["position"])
                indices.append(batch["index"])
        figures = ld.stats()
        it.close()
    extra = sum(get_stats(a).totals.batches_granted for a in addresses) - granted - len(waits)
    positions, indices = np.concatenate(positions), np.concatenate(indices)
    once = bool(np.array_equal(positions, np.arange(len(positions))) and len(np.unique(indices)) == len(indices))
    w = np.array(waits)
    p50, p99 = (float(v) for v in np.percentile(w, (50, 99)))
    slow = figures["servers"][addresses[-1]]
    return {"p50": p50, "p99": p99, "max": float(w.max()), "waited": float(w.sum()), "batches": len(w),
            "stops": stalls.stops,
            "extra": max(0, extra), "stalls": figures["stalls"] - before["stalls"], "regranted": slow["regranted"],
            "duplicates": sum(s["duplicates"] for s in figures["servers"].values()), "once": once,
            "rate": len(w) * STALL_BATCH / seconds}
