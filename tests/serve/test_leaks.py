"""Nothing leaks: abandoned calls give their leases back, sessions hold no polling thread, short calls
always find a thread."""

from __future__ import annotations

import gc
import os
import threading

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import batchd
from batchd.server import shm
from batchd.server.serve.leases import LeaseTable
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import wait_until
from rawclient import RawSession

pytestmark = pytest.mark.timeout(300)

ROUNDS = 200
LOADER_ROUNDS = 30  # each opens and abandons a stream through the client (~0.4 s): a leak per round shows
MAX_SLOTS = 16


@pytest.fixture
def server(make_server, fmnist_root):
    # a session may hold more leases than an epoch has batches: a client that releases each batch as
    # it reads never sees inline batches, however far ahead gRPC buffers (what leaks is what is counted)
    return make_server(
        workers=2, max_slots=MAX_SLOTS, max_leases_per_session=128,
        datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}},
    )


def _fds() -> int:
    """Open file descriptors, not counting mapped slots (CPython's mmap keeps a dup of the file's fd;
    slots are counted by ``_segments``)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += not os.readlink(f"/proc/self/fd/{fd}").startswith(str(shm.SHM_DIR))
        except OSError:  # closed meanwhile (the listing's own fd)
            pass
    return n


def _segments(server) -> int:
    return sum(1 for p in shm.SHM_DIR.glob(f"{server.loader.owner.prefix}*"))


def _footprint(server) -> dict[str, int]:
    leases = server.loader.leases
    return {"leases": leases.held_total, "calls": leases.calls, "sessions": leases.sessions,
            "streams": len(server.loader.streams), "long_calls": server.service.long_calls,
            # gRPC's pool threads are made on demand up to grpc_threads and kept; long_calls counts those held
            "threads": sum(1 for t in threading.enumerate() if not t.name.startswith("batchd-rpc")), "fds": _fds(),
            "segments": _segments(server)}


def _settled(server, before: dict[str, int], live: int = 0) -> bool:
    """Nothing left but what ``before`` had, and ``live`` calls a loader still has open (each one
    stream; a loader keeps one call per server for its life)."""
    now = _footprint(server)
    return (now["leases"] == 0 and now["calls"] <= live and now["streams"] <= live
            and now["sessions"] == before["sessions"]
            and now["long_calls"] == before["long_calls"] and now["threads"] <= before["threads"]
            and now["fds"] <= before["fds"] + 2
            and now["segments"] <= MAX_SLOTS + 3)  # slots (lent ones beyond the cap are unlinked), probe, lock,
    # and the workers' stage board (server/compute/stages.py)


def test_abandoned_calls_give_back_every_lease_raw_protocol(server):
    """200 rounds of (open a shared-memory stream, read 1-3 batches, cancel) on the wire protocol."""
    request = dict(dataset="fmnist-test", batch_size=100, shuffle=True, prefetch=4)
    with grpc.insecure_channel(server.address) as channel:
        session = RawSession(channel)

        def one_round(i: int) -> None:
            tag = f"call-{i}"
            call = session.stream(tag, **request)
            received = []
            for _ in range(1 + i % 3):
                batch = next(call)
                assert batch.segment and batch.lease, f"round {i}: batch {batch.batch_index} came inline"
                received.append(batch.lease)
            call.cancel()  # gRPC had more batches (and their leases) buffered for this call
            session.release(received, abandoned=tag, received=received)

        for i in range(10):  # warm up: the pool's threads and slots exist
            one_round(i)
        assert wait_until(lambda: server.loader.leases.held_total == 0 and not server.loader.streams)
        before = _footprint(server)
        for i in range(10, 10 + ROUNDS):
            one_round(i)
        assert wait_until(lambda: _settled(server, before), timeout=30), f"{before} -> {_footprint(server)}"
        # the last stream still gets shared memory, every batch of its epoch
        lent = 0
        for batch in session.stream("last", **request):
            lent += bool(batch.segment)
            session.release([batch.lease] if batch.lease else [])
        assert lent == 100
        session.close()
    assert wait_until(lambda: server.loader.leases.sessions == 0)


def test_leases_of_a_call_abandoned_before_they_were_sent_are_never_kept():
    owner = shm.Owner()
    slots = shm.SlotPool(max_slots=4, prefix=owner.prefix)
    try:
        table = LeaseTable(slots, max_held=8)
        table.open("s")
        slot = slots.acquire(100)
        first, second = table.lend("s", slot, tag="t"), table.lend("s", slot, tag="t")
        assert slots.refs(slot) == 3  # the computation's reference and two leases
        assert len(table.abandon("s", "t", [first])) == 1  # the client got `first` only: `second` goes back
        assert table.lend("s", slot, tag="t") is None  # nothing more is lent on that call
        assert table.held("s") == 1 and slots.refs(slot) == 2
        table.call_ended("s", "t")
        assert table.calls == 1  # `first` is still out
        table.release("s", [first])
        assert table.calls == 0 and slots.refs(slot) == 1
        # a call the client gave up before it reached the server lends nothing when it does
        table.abandon("s", "early", [])
        assert table.lend("s", slot, tag="early") is None and slots.refs(slot) == 1
        slots.release(slot)
        assert slots.refs(slot) == 0 and slots.in_use == 0
    finally:
        slots.close()
        owner.close()


def test_a_lent_slot_is_reused_only_when_every_holder_let_go():
    owner = shm.Owner()
    slots = shm.SlotPool(max_slots=2, prefix=owner.prefix)
    try:
        a = slots.acquire(100)
        slots.lend(a)
        slots.lend(a)
        slots.release(a)  # the computation let go; two leases still read it
        assert slots.in_use == 0 and slots.lent == 1
        b, c = slots.acquire(100), slots.acquire(100)  # a lent slot does not count against max_slots
        assert a is not b and a is not c and slots.acquire(100) is None
        slots.give_back(a)
        assert slots.acquire(100) is None  # still lent once
        slots.give_back(a)  # the last holder: the pool is full (b, c), so `a` is unlinked
        assert not (shm.SHM_DIR / a.name).exists() and slots.refs(a) == 0
        slots.release(b)
        assert slots.acquire(100) is b  # a free slot is reused
        with pytest.raises(ValueError, match="not held"):
            slots.lend(a)
    finally:
        slots.close()
        owner.close()


def test_streams_and_sessions_never_take_the_threads_of_short_calls(make_server, fmnist_root):
    """grpc_threads 4: 2 kept for short calls; 6 sessions ask for threads, 2 get them."""
    srv = make_server(grpc_threads=4, datasets={"fmnist-test": {
        "kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with grpc.insecure_channel(srv.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        opened, refused = [], []
        for _ in range(6):
            try:
                opened.append(RawSession(channel))
            except grpc.RpcError as e:
                refused.append(e.code())
        assert len(opened) == 2 and refused == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4
        with pytest.raises(grpc.RpcError) as info:  # a stream too: no thread is left for long calls
            next(iter(stub.StreamBatches(pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=10), timeout=30)))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for _ in range(20):  # short calls are always served
            assert stub.Stats(pb.StatsRequest(), timeout=10).pool.sessions == 2
            stub.ReleaseLeases(pb.ReleaseLeasesRequest(session=opened[0].session, leases=[1]), timeout=10)
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        for s in opened:
            s.close()
        assert wait_until(lambda: srv.service.long_calls == 0 and srv.loader.leases.sessions == 0)
        # the threads are free again: a session opens
        RawSession(channel).close()


def test_an_idle_session_does_not_hold_shutdown(make_server, fmnist_root):
    srv = make_server(datasets={"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with grpc.insecure_channel(srv.address) as channel:
        session = RawSession(channel)
        assert wait_until(lambda: srv.loader.leases.sessions == 1)
        stopper = threading.Thread(target=srv.stop, kwargs={"grace": 30})
        stopper.start()
        stopper.join(10)  # well under the grace period: drain ended the session
        assert not stopper.is_alive()
        with pytest.raises((grpc.RpcError, StopIteration)):  # ended by the server
            next(session.call)


# ---- end to end, through RemoteDataLoader (needs the client half: abandoned_stream reporting) ----------


def test_early_breaks_through_the_loader_leak_nothing(server):
    loader = server.loader
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=100, shuffle=True, transport="shm",
                                 prefetch=4, timeout=60) as ld:
        def one_round(i: int) -> None:
            for j, _ in enumerate(ld):
                if j == i % 3:
                    break
            gc.collect()

        for i in range(10):
            one_round(i)
        # (the loader's one call lives on between its passes: one stream)
        assert wait_until(lambda: loader.leases.held_total == 0 and len(loader.streams) <= 1, timeout=30)
        before = _footprint(server)
        for i in range(LOADER_ROUNDS):
            one_round(i)
        assert wait_until(lambda: _settled(server, before, live=1), timeout=30), f"{before} -> {_footprint(server)}"
        copied = loader.transport.bytes_copied["shm"]
        assert sum(b["image"].shape[0] for b in ld) == 10_000
        assert loader.transport.bytes_copied["shm"] == copied  # the last epoch still came in shared memory
