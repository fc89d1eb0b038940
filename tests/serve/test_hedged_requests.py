"""A hedged request on the server (issue 20 §2): StreamBatchesRequest.end_batch stops a stream (and
its computation) before that batch; ``hedge`` counts the call apart in Stats and /metrics."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

import batchd
from batchd.client.transport.server_stats import get_stats
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import digest
from test_stats import scrape

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def server(make_server, fmnist_root):
    return make_server(workers=2, metrics_port=0,
                       datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})


def drain(address, **fields) -> list[pb.Batch]:
    """Every batch of a StreamBatches call (the generated stub; the client no longer speaks it)."""
    with grpc.insecure_channel(address) as channel:
        request = pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=500, shuffle=True, seed=3, prefetch=4,
                                          transport=pb.TRANSPORT_INLINE, **fields)
        return list(loader_pb2_grpc.BatchLoaderStub(channel).StreamBatches(request, timeout=60))


def image_digest(batch: pb.Batch) -> str:
    """``digest`` of a Batch message's image, label and index tensors."""
    import torch

    arrays = {t.name: torch.from_numpy(np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape)).copy())
              for t in batch.tensors}
    return digest(arrays)


def test_a_hedged_request_builds_one_batch_and_counts_apart(server):
    kw = dict(batch_size=500, shuffle=True, seed=3, prefetch=4, transport="inline")
    with batchd.RemoteDataLoader(server.address, "fmnist-test", **kw) as ld:
        whole = [digest(b) for b in ld]
        built = server.loader.pool.batches_built
        got = drain(server.address, start_batch=7, end_batch=8, hedge=True)
        assert [b.batch_index for b in got] == [7]
        assert image_digest(got[0]) == whole[7]  # the same bytes as in the whole epoch
        assert server.loader.pool.batches_built == built + 1, "a batch past end_batch was built (prefetch 4)"
        # a strided stream with an end, and an end past the epoch
        got = drain(server.address, start_batch=3, batch_stride=4, batch_offset=1, end_batch=13)
        assert [b.batch_index for b in got] == [4, 8, 12]
        with pytest.raises(grpc.RpcError, match=r"end_batch must be in \(start_batch=3, 20\]"):
            drain(server.address, start_batch=3, end_batch=21)
    totals = get_stats(server.address).totals
    assert (totals.hedge_streams_started, totals.hedge_batches_built, totals.hedge_batches_sent) == (1, 1, 1)
    metrics = scrape(server.metrics_address)
    assert metrics[("batchd_hedge_streams_started_total", ())] == 1
    assert metrics[("batchd_hedge_batches_built_total", ())] == 1
    assert metrics[("batchd_hedge_batches_sent_total", ())] == 1
