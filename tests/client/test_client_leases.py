"""The client side of shared memory and leases, against real servers: copy-on-write mappings,
abandoned calls naming the leases they received, retried releases, releases and progress riding
on the Batches call, and a reconnect that closes the old session.
"""

from __future__ import annotations

import gc
import signal
import uuid

import grpc
import pytest
import torch

import batchd
from batchd.client.transport import shm as client_shm
from batchd.client.transport.server_stats import get_stats
from batchd import wire
from batchd.v1 import loader_pb2 as pb
from helpers import free_port, wait_until
from procs import write_server_config

pytestmark = pytest.mark.timeout(120)

KW = dict(batch_size=500, shuffle=True, seed=5, transform="flip")


# --- 1. copy-on-write ---------------------------------------------------------------------------


def test_a_write_into_a_mapped_segment_never_reaches_the_segment():
    name = f"batchd-test-cow-{uuid.uuid4().hex}"
    path = client_shm.SHM_DIR / name
    path.write_bytes(bytes(range(256)) * 64)
    try:
        mm = client_shm.map_private(name, 4096)
        view = memoryview(mm)
        view[:16] = b"\xff" * 16  # writable, as DataLoader batches are
        assert bytes(view[:16]) == b"\xff" * 16
        with open(path, "rb") as f:
            assert f.read(16) == bytes(range(16)), "the write reached the server's segment"
        view.release()
        mm.close()
    finally:
        path.unlink()


def test_a_write_in_one_reader_is_not_seen_by_another_reader(fmnist_server):
    """Two identical shared-memory streams share one computation: what one reader writes into its
    batches stays in its process's copy of the pages, and a slot that comes back with a later
    batch shows that batch's bytes, not the earlier write."""
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport="inline", **KW) as ref:
        want = [b["image"].clone() for b in ref]
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport="shm", **KW) as a, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport="shm", **KW) as b:
        it_a, it_b = iter(a), iter(b)
        for k, expected in enumerate(want):
            batch = next(it_a)
            assert torch.equal(batch["image"], expected), f"reader A, batch {k}: not the server's bytes"
            batch["image"].fill_(255)  # in place, as a training loop may; then freed (the slot is reused)
            del batch
            assert torch.equal(next(it_b)["image"], expected), f"reader B, batch {k}: sees reader A's write"


# --- 2. released on the call, retried releases, progress, reconnects, passes let go of ---------------


def link(ld, address: str | None = None):
    """The link (``batchd.client.transport.link.ServerLink``) of ``ld``'s server at ``address``
    (its first one by default)."""
    return next(x for x in ld.servers.links if address is None or x.address == address)


@pytest.fixture
def released(monkeypatch):
    """Every lease the servers started after this fixture release, by session, whichever way the
    client sent it (on a Batches call or by ReleaseLeases)."""
    from batchd.server.serve.transport import Transport

    seen: dict[str, list[int]] = {}
    real = Transport.release_leases

    def spy(self, session, leases):
        seen.setdefault(session, []).extend(leases)
        return real(self, session, leases)

    monkeypatch.setattr(Transport, "release_leases", spy)
    return seen


@pytest.fixture
def release_requests(monkeypatch):
    """Every ReleaseLeasesRequest the servers started after this fixture receive (a copy), in
    order; ``fail_first`` aborts the first one that releases leases with UNAVAILABLE."""
    from batchd.server.serve.service import BatchLoaderService

    class Seen(list):
        state: dict

    seen = Seen()
    state = {"fail_first": False}
    real = BatchLoaderService.ReleaseLeases

    def spy(self, request, context):
        copy = pb.ReleaseLeasesRequest()
        copy.CopyFrom(request)
        seen.append(copy)
        if state["fail_first"] and request.leases:
            state["fail_first"] = False
            context.abort(grpc.StatusCode.UNAVAILABLE, "the test drops this request")
        return real(self, request, context)

    monkeypatch.setattr(BatchLoaderService, "ReleaseLeases", spy)
    seen.state = state
    return seen


def _server(make_server, fmnist_root, **config):
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}
    return make_server(workers=1, datasets=datasets, **config)


def test_a_pass_let_go_of_gives_every_lease_back_on_the_call(make_server, fmnist_root, release_requests, released):
    """A ``break`` after two batches: the call lives on (the loader's next pass uses it), the
    pass's grants are revoked, batches already sent are dropped as they come and their leases
    released on the call; the two held come back when freed. No ReleaseLeases call, none lost."""
    server = _server(make_server, fmnist_root)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, prefetch=6, transport="shm") as ld:
        it = iter(ld)
        held = [next(it), next(it)]
        session = ld._shm.session
        it.close()  # the user breaks out
        assert wait_until(lambda: server.loader.leases.held(session) == 2, 10), server.loader.leases.held(session)
        del held
        gc.collect()
        assert wait_until(lambda: server.loader.leases.held(session) == 0, 10)
        assert len(released[session]) == len(set(released[session])) >= 2  # each once
        assert not any(r.leases for r in release_requests), release_requests


def test_a_failed_release_is_retried(make_server, fmnist_root, release_requests):
    """A batch held past ``close``: its release goes by ReleaseLeases (no call to carry it); the
    first try fails (UNAVAILABLE) and is retried."""
    server = _server(make_server, fmnist_root)
    release_requests.state["fail_first"] = True
    leases = server.loader.leases
    ld = batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=1000, transport="shm")
    batch = next(iter(ld))
    session = ld._shm.session
    ld.close()
    assert wait_until(lambda: not server.loader.streams, 10)
    assert leases.held(session) == 1  # the session stays while a batch on it is held
    del batch
    gc.collect()
    assert wait_until(lambda: leases.held(session) == 0, 15), "the lease was dropped, not retried"
    tries = [list(r.leases) for r in release_requests if r.leases]
    assert len(tries) >= 2 and set(tries[0]) <= {x for t in tries[1:] for x in t}, tries
    assert wait_until(lambda: leases.sessions == 0, 10), "the session did not end once nothing was held"


@pytest.mark.parametrize("transport", ["inline", "shm"])
def test_progress_and_releases_ride_on_the_call(make_server, fmnist_root, release_requests, transport):
    """What the loop took reaches the server while it reads (at least every progress interval,
    not only when the call ends), on the Batches call itself: no ReleaseLeases call carries it,
    nor the leases freed meanwhile."""
    server = _server(make_server, fmnist_root)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, transport=transport) as ld:
        it = iter(ld)
        taken = [next(it) for _ in range(3)]
        (stream,) = server.loader.streams.values()
        # (over shared memory, a freed lease alone counts a batch taken: wait for the reported figure)
        assert wait_until(lambda: stream.samples_taken == 300 and stream.reports_progress, 10), stream.batches_taken
        assert stream.batches_taken == 3 and sum(len(b["index"]) for b in taken) == 300
        del taken
        gc.collect()
        next(it)
        assert wait_until(lambda: stream.batches_taken == 4, 10), stream.batches_taken
        if transport == "shm":
            assert wait_until(lambda: server.loader.leases.held(ld._shm.session) <= 2 + 5, 10)
        assert not any(r.leases or r.progress for r in release_requests), release_requests
        it.close()


def test_a_broken_call_is_reported_and_resumed_on_the_same_session(make_server, fmnist_root, release_requests):
    """The call breaks under a live server (a lost connection): the link opens a new call on the
    same session and reports the broken one (``abandoned_stream``, naming the leases still held
    here), so the server releases what it sent on it that never came; nothing lost or repeated."""
    server = _server(make_server, fmnist_root)
    leases = server.loader.leases
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=500, transport="shm",
                                 reconnect_timeout=30) as ld:
        it = iter(ld)
        held = next(it)
        session = ld._shm.session
        link(ld)._call.call.cancel()  # the call breaks (gRPC's own cancel); the loader reconnects
        indices = [held["index"].clone()] + [next(it)["index"].clone() for _ in range(3)]
        assert ld._shm.session == session and leases.sessions == 1
        assert torch.cat(indices).unique().numel() == 2000, "a batch was lost or repeated across the reconnect"
        assert wait_until(lambda: any(r.abandoned_stream for r in release_requests), 10), release_requests
        report = next(r for r in release_requests if r.abandoned_stream)
        assert report.session == session and report.received_leases  # (the held batch's among them)
        assert leases.held(session) >= 1  # the held batch's slot stays lent
        del held
        gc.collect()
        it.close()
        assert wait_until(lambda: leases.held(session) == 0, 10)


def test_a_server_leaving_mid_epoch_gives_its_batches_to_the_other(make_server, fmnist_root):
    """A server that leaves the address mid-epoch: its batches go to the other server at once,
    the epoch goes on in order, and every lease it lent comes back once its link closed."""
    servers = [_server(make_server, fmnist_root) for _ in range(2)]
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", batch_size=100, prefetch=4,
                                 transport="shm", probe_interval=60) as ld:
        it = iter(ld)
        indices = [next(it)["index"].clone() for _ in range(4)]
        ld.servers.follow([servers[0].address])  # as when the address no longer names it
        indices += [b["index"].clone() for b in it]
        assert torch.cat(indices).tolist() == list(range(10_000))
        assert [s["retired"] for s in ld.server_stats()] == [False, True]
        gc.collect()
        assert wait_until(lambda: servers[1].loader.leases.held_total == 0, 10)


def test_a_survivors_leases_return_after_a_failover(server_procs, fmnist_root, tmp_path):
    """SIGKILL one of two servers mid-epoch: the survivor takes its batches; once the epoch is
    read and its batches freed the survivor holds no lease, while the loader (and its session) is
    still open."""
    cfg = write_server_config(tmp_path, fmnist_root, workers=1)
    procs = [server_procs(cfg, f"127.0.0.1:{free_port()}") for _ in range(2)]
    for p in procs:
        p.start()
    with batchd.RemoteDataLoader([p.address for p in procs], "fmnist-test", batch_size=100, prefetch=4,
                                 transport="shm", probe_interval=60, timeout=60) as ld:
        it = iter(ld)
        indices = [next(it)["index"].clone() for _ in range(10)]
        procs[1].signal(signal.SIGKILL)
        procs[1].wait(10)
        indices += [b["index"].clone() for b in it]
        assert torch.cat(indices).sort().values.tolist() == list(range(10_000)), "a sample is missing or repeated"
        assert [s["up"] for s in ld.server_stats()] == [True, False]
        gc.collect()
        assert wait_until(lambda: get_stats(procs[0].address).pool.leases_held == 0, 15), (
            f"the survivor still lends {get_stats(procs[0].address).pool.leases_held} slots")
        assert get_stats(procs[0].address).pool.sessions == 1


def test_a_batch_of_an_earlier_pass_is_dropped_and_its_lease_released(make_server, fmnist_root, released):
    """A ``break`` and a new pass at once: batches the server sent for the earlier ``open`` before
    it switched (``Batch.open_seq``) are never used: each is dropped and its lease released; the
    new pass gets its own batches in order; nothing is left held."""
    server = _server(make_server, fmnist_root)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, prefetch=8, transport="shm") as ld:
        ld.set_epoch(3)
        with torch.no_grad():
            first = next(iter(ld))["index"].clone()  # the pass is let go of with grants outstanding
        ld.set_epoch(3)
        again = [b["index"].clone() for b in ld]
        session = ld._shm.session
        assert torch.equal(again[0], first) and torch.cat(again).sort().values.tolist() == list(range(10_000))
        gc.collect()
        assert wait_until(lambda: server.loader.leases.held(session) == 0, 10)
        assert len(released[session]) == len(set(released[session]))  # none released twice


def test_one_call_serves_every_epoch_and_no_release_needs_an_rpc(make_server, fmnist_root, release_requests,
                                                                released):
    """A training loop over several epochs: one Batches call per server for the loader's life
    (each epoch a later ``open`` on it), every lease released on it, the last batch's too, while
    the loader is open: no ReleaseLeases call at all."""
    server = _server(make_server, fmnist_root)
    epochs = 6
    started = get_stats(server.address).totals.batches_calls_started
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=1000, transport="shm") as ld:
        received = 0
        for epoch in range(epochs):
            ld.set_epoch(epoch)
            for batch in ld:  # (each batch freed when the next replaces it, the last one by the next epoch's first)
                received += 1
        session = ld._shm.session
        del batch
        gc.collect()
        assert received == epochs * 10
        assert wait_until(lambda: server.loader.leases.held(session) == 0, 10), "a freed lease never came back"
        assert len(set(released[session])) == received, "a lease was never released (or released twice)"
        assert not any(r.leases for r in release_requests), release_requests
    assert get_stats(server.address).totals.batches_calls_started - started == 1
