"""Several servers feeding one loader: strided streams, the merge, failover, a server coming back,
DNS names with several addresses, and the shard from the torch.distributed environment.

Servers are real: in this process (``make_server``) where nothing is killed, ``batchd serve``
subprocesses (tests/serve/test_faults.py's helpers) where one is SIGKILLed or restarted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import socket
import time

import albumentations as A
import grpc
import numpy as np
import pytest

import batchd
from batchd.client.transport import addresses as addr_mod
from batchd.client.transport.addresses import server_addresses
from batchd.client.loader.distributed import rank_and_world_size
from batchd.client.iteration.servers import Servers
from batchd.sampler import shard_indices
from batchd.server.compute.protocol import StreamRequest
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from conftest import running_server
from helpers import digest, free_port, wait_until
from procs import fmnist_test_config, write_server_config

pytestmark = pytest.mark.timeout(180)

N_TEST = 10_000
AUG = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-20, 20), p=0.7), A.RandomBrightnessContrast(p=0.5)])
KW = dict(batch_size=200, shuffle=True, seed=7, transform=AUG, timeout=60, connect_timeout=10)


def read(ld, limit=None):
    """(digests, index arrays) of the next ``limit`` batches (all, if None) of ``ld``: a loader (a new
    iteration) or an iterator over one (it goes on)."""
    digests, indices = [], []
    for i, b in enumerate(ld):
        digests.append(digest(b))
        indices.append(b["index"].numpy().copy())
        if limit is not None and i + 1 == limit:
            break
    return digests, indices


def exactly_once(indices) -> bool:
    return bool((np.bincount(np.concatenate(indices), minlength=N_TEST) == 1).all())


@pytest.fixture(scope="module")
def servers(fmnist_root, tmp_path_factory):
    """Three in-process servers of 1 worker each over fmnist-test (for tests that stop none)."""
    cache = tmp_path_factory.mktemp("multi-cache")
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(running_server(workers=1, cache_dir=cache, datasets=fmnist_test_config(fmnist_root)))
               for _ in range(3)]


@pytest.fixture(scope="module")
def reference(servers):
    """Every batch of epochs 0 and 1 from the first server alone."""
    with batchd.RemoteDataLoader(servers[0].address, "fmnist-test", **KW) as ld:
        return [read(ld)[0], read(ld)[0]]


# --- the strided stream on the server (StreamBatches, kept for older clients) ---------------------


def stream_indices(address, **fields) -> list[int]:
    """The batch indices a StreamBatches call of fmnist-test in batches of 200 sends (generated stub)."""
    with grpc.insecure_channel(address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        request = pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=200, transport=pb.TRANSPORT_INLINE, **fields)
        return [b.batch_index for b in stub.StreamBatches(request, timeout=60)]


def test_strided_stream_sends_every_stride_th_batch_from_start(fmnist_server):
    for start, stride, offset in ((5, 3, 1), (0, 2, 0), (48, 4, 1), (49, 4, 3)):
        got = stream_indices(fmnist_server.address, start_batch=start, batch_stride=stride, batch_offset=offset)
        assert got == list(range(start + offset, 50, stride)), (start, stride, offset)
    with pytest.raises(grpc.RpcError, match=r"batch_offset must be in \[0, batch_stride=2\)"):
        stream_indices(fmnist_server.address, batch_stride=2, batch_offset=2)


def test_strided_streams_share_only_with_the_same_batches(fmnist_server):
    loader = fmnist_server.loader
    base = dict(dataset="fmnist-test", batch_size=200, shuffle=True, seed=99)
    a = loader.open_stream(StreamRequest(**base, batch_stride=3, batch_offset=1))
    same = loader.open_stream(StreamRequest(**base, batch_stride=3, batch_offset=1))
    shifted = loader.open_stream(StreamRequest(**base, start_batch=3, batch_stride=3, batch_offset=1))  # 4, 7, ...
    other = loader.open_stream(StreamRequest(**base, batch_stride=3, batch_offset=2))
    whole = loader.open_stream(StreamRequest(**base))
    try:
        assert same.computation is a.computation
        # the same batches from 4 on: the same key (it joins once a's computation has reached 4)
        assert shifted.request.key == a.request.key and shifted.position == 4
        assert other.request.key != a.request.key != whole.request.key
        assert other.computation is not a.computation and whole.computation is not a.computation
        assert (a.position, other.position, whole.position) == (1, 2, 0)
        assert a.batches_due == len(range(1, 50, 3)) and other.batches_due == len(range(2, 50, 3))
        got = []
        while not a.finished:
            batch = a.next(30)
            if batch is not None:
                got.append(batch.batch_index)
                a.release(batch)
        assert got == list(range(1, 50, 3))
    finally:
        for s in (a, same, shifted, other, whole):
            loader.close_stream(s, "cancelled by the test")


# --- several servers, one stream -------------------------------------------------------------------


@pytest.mark.parametrize("n, transport", [(2, "inline"), (3, "auto")])
def test_several_servers_give_the_bytes_of_one_exactly_once(servers, reference, n, transport):
    built = [s.loader.pool.batches_built for s in servers]
    with batchd.RemoteDataLoader([s.address for s in servers[:n]], "fmnist-test", transport=transport, **KW) as ld:
        assert isinstance(ld, batchd.RemoteDataLoader) and not ld.servers.single
        assert len(ld) == 50
        regranted = 0
        for epoch in range(2):
            digests, indices = read(ld)
            assert digests == reference[epoch], f"epoch {epoch} differs from one server's"
            assert exactly_once(indices)
            regranted += sum(s["regranted"] for s in ld.server_stats())
        assert ld.epoch == 2
        per_server = [s["batches"] for s in ld.server_stats()]
    # (the batches go to whichever server has credit: the shares are not fixed, their sum is)
    assert sum(per_server) == 100 and all(p > 0 for p in per_server), per_server
    # each batch was built once, by one server (one granted again elsewhere aside), not the whole epoch on each
    extra = [s.loader.pool.batches_built - b for s, b in zip(servers[:n], built)]
    assert sum(extra) <= 100 + regranted and all(e < 100 for e in extra), (extra, regranted)


def test_state_dict_moves_between_one_and_several_servers(servers, reference):
    addresses = [s.address for s in servers]
    with batchd.RemoteDataLoader(addresses, "fmnist-test", **KW) as multi:
        first, _ = read(multi, 7)
        state = multi.state_dict()
    assert state["epoch"] == 0 and state["next_batch"] == 7
    with batchd.RemoteDataLoader(servers[1].address, "fmnist-test", **KW) as single:
        single.load_state_dict(state)
        rest, _ = read(single)
        assert first + rest == reference[0]
        single.set_epoch(1)
        part, _ = read(single, 20)
        state = single.state_dict()
    with batchd.RemoteDataLoader(addresses[:2], "fmnist-test", **KW) as multi:
        multi.load_state_dict(state)
        rest, _ = read(multi)
        assert part + rest == reference[1]
        multi.set_epoch(1)
        assert read(multi)[0] == reference[1]


def test_all_servers_gone_is_a_connection_error(make_server, fmnist_root):
    servers = [make_server(workers=1, datasets=fmnist_test_config(fmnist_root)) for _ in range(2)]
    kw = {**KW, "connect_timeout": 1}
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", reconnect_timeout=2,
                                 probe_interval=0.5, **kw) as ld:
        it = iter(ld)
        next(it)
        for s in servers:
            s.stop(grace=0)
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="lost every batchd server"):
            for _ in it:
                pass
        assert time.monotonic() - start < 30


def test_no_server_answers_at_construction():
    with pytest.raises(ConnectionError, match="no batchd server answered at any of"):
        batchd.RemoteDataLoader([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"], "fmnist-test",
                                connect_timeout=1)


# --- failures: a server killed, a server restarted ---------------------------------------------------


def start_servers(server_procs, cfg, count):
    """``count`` server subprocesses on fixed free ports, started in parallel."""
    procs = [server_procs(cfg, f"127.0.0.1:{free_port()}") for _ in range(count)]
    with concurrent.futures.ThreadPoolExecutor(count) as pool:
        for f in [pool.submit(p.start) for p in procs]:
            f.result()
    return procs


def test_server_killed_mid_epoch_others_take_over(server_procs, fmnist_root, tmp_path):
    cfg = write_server_config(tmp_path, fmnist_root, workers=1)
    procs = start_servers(server_procs, cfg, 3)
    with batchd.RemoteDataLoader(procs[0].address, "fmnist-test", **KW) as ld:
        clean, _ = read(ld)
    with batchd.RemoteDataLoader([p.address for p in procs], "fmnist-test", probe_interval=0.5,
                                 **KW) as ld:
        it = iter(ld)
        digests, indices = read(it, 10)
        procs[1].signal(signal.SIGKILL)
        procs[1].wait(10)
        more, more_idx = read(it)
        stats = ld.server_stats()
    assert digests + more == clean, "the epoch across a failover differs from one server's"
    assert exactly_once(indices + more_idx), "a sample is missing or repeated"
    assert [s["up"] for s in stats] == [True, False, True]
    assert stats[1]["batches"] <= 10 + 1 and stats[0]["batches"] + stats[2]["batches"] >= 39, stats


def test_restarted_server_gets_work_again(server_procs, fmnist_root, tmp_path):
    cfg = write_server_config(tmp_path, fmnist_root, workers=1)
    procs = start_servers(server_procs, cfg, 2)
    kw = {**KW, "batch_size": 50}  # 200 batches
    with batchd.RemoteDataLoader(procs[0].address, "fmnist-test", **kw) as ld:
        clean, _ = read(ld)
    with batchd.RemoteDataLoader([p.address for p in procs], "fmnist-test", probe_interval=0.5,
                                 **kw) as ld:
        it = iter(ld)
        digests, indices = read(it, 20)
        procs[1].signal(signal.SIGKILL)
        procs[1].wait(10)
        d, i = read(it, 20)  # server 0 alone after the failover
        digests, indices = digests + d, indices + i
        # (server 0's lookahead may carry those 20 batches before the lane gives server 1 up)
        assert wait_until(lambda: [s["up"] for s in ld.server_stats()] == [True, False], 15), ld.server_stats()
        before = ld.server_stats()[1]["batches"]
        procs[1].start()  # same address
        assert wait_until(lambda: ld.server_stats()[1]["up"], 60), ld.server_stats()
        d, i = read(it)
        digests, indices = digests + d, indices + i
        after = ld.server_stats()
    assert digests == clean and exactly_once(indices)
    assert after[1]["batches"] - before >= 60, f"the restarted server got no share of the rest: {after}"


# --- addresses ----------------------------------------------------------------------------------------


def test_server_addresses_forms(monkeypatch):
    real = socket.getaddrinfo

    def fake(host, port, family=0, type=0, *args):
        if host == "batchd.svc.test":
            if family == socket.AF_INET:
                return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("10.0.0.3", "10.0.0.1")]
            raise socket.gaierror("no AAAA")
        if host == "one.svc.test":
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("10.0.0.9", port))]
        return real(host, port, family, type, *args)

    monkeypatch.setattr(addr_mod.socket, "getaddrinfo", fake)
    assert server_addresses("dns:///batchd.svc.test:50051") == ["10.0.0.1:50051", "10.0.0.3:50051"]
    assert server_addresses("batchd.svc.test:50051") == ["10.0.0.1:50051", "10.0.0.3:50051"]
    assert server_addresses("one.svc.test:1") == ["one.svc.test:1"]  # gRPC resolves a single one itself
    assert server_addresses("unix:/run/batchd/batchd.sock") == ["unix:/run/batchd/batchd.sock"]
    assert server_addresses("127.0.0.1:5") == ["127.0.0.1:5"]
    assert server_addresses("[::1]:5") == ["[::1]:5"]
    assert server_addresses(["127.0.0.1:5", "batchd.svc.test:7", "127.0.0.1:5"]) == [
        "127.0.0.1:5", "10.0.0.1:7", "10.0.0.3:7"]
    with pytest.raises(ValueError):
        server_addresses([])


def test_dns_name_with_several_addresses_feeds_one_loader(make_server, fmnist_root, monkeypatch):
    """A headless-Service-like name: two servers on one port at 127.0.0.1 and 127.0.0.2."""
    port = free_port()
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.2", port))
    except OSError:
        pytest.skip("127.0.0.2 is not a loopback address here")
    a = make_server(workers=1, address=f"127.0.0.1:{port}", datasets=fmnist_test_config(fmnist_root))
    b = make_server(workers=1, address=f"127.0.0.2:{port}", datasets=fmnist_test_config(fmnist_root))
    real = socket.getaddrinfo

    def fake(host, p, family=0, type=0, *args):
        if host == "batchd.default.svc.cluster.local":
            if family != socket.AF_INET:
                raise socket.gaierror("no AAAA")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, p)) for ip in ("127.0.0.1", "127.0.0.2")]
        return real(host, p, family, type, *args)

    monkeypatch.setattr(addr_mod.socket, "getaddrinfo", fake)
    with batchd.RemoteDataLoader(a.address, "fmnist-test", **KW) as ld:
        clean, _ = read(ld)
    with batchd.RemoteDataLoader(f"dns:///batchd.default.svc.cluster.local:{port}", "fmnist-test", **KW) as ld:
        assert ld.addresses == [f"127.0.0.1:{port}", f"127.0.0.2:{port}"]
        digests, indices = read(ld)
        per_server = [s["batches"] for s in ld.server_stats()]
        assert sum(per_server) == 50 and all(p > 0 for p in per_server), per_server  # (each took a share)
    assert digests == clean and exactly_once(indices)
    assert b.loader.pool.batches_built >= per_server[1]


# --- the shard from the torch.distributed environment --------------------------------------------------


def test_rank_and_world_size_from_the_environment(monkeypatch, fmnist_server):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert rank_and_world_size(None, None) == (0, 1)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world_size(None, None) == (2, 4)
    assert rank_and_world_size(1, None) == (1, 4)
    assert rank_and_world_size(0, 1) == (0, 1)
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=100) as ld:
        assert (ld.rank, ld.world_size, len(ld)) == (2, 4, 25)
        assert ld.state_dict()["rank"] == 2
        indices = np.concatenate([b["index"].numpy() for b in ld])
    want = shard_indices(N_TEST, shuffle=False, seed=0, epoch=0, rank=2, world_size=4, drop_last=False)
    assert np.array_equal(indices, want)
    monkeypatch.setenv("RANK", "x")
    with pytest.raises(ValueError, match="RANK='x'"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test")
    monkeypatch.setenv("RANK", "4")
    with pytest.raises(ValueError, match=r"rank must be in \[0, world_size=4\)"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test")
