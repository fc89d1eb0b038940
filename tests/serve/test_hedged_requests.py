"""A hedged request on the server (issue 20 §2): StreamBatchesRequest.end_batch stops a stream (and
its computation) before that batch; ``hedge`` counts the call apart in Stats and /metrics."""

from __future__ import annotations

import pytest

import batchd
from batchd.client.receiver import _End
from batchd.client.stats import get_stats
from helpers import digest
from test_stats import scrape

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(make_server, fmnist_root):
    return make_server(workers=2, metrics_port=0,
                       datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})


def drain(receiver):
    got = []
    while not isinstance(item := receiver.get(30, "test"), _End):
        got.append(item)
    receiver.stop()
    return got


def test_a_hedged_request_builds_one_batch_and_counts_apart(server):
    kw = dict(batch_size=500, shuffle=True, seed=3, prefetch=4, transport="inline")
    with batchd.RemoteDataLoader(server.address, "fmnist-test", **kw) as ld:
        whole = [digest(b) for b in ld]
        built = server.loader.pool.batches_built
        conn = ld.servers.connection
        got = drain(conn.open_stream(0, 7, end_batch=8, hedge=True))
        assert [item.batch_index for item in got] == [7]
        assert digest(got[0].batch) == whole[7]  # the same bytes as in the whole epoch
        assert server.loader.pool.batches_built == built + 1, "a batch past end_batch was built (prefetch 4)"
        # a strided stream with an end, and an end past the epoch
        got = drain(conn.open_stream(0, 3, 4, 1, end_batch=13))
        assert [item.batch_index for item in got] == [4, 8, 12]
        with pytest.raises(ValueError, match=r"end_batch must be in \(start_batch=3, 20\]"):
            drain(conn.open_stream(0, 3, end_batch=21))
    totals = get_stats(server.address).totals
    assert (totals.hedge_streams_started, totals.hedge_batches_built, totals.hedge_batches_sent) == (1, 1, 1)
    metrics = scrape(server.metrics_address)
    assert metrics[("batchd_hedge_streams_started_total", ())] == 1
    assert metrics[("batchd_hedge_batches_built_total", ())] == 1
    assert metrics[("batchd_hedge_batches_sent_total", ())] == 1
