"""Experiments that start together share one computation: the loader decides and registers under one lock."""

from __future__ import annotations

import threading

import pytest

import batchd
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.stats import snapshot
from helpers import digest, wait_until

pytestmark = pytest.mark.timeout(300)

READERS, TRIALS = 4, 10
N_TEST, BATCH = 10_000, 1_000


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(
        cache_dir=tmp_path_factory.mktemp("cache"), workers=2, share_window=16,
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
    ) as srv:
        yield srv


def _together(n: int, work) -> list:
    """Run ``work(i)`` in ``n`` threads released at once by a barrier; their results in order."""
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            results[i] = work(i, barrier)
        except BaseException as e:  # surfaced below
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


@pytest.mark.parametrize("trial", range(TRIALS))
def test_identical_streams_opened_at_once_are_computed_once(server, trial):
    """Four experiments start the same epoch at the same instant, over gRPC."""
    loader = server.loader
    before = snapshot(loader).computations_started

    def read(i: int, barrier: threading.Barrier) -> list[str]:
        with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=trial,
                                     transport="inline", timeout=60) as ld:
            len(ld)  # connected (DescribeDataset) before the barrier: the stream requests leave together
            barrier.wait(30)
            return [digest(b) for b in ld]

    got = _together(READERS, read)
    assert wait_until(lambda: not loader.streams)
    assert snapshot(loader).computations_started - before == 1
    assert len(got[0]) == N_TEST // BATCH and all(g == got[0] for g in got)


def test_identical_requests_on_the_loader_at_once_join_one_computation(server):
    """The same race without gRPC in between: Loader.open_stream from threads released together."""
    loader = server.loader
    for trial in range(TRIALS):
        before = snapshot(loader).computations_started
        request = StreamRequest(dataset="fmnist-test", batch_size=BATCH, shuffle=True, seed=100 + trial)

        def open_one(i: int, barrier: threading.Barrier):
            barrier.wait(30)
            return loader.open_stream(request)

        streams = _together(READERS, open_one)
        try:
            assert len({id(s.computation) for s in streams}) == 1, f"trial {trial}"
            assert snapshot(loader).computations_started - before == 1
        finally:
            for s in streams:
                loader.close_stream(s, "closed by the test")
