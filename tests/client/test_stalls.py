"""What the several-servers rule promises against the adversaries it exists for (issue 36), and the
shutdown paths a training loop can reach: real ``batchd serve`` processes, one stopped for good
(SIGSTOP, never resumed) with 1 and 4 workers; a ``break``; an abandoned iterator collected by the
garbage collector inside the loader's own lock; a shared-memory batch asked for again on the same
call.

Servers run sleep-bound python pipelines (``batchd_testdata:paced``), so 2 cores run several.
"""

from __future__ import annotations

import concurrent.futures
import gc
import pathlib
import signal
import statistics
import threading
import time

import numpy as np
import pytest
import yaml

import batchd
from batchd.client.iteration import credit as credit_mod
from helpers import free_port
from procs import ServerProcess

pytestmark = pytest.mark.timeout(240)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"


def config(tmp: pathlib.Path, seconds: float, n: int, workers: int = 1) -> dict:
    return {"workers": workers, "python_path": [str(PYDATA)], "cache_dir": str(tmp / "cache"),
            "datasets": {"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": n}}},
            "pipelines": {"pace": {"python": "batchd_testdata:paced", "args": {"seconds": seconds}}}}


def start(server_procs, tmp: pathlib.Path, count: int, seconds: float, n: int, workers: int) -> list[ServerProcess]:
    procs = []
    for k in range(count):
        cfg = tmp / f"server{k}.yaml"
        cfg.write_text(yaml.safe_dump(config(tmp / f"s{k}", seconds, n, workers)))
        procs.append(server_procs(cfg, f"127.0.0.1:{free_port()}"))
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        list(pool.map(lambda p: p.start(), procs))
    return procs


def loader(address, **kw) -> batchd.RemoteDataLoader:
    kw = {"batch_size": 4, "shuffle": True, "seed": 5, "transform": "pace", "transport": "inline", "timeout": 20,
          "connect_timeout": 10, "probe_interval": 60, **kw}
    return batchd.RemoteDataLoader(address, "paced", **kw)


def epoch_waits(ld) -> tuple[list[int], list[float]]:
    """One epoch: its sample indices and the loop's wait for each batch (seconds)."""
    indices, waits = [], []
    it = iter(ld)
    while True:
        t0 = time.perf_counter()
        try:
            batch = next(it)
        except StopIteration:
            return indices, waits
        waits.append(time.perf_counter() - t0)
        index = batch["index"].numpy()
        assert np.array_equal(batch["label"].numpy(), index)
        indices.extend(index.tolist())


@pytest.mark.parametrize("workers", [1, 4])
def test_a_server_hung_for_good_never_ends_an_epoch(server_procs, tmp_path, workers):
    """One of two servers is stopped for good mid-epoch (SIGSTOP, never resumed), holding its full
    credit, with the loader's ``timeout=20``: its batches go to the other at its own deadline;
    that epoch and the next complete, each sample once, and no wait of the loop reaches 1 s
    (before: ``TimeoutError`` at 20 s, no failover: its window outran the hedge budget)."""
    n = 800  # 200 batches of 4
    live, hung = start(server_procs, tmp_path, 2, 0.002, n, workers)
    with loader([live.address, hung.address]) as ld:
        assert sorted(epoch_waits(ld)[0]) == list(range(n))  # warm: connected, build times known
        it = iter(ld)
        indices, waits = [], []
        for k in range(len(ld)):
            if k == 30:
                hung.signal(signal.SIGSTOP)  # for good (the fixture kills it at the end)
            t0 = time.perf_counter()
            batch = next(it)
            waits.append(time.perf_counter() - t0)
            indices.extend(batch["index"].tolist())
        assert next(it, None) is None
        assert sorted(indices) == list(range(n)), "a sample is missing or repeated"
        hung_stats = ld.stats()["servers"][hung.address]  # (that epoch's)
        next_indices, next_waits = epoch_waits(ld)  # the next epoch: the hung server gets a probe only
        stats = ld.stats()
    assert sorted(next_indices) == list(range(n))
    assert max(waits + next_waits) < 1.0, (max(waits), max(next_waits))
    assert stats["stalls"] >= 1, stats
    assert hung_stats["stalled"] and hung_stats["regranted"] >= 1, hung_stats
    assert stats["servers"][hung.address]["stalled"] and stats["servers"][hung.address]["share"] == 0.0


def test_a_break_leaves_the_loop_at_once(server_procs, tmp_path):
    """``break`` out of a one-server loop: the pass is let go of without waiting for anything
    (before: up to 250 ms, a lane thread's poll); the next pass reads the whole epoch again."""
    (server,) = start(server_procs, tmp_path, 1, 0.002, 400, 2)
    with loader(server.address) as ld:
        times = []
        for _ in range(5):
            for k, batch in enumerate(ld):
                if k == 5:
                    t0 = time.perf_counter()
                    break
            times.append(time.perf_counter() - t0)
        assert sorted(epoch_waits(ld)[0]) == list(range(400))
    assert statistics.median(times) < 0.02, times


def test_an_iterator_collected_inside_the_loaders_lock_does_not_deadlock(server_procs, tmp_path, monkeypatch):
    """An abandoned iterator in a reference cycle, collected by the cyclic garbage collector in the
    loader's own thread while it holds that pass's lock (here: forced inside the rule's stall
    check, which runs under it): letting the pass go takes no lock, so nothing deadlocks; a new
    pass reads every batch and ``close`` returns (before: the finalizer took the lock the thread
    held, and ``close`` never returned, 4 of 4 runs)."""
    (server,) = start(server_procs, tmp_path, 1, 0.001, 200, 1)
    ld = loader(server.address)
    cycle_made, collected = threading.Event(), threading.Event()
    real_check = credit_mod.Credit.check

    def check(self, now):
        if cycle_made.is_set() and not collected.is_set():
            gc.collect()  # (the abandoned iterator is finalized here, under the pass's lock)
            collected.set()
        return real_check(self, now)

    monkeypatch.setattr(credit_mod.Credit, "check", check)
    gc.disable()
    try:
        it = iter(ld)
        next(it)
        holder = [it]
        holder.append(holder)  # a cycle: only the cyclic collector frees it
        del it, holder
        cycle_made.set()
        assert collected.wait(10), "the loader's thread never ran a stall check"
    finally:
        gc.enable()
    done = threading.Event()

    def use_and_close() -> None:
        got.extend(b["index"].clone() for b in ld)
        ld.close()
        done.set()

    got: list = []
    threading.Thread(target=use_and_close, daemon=True).start()
    assert done.wait(30), "the loader deadlocked: a new pass or close() did not return"
    assert sorted(np.concatenate([g.numpy() for g in got]).tolist()) == list(range(200))


def test_a_shared_memory_batch_asked_for_again_on_the_same_call(server_procs, tmp_path, monkeypatch):
    """A batch whose shared-memory slot is gone when it is converted (a restarted server's session)
    is granted again, on the same call if its server is the one that has credit: grants are
    idempotent, so the server sends it again (before: INVALID_ARGUMENT, "already granted",
    and ``ValueError`` ended the epoch)."""
    (server,) = start(server_procs, tmp_path, 1, 0.001, 200, 2)
    from batchd.client.transport import shm

    real = shm.SharedMemorySession.tensors
    failed = []

    def tensors(self, batch):
        if batch.batch_index == 7 and not failed:
            failed.append(batch.batch_index)
            self.release_unused(batch.lease)
            raise FileNotFoundError("the slot went with the session (the test)")
        return real(self, batch)

    monkeypatch.setattr(shm.SharedMemorySession, "tensors", tensors)
    with loader(server.address, transport="shm") as ld:
        indices, _ = epoch_waits(ld)
        calls = batchd.get_stats(server.address).totals.batches_calls_started
    assert failed == [7]
    assert sorted(indices) == list(range(200)), "a sample is missing or repeated"
    assert calls == 1  # the same call: the batch was granted on it again
