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


# --- 2. abandoned calls, retried releases, progress, reconnects --------------------------------


def calls(ld):
    """The lane threads of ``ld``'s iteration in progress (``batchd.client.feed``), by address."""
    feed = ld.servers._feed
    return {server.address: runner for server, runner in feed._runners.items()}


def tags(ld) -> set[str]:
    return {runner.record.tag for runner in calls(ld).values() if runner.record is not None}


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


def test_an_abandoned_call_names_every_lease_it_received(make_server, fmnist_root, release_requests, released):
    server = _server(make_server, fmnist_root)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, prefetch=6, transport="shm") as ld:
        it = iter(ld)
        held = [next(it), next(it)]
        (tag,) = tags(ld)
        session = ld._shm.session
        it.close()  # the user breaks out: the call is cancelled and reported
        assert wait_until(lambda: any(r.abandoned_stream == tag for r in release_requests), 10), release_requests
        abandoned = next(r for r in release_requests if r.abandoned_stream == tag)
        assert abandoned.session == session
        received = set(abandoned.received_leases)
        assert len(received) >= 2, "the two batches taken came on leases"
        del held
        gc.collect()
        # every lease the call received comes back (on the call while it was open, by ReleaseLeases
        # after): none is lost between "received" and "released", and the server can release all others
        assert wait_until(lambda: received <= set(released.get(session, ())), 10), (received, released)
        assert wait_until(lambda: server.loader.leases.held(session) == 0, 10)


def test_a_failed_release_is_retried(make_server, fmnist_root, release_requests):
    server = _server(make_server, fmnist_root)
    release_requests.state["fail_first"] = True
    leases = server.loader.leases
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=1000, transport="shm") as ld:
        batch = next(iter(ld))
        session = ld._shm.session
        assert wait_until(lambda: not server.loader.streams, 10)
        del batch
        gc.collect()
        assert wait_until(lambda: leases.held(session) == 0, 15), "the lease was dropped, not retried"
        tries = [list(r.leases) for r in release_requests if r.leases]
        assert len(tries) >= 2 and set(tries[0]) <= {x for t in tries[1:] for x in t}, tries


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


def test_a_reconnect_closes_the_old_session(make_server, fmnist_root):
    server = _server(make_server, fmnist_root)
    leases = server.loader.leases
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=500, transport="shm",
                                 reconnect_timeout=30) as ld:
        it = iter(ld)
        held = next(it)
        old = ld._shm.session
        next(iter(calls(ld).values())).call.call.cancel()  # the call breaks (gRPC's own cancel); the loader reconnects
        indices = [held["index"].clone()] + [next(it)["index"].clone() for _ in range(3)]
        assert ld._shm.session != old
        assert torch.cat(indices).unique().numel() == 2000, "a batch was lost or repeated across the reconnect"
        sessions, old_held = leases.sessions, leases.held(old)
        assert sessions == 2 and old_held >= 1  # the held batch keeps the old session open
        del held
        gc.collect()
        assert wait_until(lambda: leases.sessions == 1, 10), "the old session was dropped, not closed"
        it.close()


def test_a_server_leaving_mid_epoch_reports_its_call_abandoned(make_server, fmnist_root, release_requests):
    """A server that leaves the address mid-epoch: its call is cancelled and reported abandoned
    with the leases received on it (the server releases the others gRPC had buffered), its
    batches go to the other server, and the epoch goes on in order."""
    servers = [_server(make_server, fmnist_root) for _ in range(2)]
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", batch_size=100, prefetch=4,
                                 transport="shm", probe_interval=60) as ld:
        it = iter(ld)
        indices = [next(it)["index"].clone() for _ in range(4)]
        leaving = next(s for s in ld.servers._servers if s.address == servers[1].address)
        tag = calls(ld)[leaving.address].record.tag
        ld.servers._feed.retire(leaving)  # as when it leaves the address
        indices += [b["index"].clone() for b in it]
        assert wait_until(lambda: tag in {r.abandoned_stream for r in release_requests}, 10), release_requests
        assert torch.cat(indices).tolist() == list(range(10_000))
        session = next(r.session for r in release_requests if r.abandoned_stream == tag)
        gc.collect()
        assert wait_until(lambda: servers[1].loader.leases.held(session) == 0, 10)


def test_a_survivors_leases_return_after_a_failover(server_procs, fmnist_root, tmp_path):
    """SIGKILL one of two servers mid-epoch: the survivor's calls cancelled by the new split are
    reported abandoned, so once the epoch is read and its batches freed it holds no lease, while
    the loader (and its session) is still open."""
    cfg = write_server_config(tmp_path, fmnist_root, workers=1)
    procs = [server_procs(cfg, f"127.0.0.1:{free_port()}") for _ in range(2)]
    for p in procs:
        p.start()
    with batchd.RemoteDataLoader([p.address for p in procs], "fmnist-test", batch_size=100, prefetch=4,
                                 transport="shm", failover_timeout=1, probe_interval=60, timeout=60) as ld:
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


def test_a_lease_arriving_after_the_call_was_abandoned_is_never_used(make_server, fmnist_root, monkeypatch):
    """A message the lane thread got from gRPC just as its call was given up (reported abandoned,
    naming the leases received so far): its lease is the server's to release, so the loader
    neither holds it, maps it nor releases it, nor keeps the batch."""
    server = _server(make_server, fmnist_root)
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, transport="shm") as ld:
        it = iter(ld)
        next(it)
        feed = ld.servers._feed
        runner = next(iter(calls(ld).values()))
        record = runner.record
        touched = []
        for name in ("hold", "release_unused", "tensors"):
            monkeypatch.setattr(record.shm, name, lambda *a, name=name: touched.append((name, a)))
        assert record.close(abandoned=True) is not None  # as end_call does
        b = feed.total - 1  # (not arrived: the loop is at the epoch's start)
        late = wire.decode_batch(pb.Batch(batch_index=b, segment="batchd-x-slot-1", lease=987654).SerializeToString())
        feed.arrive(runner, late, 0.0, 100, record)
        assert touched == [], "a lease the server releases (not named as received) was used"
        assert b not in feed._raw and 987654 not in record.close(abandoned=True)
        monkeypatch.undo()
        it.close()


def test_leases_freed_at_an_epoch_boundary_ride_on_the_next_call(make_server, fmnist_root, release_requests,
                                                                   released):
    """A training loop over several epochs frees the last batches of each epoch after its call
    ended: they wait for the next epoch's call (``Reporter.hold``) instead of a ReleaseLeases call
    each epoch (about one per epoch before). Every lease still comes back, the last epoch's by
    ReleaseLeases once no call comes to carry them."""
    server = _server(make_server, fmnist_root)
    epochs = 6
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=1000, transport="shm") as ld:
        received = 0
        for epoch in range(epochs):
            ld.set_epoch(epoch)
            for batch in ld:  # (each batch freed when the next replaces it, the last one by the next epoch's first)
                received += 1
        session = ld._shm.session
        during = [list(r.leases) for r in release_requests if r.leases]
        del batch
        gc.collect()
        assert received == epochs * 10
        # one boundary's leases may go by ReleaseLeases (a slow round on a loaded machine), not each one's
        assert len(during) <= 1, f"{len(during)} ReleaseLeases calls over {epochs} epochs: {during}"
        assert wait_until(lambda: server.loader.leases.held(session) == 0, 10), "a lease freed after the last call never came back"
        assert len(set(released[session])) == received, "a lease was never released (or released twice)"
        assert any(r.leases for r in release_requests), "the last batch's lease came back, but not by ReleaseLeases"
