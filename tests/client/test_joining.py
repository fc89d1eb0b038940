"""Servers that join and leave while a loader runs (issue 20 §3): a ``file:`` list of servers,
read again every probe_interval; a server appended mid-epoch gets work, one removed gets none.
Every sample comes once with the bytes of a single-server run. Real in-process servers."""

from __future__ import annotations

import time

import numpy as np
import pytest
from grpc_health.v1 import health_pb2

import batchd
from batchd.client.transport.addresses import AddressSource, may_grow, read_address_file, server_addresses
from batchd.client.iteration.servers import Servers
from batchd.client.transport.server_stats import get_stats
from helpers import digest, wait_until
from procs import RANDOM_AUG, fmnist_test_config

pytestmark = pytest.mark.timeout(120)

KW = dict(batch_size=100, shuffle=True, seed=3, transform=RANDOM_AUG, transport="inline", timeout=60,
          connect_timeout=10)


def test_address_files(tmp_path):
    listed = tmp_path / "servers.txt"
    listed.write_text("# batchd replicas\n10.0.0.1:50051\n\n  10.0.0.2:50051  # the second\nunix:/run/b.sock\n")
    assert read_address_file(str(listed)) == ["10.0.0.1:50051", "10.0.0.2:50051", "unix:/run/b.sock"]
    assert server_addresses(f"file:{listed}") == ["10.0.0.1:50051", "10.0.0.2:50051", "unix:/run/b.sock"]
    assert may_grow(f"file:{listed}") and may_grow("dns:///batchd:1") and not may_grow(["10.0.0.1:1", "b:1"])
    source = AddressSource(f"file:{listed}")
    assert source.current() == ["10.0.0.1:50051", "10.0.0.2:50051", "unix:/run/b.sock"]
    listed.write_text("10.0.0.3:50051\n")
    assert source.current() == ["10.0.0.3:50051"]  # re-read: its size (or mtime) changed
    listed.write_text("")
    assert source.current() is None  # an empty list keeps the servers known (a file being rewritten)
    assert AddressSource(["10.0.0.1:1", "10.0.0.2:1"]).current() is None  # a fixed list never changes
    listed.write_text("10.0.0.1:50051\nnot an address\n")
    with pytest.raises(ValueError, match=r"servers.txt, line 2: 'not an address' is not HOST:PORT"):
        server_addresses(f"file:{listed}")
    with pytest.raises(ValueError, match="cannot read the server list file:/no/such/file"):
        server_addresses("file:/no/such/file")


def test_a_dns_name_is_resolved_again_each_time(monkeypatch):
    import socket

    from batchd.client.transport import addresses as addr_mod

    records = {"batchd.svc.test": ["10.0.0.1"]}

    def fake(host, port, family=0, type=0, *args):
        if host not in records or not records[host] or family != socket.AF_INET:
            raise socket.gaierror("no such name")
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in records[host]]

    monkeypatch.setattr(addr_mod.socket, "getaddrinfo", fake)
    source = AddressSource("dns:///batchd.svc.test:50051")
    assert source.current() == ["10.0.0.1:50051"]  # one address: IP:PORT all the same (others may join)
    records["batchd.svc.test"] = ["10.0.0.2", "10.0.0.1"]
    assert source.current() == ["10.0.0.1:50051", "10.0.0.2:50051"]
    records["batchd.svc.test"] = []
    assert source.current() is None  # does not resolve now: keep the servers known
    assert server_addresses("dns:///batchd.svc.test:50051", keep_single_name=False) == ["dns:///batchd.svc.test:50051"]


def test_a_server_joins_then_the_first_leaves_exactly_once_same_bytes(make_server, fmnist_root, tmp_path):
    a, b = (make_server(workers=1, datasets=fmnist_test_config(fmnist_root)) for _ in range(2))
    with batchd.RemoteDataLoader(a.address, "fmnist-test", **KW) as ld:
        reference = [digest(batch) for batch in ld]
    listed = tmp_path / "servers.txt"
    listed.write_text(f"{a.address}\n")
    digests, indices = [], []
    with batchd.RemoteDataLoader(f"file:{listed}", "fmnist-test", probe_interval=0.2, 
                                 **KW) as ld:
        assert not ld.servers.single and ld.addresses == [a.address]  # one server, may grow
        it = iter(ld)

        def take(n):
            for _ in range(n):
                batch = next(it)
                digests.append(digest(batch))
                indices.append(batch["index"].numpy().copy())
                time.sleep(0.01)  # a training step

        take(20)
        b.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)  # (as while it starts or drains)
        with listed.open("a") as f:
            f.write(f"{b.address}\n")
        assert wait_until(lambda: "SERVING" in ld.server_stats()[-1]["error"], 10), ld.server_stats()
        take(5)
        assert not ld.server_stats()[1]["up"], "a server whose health is not SERVING was given work"
        b.health.set("", health_pb2.HealthCheckResponse.SERVING)
        assert wait_until(lambda: [s["up"] for s in ld.server_stats()] == [True, True], 10), ld.server_stats()
        joined_at = len(digests)
        # it is given batches as it has room: after its first (which includes its start), its share
        for _ in range(10):
            take(5)
            if ld.stats()["batches_per_server"][b.address] >= 5:
                break
        per_server = ld.stats()["batches_per_server"]
        assert per_server[b.address] >= 5, f"the new server took no batches: {per_server}"
        listed.write_text(f"{b.address}\n")
        assert wait_until(lambda: ld.server_stats()[0]["retired"], 10), ld.server_stats()
        take(1)
        sent_by_a = get_stats(a.address).totals.batches_sent  # (its call was cancelled when it left the list)
        a.stop(grace=0)
        for batch in it:
            digests.append(digest(batch))
            indices.append(batch["index"].numpy().copy())
        stats = ld.stats()
        # nothing reads the retired server any more: its link closed its connection
        assert wait_until(lambda: ld.servers.links[0].conn.closed, 10), ld.server_stats()
        assert ld.server_stats()[0]["error"] == "no longer named by the address"
    assert digests == reference, "the bytes differ from a single server's"
    assert np.array_equal(np.sort(np.concatenate(indices)), np.arange(10_000)), "a sample is missing or repeated"
    per_server = stats["batches_per_server"]
    # (batches it sent before it left may still be yielded after: the same bytes, taken in order)
    assert per_server[a.address] <= sent_by_a and sum(per_server.values()) == 100
    assert per_server[a.address] >= joined_at and per_server[b.address] >= 100 - sent_by_a
    assert stats["failovers"] == 0  # the first left the list before it stopped: no failure to wait out

