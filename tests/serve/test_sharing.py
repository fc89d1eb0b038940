"""One loader, many experiments: identical streams share one computation; different ones share workers."""

from __future__ import annotations

import itertools
import logging
import threading

import numpy as np
import pytest

import batchd
from batchd.server.serve.stream import Computation
from helpers import digest

pytestmark = pytest.mark.timeout(180)

N_TEST, BATCH = 10_000, 200
NUM_BATCHES = N_TEST // BATCH


def open_loader(server, **kw):
    kw = {"batch_size": BATCH, "shuffle": True, "seed": 11, "transform": "flip", "timeout": 60, **kw}
    return batchd.RemoteDataLoader(server.address, "fmnist-test", **kw)


def read_all(ld, out: list, delay_each=None) -> None:
    for b in ld:
        out.append((digest(b), b["index"].numpy().copy()))
        if delay_each is not None:
            delay_each()


def check_epoch(got) -> None:
    indices = np.concatenate([i for _, i in got])
    assert len(got) == NUM_BATCHES
    assert np.array_equal(np.sort(indices), np.arange(N_TEST))


@pytest.fixture
def server(make_server, fmnist_root, request):
    import albumentations as A

    return make_server(
        workers=2,
        share_window=getattr(request, "param", 8),
        max_slots=128,
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
        pipelines={"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5)]))},
    )


# A wide window: gRPC sends ahead of what each client has read, so lockstep clients can be
# several batches apart on the server (what is tested here is that nothing is built twice).
@pytest.mark.parametrize("server", [NUM_BATCHES], indirect=True)
@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_identical_streams_are_computed_once(server, transport):
    a_out, b_out = [], []
    with open_loader(server, transport=transport) as a, open_loader(server, transport=transport) as b:
        it_a, it_b = iter(a), iter(b)
        for x, y in itertools.zip_longest(it_a, it_b):  # two experiments in lockstep
            a_out.append((digest(x), x["index"].numpy().copy()))
            b_out.append((digest(y), y["index"].numpy().copy()))
    check_epoch(a_out)
    assert [d for d, _ in a_out] == [d for d, _ in b_out]
    built = server.loader.pool.batches_built
    assert built <= NUM_BATCHES + 8, f"{built} batches built for two identical streams of {NUM_BATCHES}"


# gRPC sends ahead of what a client has read (shared-memory messages are small), so the first
# stream's server-side position is well past the 4 batches it read: a wide window.
@pytest.mark.parametrize("server", [NUM_BATCHES], indirect=True)
def test_late_joiner_gets_identical_bytes_and_shares(server, caplog):
    caplog.set_level(logging.INFO, logger="batchd.server.loader")
    first = []
    with open_loader(server) as a:
        it_a = iter(a)
        first += [(digest(next(it_a)), None) for _ in range(4)]  # a is 4 batches in
        with open_loader(server) as b:
            late = []
            read_all(b, late)
        first += [(digest(x), None) for x in it_a]
    check_epoch(late)
    assert [d for d, _ in first] == [d for d, _ in late]
    assert any("joins computation" in r.message for r in caplog.records)
    assert server.loader.pool.batches_built <= NUM_BATCHES + 8


def test_reader_falling_out_of_the_window_gets_every_batch_recomputed(server, caplog):
    caplog.set_level(logging.INFO, logger="batchd.server.loader")
    fast, slow = [], []
    with open_loader(server, prefetch=2) as a, open_loader(server, prefetch=2) as b:
        it_b = iter(b)
        slow.append((digest(next(it_b)), None))  # b takes batch 0, then stalls
        read_all(a, fast)  # a runs the whole epoch meanwhile: b falls more than 8 batches behind
        slow += [(digest(x), x["index"].numpy().copy()) for x in it_b]
    check_epoch(fast)
    check_epoch([(None, i) for _, i in slow[1:]] + [(None, fast[0][1])])
    assert len(slow) == NUM_BATCHES
    assert [d for d, _ in slow] == [d for d, _ in fast]
    # (a Batches call is never moved to a computation of its own, as an ordered StreamBatches
    # reader that falls behind is: it holds only what it granted, so it holds nobody back)


def _while_both_wanted(order: list[int]) -> list[int]:
    """The part of ``order`` (seeds of batches given to workers, in order) when both streams still
    had batches to be given: from the later stream's first batch to the earlier-finishing stream's
    last."""
    seeds = set(order)
    start = max(order.index(s) for s in seeds)
    end = min(len(order) - 1 - order[::-1].index(s) for s in seeds)
    return order[start:end + 1]


def test_different_streams_share_the_workers_fairly(server, monkeypatch):
    """Two different experiments read at once get the workers in turn, not one after the other.

    Each asks for a whole epoch ahead (prefetch = every batch) and slots are plenty, so both want
    work from their first batch to their last: who gets a free worker is the scheduler's choice
    alone. Counted: the batches the scheduler gave out (``Computation.take_task``), in order.
    Round robin alternates, so while both still had batches to be given, their counts differ by
    at most one: over the 50 or more batches of that stretch, each got 49-51%. A scheduler that
    serves the older stream first gives the other nothing until it is done (no stretch at all);
    one that draws at random strays by about sqrt(n) batches (a share of 43-57% over 100).
    """
    order: list[int] = []
    take_task = Computation.take_task

    def counted(self):
        order.append(self.request.seed)
        return take_task(self)

    monkeypatch.setattr(Computation, "take_task", counted)
    for trial in range(3):  # a trial in which one stream opened only after the other was served says nothing
        order.clear()
        outs: dict[int, list] = {1: [], 2: []}
        gate = threading.Barrier(2)

        errors: list[BaseException] = []

        def read(seed):
            try:
                with open_loader(server, seed=seed, prefetch=NUM_BATCHES, transport="inline") as ld:
                    gate.wait()
                    read_all(ld, outs[seed])
            except BaseException as e:  # re-raised below, in the test's thread
                errors.append(e)

        threads = [threading.Thread(target=read, args=(seed,)) for seed in outs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        if errors:
            raise errors[0]
        for got in outs.values():
            check_epoch(got)
        assert sorted(order) == [1] * NUM_BATCHES + [2] * NUM_BATCHES
        both = _while_both_wanted(order)
        if len(both) >= NUM_BATCHES:
            break
    assert len(both) >= NUM_BATCHES, f"the streams overlapped for {len(both)} batches only: {order}"
    counts = {seed: both.count(seed) for seed in outs}
    assert abs(counts[1] - counts[2]) <= 1, (counts, order)
    assert all(0.49 <= n / len(both) <= 0.51 for n in counts.values()), (counts, order)


# a wide window: b's stream opens while a's races ahead into gRPC's buffers (tiny shared-memory
# messages); under load a got more than 8 batches ahead first and b read alone from the start
@pytest.mark.parametrize("server", [64], indirect=True)
def test_a_client_leaving_a_shared_computation_does_not_disturb_the_other(server):
    a_out = []
    with open_loader(server) as a:
        b = open_loader(server)
        it_a, it_b = iter(a), iter(b)
        for _ in range(3):
            a_out.append((digest(next(it_a)), None))
            next(it_b)
        shared = [s.shared for s in server.loader.streams.values()]
        assert shared == [True, True]
        b.close()  # one experiment stops mid-epoch
        a_out += [(digest(x), x["index"].numpy().copy()) for x in it_a]
    assert len(a_out) == NUM_BATCHES
    with open_loader(server) as ref:
        assert [digest(x) for x in ref] == [d for d, _ in a_out]
