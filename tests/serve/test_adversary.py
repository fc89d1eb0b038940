"""A data plane nobody can stall, read or crash (issue 37): an adversary beside real training.

A ``batchd serve`` process with auth, on 127.0.0.1, with a /dev/shm of its own (a mount
namespace: this process cannot read its shared memory, so a ``transport="auto"`` loader here gets
its batches over the data plane, as a trainer on another host). A legitimate loader reads an
epoch of Fashion-MNIST through a random augmentation while, all at once (tests/adversary.py):
500 idle connections (re-opened as the server closes them, up to 1,000 a second), slow-drip
token bytes, random bytes where tokens are due, an authenticated tenant replaying its own calls'
tokens and sending oversized and garbage control frames.

The loader's epoch has the bytes of an undisturbed one, and it stayed on the data plane (no
fallback to inline, nothing reconnected); no attacker connection got a byte it had no token for;
each bad frame ended its own call only; the server's threads and open descriptors, counted from
outside (/proc; but its connections on the gRPC port, which this process's gRPC client may keep
for a later channel, and its pool of shared-memory slots, whose use its Stats give), come back
to what they were before the attack. The loader's images/s under
attack against without it is a figure of bench/tables/table_dataplane.py, not asserted here.
"""

from __future__ import annotations

import os
import time

import albumentations as A
import pytest
import yaml

import batchd
from batchd.client.transport.server_stats import get_stats
from batchd.server.config import ServerConfig
from batchd.v1 import loader_pb2 as pb
from adversary import IdleFlood, RandomBytes, SlowDrip, TokenAbuse, open_files, process_counts
from helpers import digest, free_port, private_shm_prefix, wait_until
from procs import RANDOM_AUG, fmnist_test_config

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]

TRAINER, TENANT = "trainer-token-0123456789abcdef", "tenant-token-0123456789abcdef"
BATCH = 250
GRPC_THREADS = ServerConfig.model_fields["grpc_threads"].default  # (the config below leaves it)


def epoch(address: str) -> tuple[list[str], dict]:
    """One epoch's batch digests and the loader's stats (transport "auto": the data plane here)."""
    with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=21, transform="aug",
                                 transport="auto", token=TRAINER, timeout=60) as ld:
        return [digest(b) for b in ld], ld.stats()


def held(pid: int, grpc_port: int) -> tuple[int, dict[int, str]]:
    """The server's threads but its RPC pool's, and its descriptors but its connections on the gRPC
    port (whose life this process's gRPC client decides: it may keep one open for a later channel)
    and its shared-memory slots (a pool that grows to what was in flight at once, up to
    ``max_slots``; ``slots_in_use`` says whether one is still held). The RPC pool
    (``batchd-rpc``, a ThreadPoolExecutor) keeps the threads it grew to, up to ``grpc_threads``,
    whatever the timing of the calls: ``rpc_threads`` bounds it."""
    files = {fd: what for fd, what in open_files(pid).items()
             if not what.startswith((f"tcp 127.0.0.1:{grpc_port} ", "/dev/shm/batchd-"))}
    return process_counts(pid)[0] - rpc_threads(pid), files


def rpc_threads(pid: int) -> int:
    """Threads of the server's RPC pool (named ``batchd-rpc_N``, server/app.py), from /proc."""
    names = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            names.append(open(f"/proc/{pid}/task/{task}/comm").read())
        except OSError:
            pass  # (it ended meanwhile)
    return sum(name.startswith("batchd-rpc") for name in names)


def settled(pid: int, grpc_port: int) -> tuple[int, dict[int, str]]:
    """``held`` once the counts stopped changing (1 s apart), within 20 s."""
    last = held(pid, grpc_port)
    for _ in range(20):
        time.sleep(1.0)
        now = held(pid, grpc_port)
        if (now[0], len(now[1])) == (last[0], len(last[1])):
            return now
        last = now
    return last


def back_to(pid: int, grpc_port: int, baseline: tuple[int, dict[int, str]]) -> bool:
    threads, files = held(pid, grpc_port)
    return threads <= baseline[0] and len(files) <= len(baseline[1])


def test_an_adversary_beside_training_stalls_reads_and_crashes_nothing(server_procs, tmp_path, fmnist_root):
    prefix = private_shm_prefix()
    if prefix is None:
        pytest.skip("unshare cannot mount a private /dev/shm here: no server whose shared memory is not ours")
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump({
        "workers": 2, "cache_dir": str(tmp_path / "cache"), "datasets": fmnist_test_config(fmnist_root),
        "pipelines": {"aug": A.to_dict(RANDOM_AUG)},
        "auth": {"tokens": [{"name": "trainer", "token": TRAINER, "datasets": ["*"]},
                            {"name": "tenant", "token": TENANT, "datasets": ["*"]}]}}))
    port = free_port()
    srv = server_procs(cfg, f"127.0.0.1:{port}")
    srv.argv = [*prefix, *srv.argv]
    srv.start()
    data_port = port + 1  # (the default: the gRPC port + 1)
    request = pb.StreamBatchesRequest(dataset="fmnist-test", batch_size=BATCH, shuffle=True, seed=5, epoch=0,
                                      transport=pb.TRANSPORT_SOCKET)

    reference, alone = epoch(srv.address)
    assert alone["bytes_received"]["socket"] > 0 and alone["bytes_received"]["inline"] == 0, alone["bytes_received"]
    with TokenAbuse(srv.address, request, bearer=TENANT) as warmup:  # gRPC's thread pool grows to what the attack needs
        warmed, _ = epoch(srv.address)
    assert warmed == reference and warmup.calls >= 1, warmup.errors
    baseline = settled(srv.pid, port)

    parts = [IdleFlood(data_port, 500, rate=1000.0), SlowDrip(data_port, 8), RandomBytes(data_port),
             TokenAbuse(srv.address, request, bearer=TENANT)]
    for part in parts:
        part.start()
    try:
        time.sleep(1.0)  # the flood at full height before the trainer's first call
        attacked, stats = epoch(srv.address)
    finally:
        for part in parts:
            part.stop()
    idle, drip, noise, tokens = parts

    assert attacked == reference, "the attacked epoch's bytes differ from the undisturbed one's"
    assert stats["data_plane_fallbacks"] == 0 and stats["reconnects"] == 0, stats
    assert stats["bytes_received"]["socket"] > 0 and stats["bytes_received"]["inline"] == 0, stats["bytes_received"]
    assert not any(p.errors for p in parts), [p.errors for p in parts]
    assert idle.opened >= 500 and idle.closed > 0 and drip.sent > 0 and noise.opened > 0, (
        idle.opened, idle.closed, drip.sent, noise.opened)  # (the attack took place)
    assert tokens.replays > 0 and tokens.accepted_replays == 0
    assert tokens.frames > 0 and set(tokens.endings) <= {"INVALID_ARGUMENT", "LOST"}, tokens.endings
    assert [p.bytes_received for p in parts] == [0, 0, 0, 0], "a connection without its token got bytes"

    assert 0 < rpc_threads(srv.pid) <= GRPC_THREADS, rpc_threads(srv.pid)  # (seen from outside; within its size)
    assert wait_until(lambda: back_to(srv.pid, port, baseline), 30, 0.5), (
        f"threads {held(srv.pid, port)[0]} after the attack, {baseline[0]} before; descriptors open since: "
        f"{sorted(set(held(srv.pid, port)[1].items()) - set(baseline[1].items()))}")
    assert wait_until(lambda: get_stats(srv.address, token=TRAINER).pool.slots_in_use == 0, 30, 0.5)
    again, _ = epoch(srv.address)  # and the server serves on
    assert again == reference
