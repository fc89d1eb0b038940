"""Workers sized to demand (config workers: {min, max}): the policy's rules on a synthetic clock, the
cgroup CPU limit it stays within, and a real server that grows while its client waits and shrinks
back once it stops, with the same bytes, every sample once."""

from __future__ import annotations

import logging

import albumentations as A
import numpy as np
import pytest

import batchd
from batchd.client.transport.server_stats import get_stats
from batchd.sampler import global_positions, num_batches, sample_key, shard_indices
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.autoscale import (BUSY_UP, UP_WINDOW_S, WAIT_UP, Autoscaler, Demand, cgroup_cpu_limit,
                                             cpu_budget)
from batchd.server.config import ConfigError, FashionMnistConfig, ServerConfig, load_config
from batchd.server.data.datasets import open_dataset
from helpers import wait_until

pytestmark = pytest.mark.timeout(180)

WAITING = Demand(waiting=1, wait_ratio=0.9)


class Pool:
    """A synthetic pool for the policy, advanced in 0.25 s rounds: ``load`` workers' worth of work
    spread over the ``workers`` (each busy ``min(1, load / workers)`` of the time)."""

    def __init__(self, scaler: Autoscaler, workers: int):
        self.scaler, self.workers, self.now, self.busy_s, self.alive_s = scaler, workers, 0.0, 0.0, 0.0
        self.decisions: list[tuple[float, str]] = []

    def run(self, seconds: float, load: float, demand: Demand = Demand(), starting: int = 0) -> None:
        for _ in range(int(seconds / 0.25)):
            self.now += 0.25
            self.busy_s += 0.25 * min(load, self.workers)
            self.alive_s += 0.25 * self.workers
            d = self.scaler.decide(workers=self.workers, starting=starting, busy_seconds=self.busy_s,
                                   alive_seconds=self.alive_s, demand=demand, now=self.now)
            if d is not None:
                self.decisions.append((self.now, d.direction))
                self.workers += 1 if d.direction == "up" else -1


def test_it_grows_while_clients_wait_and_the_workers_are_busy_up_to_the_limit():
    pool = Pool(Autoscaler(1, 3, cpu_quota=8, cool_down_s=5), workers=1)
    pool.run(10, load=8, demand=WAITING)
    assert [d for _, d in pool.decisions] == ["up", "up"] and pool.workers == 3  # max 3, never more
    times = [t for t, _ in pool.decisions]
    assert times[0] >= UP_WINDOW_S and times[1] - times[0] >= UP_WINDOW_S  # one at a time, each settling


def test_it_does_not_grow_for_a_client_that_waits_on_something_else():
    # the client waits (a slow link), but the workers are idle: more workers would not help
    pool = Pool(Autoscaler(1, 4, cpu_quota=8, cool_down_s=5), workers=1)
    pool.run(10, load=BUSY_UP - 0.05, demand=WAITING)
    assert pool.decisions == []
    # busy workers, but nobody waiting (a trainer-bound client): nothing either
    pool.run(10, load=8, demand=Demand(waiting=0, wait_ratio=WAIT_UP / 2))
    assert pool.decisions == []


def test_a_starting_worker_holds_further_growth():
    pool = Pool(Autoscaler(1, 4, cpu_quota=8, cool_down_s=5), workers=1)
    pool.run(10, load=8, demand=WAITING, starting=1)
    assert pool.decisions == []


def test_it_retires_one_worker_per_cool_down_once_nobody_waits_down_to_min():
    pool = Pool(Autoscaler(2, 4, cpu_quota=8, cool_down_s=3), workers=4)
    pool.run(2.5, load=0)
    assert pool.decisions == []  # not yet: within the cool-down
    pool.run(20, load=0)
    assert [d for _, d in pool.decisions] == ["down", "down"] and pool.workers == 2  # min 2, never fewer
    assert pool.decisions[1][0] - pool.decisions[0][0] >= 3


def test_it_keeps_workers_the_load_still_needs():
    # 3 workers 70% busy (2.1 workers of work): 2 would be over 100% busy; none goes, nobody waiting or not
    pool = Pool(Autoscaler(1, 4, cpu_quota=8, cool_down_s=2), workers=3)
    pool.run(20, load=2.1)
    assert pool.decisions == []
    pool.run(20, load=0.9)  # 2 would be 45% busy: one goes; then 1 would be 90%: it stays at 2
    assert [d for _, d in pool.decisions] == ["down"] and pool.workers == 2


def test_the_cpu_quota_caps_max_but_never_below_min():
    assert Autoscaler(1, 8, cpu_quota=2.5).limit == 2
    assert Autoscaler(3, 8, cpu_quota=1.0).limit == 3
    assert Autoscaler(1, 2, cpu_quota=64).limit == 2
    assert Autoscaler(2, 2, cpu_quota=8).fixed
    with pytest.raises(ValueError, match="min <= max"):
        Autoscaler(3, 2)


# --- the container's CPU limit ----------------------------------------------------------------


def _write(path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_limit_the_smallest_along_the_path(tmp_path):
    _write(tmp_path / "proc", "0::/kubepods/pod1/batchd\n")
    _write(tmp_path / "fs/kubepods/cpu.max", "max 100000\n")
    _write(tmp_path / "fs/kubepods/pod1/cpu.max", "350000 100000\n")
    _write(tmp_path / "fs/kubepods/pod1/batchd/cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", tmp_path / "proc") == pytest.approx(3.5)
    assert cpu_budget(tmp_path / "fs", tmp_path / "proc", available=16) == pytest.approx(3.5)
    assert cpu_budget(tmp_path / "fs", tmp_path / "proc", available=2) == 2  # never more than the CPUs there
    # a container sees its own cgroup as the root ("0::/")
    _write(tmp_path / "proc2", "0::/\n")
    _write(tmp_path / "fs2/cpu.max", "150000 100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs2", tmp_path / "proc2") == pytest.approx(1.5)


def test_cgroup_v1_quota_and_no_limit(tmp_path):
    _write(tmp_path / "proc", "12:cpu,cpuacct:/docker/abc\n11:memory:/docker/abc\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "200000\n")
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(tmp_path / "fs", tmp_path / "proc") == pytest.approx(2.0)
    _write(tmp_path / "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "-1\n")  # unlimited
    assert cgroup_cpu_limit(tmp_path / "fs", tmp_path / "proc") is None
    assert cpu_budget(tmp_path / "fs", tmp_path / "proc", available=6) == 6
    assert cgroup_cpu_limit(tmp_path / "nothing", tmp_path / "no-proc") is None


# --- the config --------------------------------------------------------------------------------


def test_workers_is_a_count_or_a_range(tmp_path):
    assert ServerConfig(workers=3).min_workers == ServerConfig(workers=3).max_workers == 3
    cfg = ServerConfig(workers={"min": 1, "max": 8, "cool_down_s": 10})
    assert (cfg.min_workers, cfg.max_workers, cfg.workers.cool_down_s, cfg.workers.cpu_quota) == (1, 8, 10, None)
    path = tmp_path / "c.yaml"
    for bad, message in (("{min: 3, max: 2}", "max (2) must be at least min (3)"), ("{max: 2, mn: 1}", "mn"),
                         ("0", "worker count in [1, 512]"), ("{min: 1}", "max: Field required")):
        path.write_text(f"workers: {bad}\n")
        with pytest.raises(ConfigError, match=r"workers") as e:
            load_config(path)
        assert message in str(e.value), str(e.value)


# --- a real server -----------------------------------------------------------------------------

# the worker must be what the loop waits for (busy >= BUSY_UP, the client's wait ratio >= WAIT_UP): ~1 ms a
# sample on a fast core; at 96x96 a fast machine's loop (a Stats call each batch) was slower than its worker
HEAVY = A.Compose([A.Resize(224, 224), A.GaussianBlur(blur_limit=(7, 7), p=1.0), A.MedianBlur(blur_limit=7, p=1.0)])
BATCH, SEED = 8, 11


def expected_batch(ds, compose, b: int) -> np.ndarray:
    """Batch ``b`` of epoch 0 (shuffled, seed SEED) by the documented derivation: the pipeline on
    each sample, drawing from the sample's stream (``batchd.sampler.sample_key``, its global position)."""
    order = shard_indices(len(ds), shuffle=True, seed=SEED, epoch=0, rank=0, world_size=1, drop_last=False)
    positions = global_positions(0, len(order), rank=0, world_size=1)
    rnd = pipelines.SampleRandom()
    rnd.attach(compose)
    key = sample_key(seed=SEED, epoch=0)
    out = []
    for index, position in zip(order[b * BATCH:(b + 1) * BATCH].tolist(), positions[b * BATCH:(b + 1) * BATCH].tolist()):
        rnd.start(key, position)
        image = compose(image=ds.load_image(index))["image"]
        out.append(image[:, :, None] if image.ndim == 2 else image)
    return np.stack(out)


def test_a_waiting_client_grows_the_pool_and_it_shrinks_back_after(make_server, fmnist_root, cache_dir, caplog):
    server = make_server(workers={"min": 1, "max": 2, "cool_down_s": 1.0, "cpu_quota": 2},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    assert get_stats(server.address).pool.workers == 1
    got: dict[int, np.ndarray] = {}
    indices: list[int] = []
    grew_at = None
    with caplog.at_level(logging.INFO, logger="batchd.server.compute.pool"):
        with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=BATCH, shuffle=True, seed=SEED,
                                     transform=HEAVY, prefetch=4) as loader:
            for b, batch in enumerate(loader):  # as fast as it comes: the loop waits for data
                got[b] = batch["image"].numpy().copy()
                indices += batch["index"].tolist()
                if b % 8:  # a Stats call costs the loop ~4 ms: often enough to see it, not so often that
                    continue  # the loop, not the data, is what it waits for
                pool = get_stats(server.address).pool
                # a worker gets batches only once it is ready: none waits behind one still starting
                assert all(w.tasks == 0 for w in pool.worker_stats if w.stage == "starting"), pool.worker_stats
                if grew_at is None and pool.workers == 2:
                    grew_at = b
                if grew_at is not None and b >= grew_at + 16:  # some batches built by two workers
                    break
                assert b < 1000, f"the pool never grew: {pool} {get_stats(server.address).streams}"
        pool = get_stats(server.address).pool
        assert pool.scale_ups == 1 and (pool.min_workers, pool.max_workers) == (1, 2)
        # the client has gone: after the cool-down the pool is back to one worker
        assert wait_until(lambda: get_stats(server.address).pool.workers == 1, timeout=30)
        assert get_stats(server.address).pool.scale_downs == 1
    logged = [r.getMessage() for r in caplog.records if "workers:" in r.getMessage()]
    assert any("starting worker 1 (clients_waiting)" in m and "waiting for data" in m for m in logged), logged
    assert any("retiring worker 1 (idle)" in m for m in logged), logged
    # every sample at most once, in the epoch's order; the same bytes as the definition, through the resizes
    n = len(got)
    order = shard_indices(10_000, shuffle=True, seed=SEED, epoch=0, rank=0, world_size=1, drop_last=False)
    assert indices == order[: n * BATCH].tolist() and len(set(indices)) == len(indices)
    ds = open_dataset("fmnist", FashionMnistConfig(kind="fashion-mnist", root=fmnist_root, split="test"), cache_dir,
                      build=True)
    compose = pipelines.build(pipelines.canonical_json(A.to_dict(HEAVY)))
    for b in sorted({0, max(0, grew_at - 1), grew_at, (grew_at + n) // 2, n - 1}):
        assert np.array_equal(got[b], expected_batch(ds, compose, b)), f"batch {b} (pool grew at batch {grew_at})"
    assert num_batches(10_000, BATCH) > n


# --- growing while a worker retires (issue 25) ------------------------------------------------

# ~20 ms a Fashion-MNIST sample on one core, back to 28 x 28: a worker's queue of tasks lasts long
# enough for the pool to decide twice (every 0.25 s) while it is still running them
SLOWER = A.Compose([A.Resize(512, 512), A.MedianBlur(blur_limit=(15, 15), p=1.0),
                    A.MedianBlur(blur_limit=(15, 15), p=1.0), A.Resize(28, 28)])


class Scripted(Autoscaler):
    """The policy's decisions in a set order; the pool acts on them with real processes. (The rules
    that produce them are tested above on a synthetic clock; with the real clock this order, a
    worker retiring with tasks queued and then the clients waiting again, happens by timing only.)

    up (worker 1 starts); down once worker 1 holds 3 tasks (it retires with them queued); up again
    while it still holds some."""

    def __init__(self, pool):
        super().__init__(1, 2, cpu_quota=2)
        self.pool = pool
        self.done: list[str] = []

    def decide(self, *, workers, starting, busy_seconds, alive_seconds, demand, now):
        from batchd.server.compute.autoscale import Decision

        w1, step = self.pool._workers.get(1), len(self.done)  # (the pool's thread calls this: its state is ours)
        if step == 0:
            direction = "up"
        elif step == 1 and w1 is not None and w1.ready and len(w1.tasks) >= 3:
            direction = "down"
        elif step == 2 and w1 is not None and w1.retiring and w1.tasks:
            direction = "up"
        else:
            return None
        self.done.append(direction)
        return Decision(direction, "clients_waiting" if direction == "up" else "idle", f"scripted step {step}")


def test_growing_while_a_retiring_worker_still_has_tasks(make_server, fmnist_root, cache_dir, caplog):
    """Before the fix the worker-id choice raised ValueError (``min()`` of no id: both ids in use,
    one by the retiring worker) and the failed scheduler round failed the stream."""
    server = make_server(workers={"min": 1, "max": 2, "cpu_quota": 2},
                         datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    pool = server.loader.pool
    script = pool.autoscaler = Scripted(pool)
    batch, seed, got = 16, 5, {}
    with caplog.at_level(logging.INFO, logger="batchd.server.compute.pool"):
        # inline: the client's grants are not held to a shared-memory session's lease cap, so a
        # worker can hold the 3 queued tasks the script waits for
        with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=batch, shuffle=True, seed=seed,
                                     transform=SLOWER, prefetch=8, timeout=60, transport="inline") as loader:
            for b, x in enumerate(loader):
                got[b] = (x["index"].tolist(), x["image"].numpy().copy())
                if len(script.done) == 3 and b >= 24:
                    break
                assert b < 200, f"the script stopped at {script.done}"
    assert script.done == ["up", "down", "up"]
    logged = [r.getMessage() for r in caplog.records if "workers:" in r.getMessage()]
    assert any("keeping worker 1, which was retiring" in m for m in logged), logged
    assert pool.num_workers == 2 and not any(w.retiring for w in pool._workers.values())
    assert pool.scaling == {("up", "clients_waiting"): 2, ("down", "idle"): 1}
    # every batch in order, each sample once, the same bytes as the definition
    order = shard_indices(10_000, shuffle=True, seed=seed, epoch=0, rank=0, world_size=1, drop_last=False)
    assert [got[b][0] for b in sorted(got)] == [order[b * batch:(b + 1) * batch].tolist() for b in sorted(got)]
    ds = open_dataset("fmnist", FashionMnistConfig(kind="fashion-mnist", root=fmnist_root, split="test"), cache_dir,
                      build=True)
    compose = pipelines.build(pipelines.canonical_json(A.to_dict(SLOWER)))
    key, rnd = sample_key(seed=seed, epoch=0), pipelines.SampleRandom()
    rnd.attach(compose)
    for b in (0, len(got) // 2, len(got) - 1):
        want = []
        for index, position in zip(got[b][0], range(b * batch, (b + 1) * batch)):
            rnd.start(key, position)
            image = compose(image=ds.load_image(index))["image"]
            want.append(image[:, :, None] if image.ndim == 2 else image)
        assert np.array_equal(got[b][1], np.stack(want)), f"batch {b}"
