"""Sent vs taken: per-stream Stats count what the client's training loop took, apart from what was sent."""

from __future__ import annotations

import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import batchd
from batchd._status_table import format_status
from batchd.client.transport.server_stats import get_stats
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import wait_until
from rawclient import RawSession

pytestmark = pytest.mark.timeout(120)

BATCH = 100  # Fashion-MNIST test split: 100 batches


@pytest.fixture
def server(make_server, fmnist_root):
    return make_server(
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
        metrics_port=0, max_leases_per_session=32,
    )


def _stream_stats(server) -> pb.StreamStats:
    (st,) = get_stats(server.address).streams
    return st


def _row(server) -> list[str]:
    """The stream's row of `batchd status`, as {column: cell}."""
    lines = format_status(get_stats(server.address), server.address).splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("STREAM"))
    return dict(zip(lines[header].split(), lines[header + 1].split()))


def test_progress_reported_by_an_inline_client_is_what_it_took(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        call = stub.StreamBatches(pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=BATCH, prefetch=2,
                                                          stream_tag="p"), timeout=60)
        for _ in range(5):
            next(call)
        st = _stream_stats(server)
        assert st.batches_sent >= 5 and (st.batches_taken, st.samples_taken, st.images_per_second) == (0, 0, 0)
        assert st.images_per_second_sent > 0
        assert _row(server)["TAKEN"] == "-/100"
        # an inline client reports progress without a session
        progress = pb.StreamProgress(stream_tag="p", batches_taken=3, samples_taken=3 * BATCH)
        stub.ReleaseLeases(pb.ReleaseLeasesRequest(progress=[progress]), timeout=10)
        st = _stream_stats(server)
        assert (st.batches_taken, st.samples_taken) == (3, 300) and st.batches_sent >= 5
        assert st.images_per_second > 0 and st.bytes_copied > 0  # inline: every batch sent was copied
        row = _row(server)
        assert row["TAKEN"] == "3/100" and int(row["SENT"]) >= 5
        # a report for another call (or an older one) changes nothing; later reports only raise it
        for tag, n in (("other", 50), ("p", 2), ("p", 4)):
            progress = pb.StreamProgress(stream_tag=tag, batches_taken=n, samples_taken=n * BATCH)
            stub.ReleaseLeases(pb.ReleaseLeasesRequest(progress=[progress]), timeout=10)
        assert (_stream_stats(server).batches_taken, _stream_stats(server).samples_taken) == (4, 400)
        call.cancel()


def test_released_leases_count_as_taken_until_the_client_reports(server):
    with grpc.insecure_channel(server.address) as channel:
        session = RawSession(channel)
        call = session.stream("s", dataset="fmnist-test", batch_size=BATCH, prefetch=2)
        got = [next(call) for _ in range(3)]
        assert all(b.lease for b in got)
        session.release([got[0].lease, got[1].lease])
        st = _stream_stats(server)
        assert (st.batches_taken, st.samples_taken) == (2, 200) and st.batches_sent >= 3
        # the client's own report wins over the leases it released
        session.release(progress=[pb.StreamProgress(stream_tag="s", batches_taken=1, samples_taken=BATCH)])
        session.release([got[2].lease])
        st = _stream_stats(server)
        assert (st.batches_taken, st.samples_taken) == (1, 100)
        call.cancel()
        session.close()


def test_loader_progress_in_stats_status_and_metrics(server):
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, prefetch=2) as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        # the client reports what its loop took (every 0.5 s while it changes)
        assert wait_until(lambda: _stream_stats(server).batches_taken == 3, timeout=10), _stream_stats(server)
        st = _stream_stats(server)
        assert st.samples_taken == 300 and st.batches_sent >= 3
        assert _row(server)["TAKEN"] == "3/100"
        text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()
        samples = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert samples["batchd_stream_batches_taken_total"] == 3
        assert samples["batchd_stream_batches_sent_total"] >= 3
        assert "batchd_stream_images_per_second_sent" in samples
        del it
