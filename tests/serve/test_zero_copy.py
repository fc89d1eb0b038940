"""Same-host batches copy nothing: a slot is lent in place to every reader, counted by references."""

from __future__ import annotations

import logging
import mmap
import os
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

import batchd
from batchd.server.serve.stats import snapshot
from batchd.v1 import loader_pb2 as pb
from helpers import digest, wait_until
from rawclient import RawSession, digest as raw_digest, tensors

pytestmark = pytest.mark.timeout(180)

N_TEST, BATCH = 10_000, 200
NUM_BATCHES = N_TEST // BATCH


@pytest.fixture
def server(make_server, fmnist_root):
    import albumentations as A

    return make_server(
        workers=2,
        share_window=NUM_BATCHES,  # two readers in lockstep share one computation
        max_leases_per_session=4 * NUM_BATCHES,  # never falls back to inline here: what is counted is the transport
        metrics_port=0,
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
        pipelines={"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))},
    )


def _epoch(server, transport):
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=4,
                                 transform="flip", transport=transport, timeout=60) as loader:
        out = [(digest(b), sum(t.numel() * t.element_size() for t in b.values())) for b in loader]
    return [d for d, _ in out], sum(n for _, n in out)  # digests, tensor bytes received


def test_a_shared_memory_stream_copies_nothing_and_equals_inline(server, caplog):
    caplog.set_level(logging.INFO, logger="batchd.server.loader")
    shared, _ = _epoch(server, "shm")
    totals = snapshot(server.loader).totals
    assert (totals.bytes_copied_shm, totals.bytes_copied_inline) == (0, 0)
    assert "transport=shm" in caplog.text  # the loader did ask for shared memory
    inline, nbytes = _epoch(server, "inline")
    assert len(shared) == NUM_BATCHES and shared == inline
    totals = snapshot(server.loader).totals
    assert totals.bytes_copied_shm == 0
    assert totals.bytes_copied_inline == nbytes  # inline: each batch copied once, into its message
    text = urllib.request.urlopen(f"http://{server.metrics_address}/metrics", timeout=10).read().decode()
    copied = {s.labels.get("transport"): s.value for f in text_string_to_metric_families(text) for s in f.samples
              if s.name == "batchd_bytes_copied_total"}
    assert copied == {"shm": 0, "inline": nbytes, "socket": 0}
    assert wait_until(lambda: server.loader.leases.held_total == 0)


def _request(**kw):
    return dict(dataset="fmnist-test", batch_size=BATCH, shuffle=True, seed=4, pipeline=pb.Pipeline(preset="flip"), **kw)


def test_two_identical_streams_read_the_same_slot_in_place(server):
    loader = server.loader
    with grpc.insecure_channel(server.address) as channel:
        a, b = RawSession(channel), RawSession(channel)
        # the reference: an inline stream, computed on its own before the pair starts
        ref = [tensors(r) for r in a.stream("ref", transport=pb.TRANSPORT_INLINE, **_request())]
        want = [raw_digest(r) for r in ref]
        nbytes = sum(t.nbytes for r in ref for t in r.values())
        assert len(want) == NUM_BATCHES
        assert wait_until(lambda: loader.computations == 0)
        started = snapshot(loader).computations_started
        seen = 0
        for x, y in zip(a.stream("a", **_request()), b.stream("b", **_request())):
            assert x.batch_index == y.batch_index == seen
            # the same slot, lent to both (a copy would be another segment), under two leases
            assert x.segment and x.segment == y.segment and x.lease != y.lease
            assert raw_digest(tensors(x)) == raw_digest(tensors(y)) == want[seen]
            if seen == 0:
                # a client writing into its copy-on-write mapping changes nothing for the other reader
                fd = os.open(f"/dev/shm/{x.segment}", os.O_RDONLY)
                mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                os.close(fd)
                mm[:] = b"\xff" * len(mm)
                mm.close()
                assert raw_digest(tensors(y)) == want[0]
            a.release([x.lease])
            b.release([y.lease])
            seen += 1
        assert seen == NUM_BATCHES
        assert snapshot(loader).computations_started - started == 1  # the pair shared one computation
        a.close()
        b.close()
    totals = snapshot(loader).totals
    assert totals.bytes_copied_shm == 0
    assert totals.bytes_copied_inline == nbytes  # the inline reference only
    assert wait_until(lambda: loader.leases.held_total == 0 and loader.leases.sessions == 0)
    # every slot went back to the pool once the computation and both leases let go
    assert wait_until(lambda: loader.slots.in_use == 0 and loader.slots.lent == 0)


def test_a_client_slower_than_the_server_still_gets_every_batch_in_place(make_server, fmnist_root):
    """The default lease cap (8): gRPC buffers lent batches far ahead of a slow training loop; at the
    cap the stream waits for a lease to come back instead of copying the batch inline."""
    srv = make_server(workers=2, datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root),
                                                           "split": "test"}})
    assert srv.config.max_leases_per_session == 8
    with batchd.RemoteDataLoader(srv.address, "fmnist-test", batch_size=100, transport="shm", timeout=60) as loader:
        n = 0
        for _ in loader:
            n += 1
            time.sleep(0.01)  # a training step slower than the server
    assert n == 100
    assert snapshot(srv.loader).totals.bytes_copied_shm == 0
