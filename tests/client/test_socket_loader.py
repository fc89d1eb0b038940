"""``RemoteDataLoader`` over the socket data plane (``transport="socket"``, and "auto" for a remote
server; docs/network.md): the bytes equal those over shared memory and inline TCP, through
gpu_transform, decode_on_client, collate_fn, a resume and several servers; a data connection
killed mid-epoch is resumed with nothing lost or repeated; TLS and tokens (mutual TLS too);
statistics; 20 forks of DataLoader workers beside an open loader all succeed.

Real servers on 127.0.0.1:0. Servers in this process where the test reaches into the server (to
kill data connections); ``batchd serve`` subprocesses where the trainer process forks or a server
is killed.
"""

from __future__ import annotations

import logging
import signal
import threading

import albumentations as A
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import batchd
from batchd.client.transport.server_stats import get_stats
from helpers import digest, fields_digest, free_port, jpeg_bytes, picture, wait_until
from procs import RANDOM_AUG, fmnist_test_config, write_server_config

pytestmark = pytest.mark.timeout(240)

N_TEST, BATCH = 10_000, 250
TOKEN = "socket-loader-token-0123456789"


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), workers=2, datasets=fmnist_test_config(fmnist_root),
                        pipelines={"aug": A.to_dict(RANDOM_AUG)}) as srv:
        yield srv


def read(address, transport: str, **kw) -> list[str]:
    kw = {"batch_size": BATCH, "shuffle": True, "seed": 11, "transform": "aug", "timeout": 60, **kw}
    with batchd.RemoteDataLoader(address, "fmnist-test", transport=transport, **kw) as ld:
        return [digest(b) for b in ld]


def test_the_bytes_over_the_data_plane_equal_those_over_shared_memory_and_inline(server):
    got = {t: read(server.address, t) for t in ("socket", "shm", "inline")}
    assert len(got["socket"]) == N_TEST // BATCH
    assert got["socket"] == got["shm"] == got["inline"]


def test_stats_count_bytes_per_transport(server):
    for transport, key in (("socket", "socket"), ("shm", "shm"), ("inline", "inline")):
        with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, transport=transport) as ld:
            n = sum(1 for _ in ld)
            received = ld.stats()["bytes_received"]
        images = n * BATCH * 28 * 28
        assert received[key] >= images and all(v == 0 for k, v in received.items() if k != key), received
    totals = get_stats(server.address).totals
    assert totals.data_plane_bytes_sent > 0 and totals.data_connections_accepted >= 1


@pytest.mark.parametrize("relay", [False, True], ids=["in-the-trainer", "relay"])
def test_grants_and_progress_go_on_the_data_connection_not_on_the_call(server, relay):
    """The training loop's grants are control frames on the data connection (a ``send`` in the
    thread that grants), not messages on the call (gRPC's request thread): the call carries its
    open and its last message."""
    before = get_stats(server.address).totals
    got = []
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=11,
                                 transform="aug", transport="socket", relay=relay) as ld:
        for b in ld:
            got.append(digest(b))
    after = get_stats(server.address).totals
    assert got == read(server.address, "shm")
    frames, messages = after.control_frames - before.control_frames, after.control_messages - before.control_messages
    # 40 batches granted as the loop takes them (several to a grant when they come faster than it
    # takes them): on the call only its open (with the first window), at most one grant before the
    # data connection opened, and the last message
    assert frames >= 3 and messages <= 3, (frames, messages)
    assert after.batches_granted - before.batches_granted == N_TEST // BATCH


@pytest.mark.parametrize("relay", [False, True], ids=["in-the-trainer", "relay"])
def test_batch_messages_come_on_the_data_connection_or_on_the_call_from_a_server_that_sends_them_there(
        server, relay, monkeypatch):
    """The client asks for its Batch messages on the data connection (``data_messages``): none
    on the call; a server that does not do so (an older one: no ``batchd-data-messages`` in its
    metadata) sends them on the call, and the client reads them there: the same bytes."""
    want = read(server.address, "shm")
    before = get_stats(server.address).totals
    assert read(server.address, "socket", relay=relay) == want
    middle = get_stats(server.address).totals
    assert middle.data_messages - before.data_messages == N_TEST // BATCH
    from batchd.server.serve import data_connection

    real = data_connection.CallSender.__init__
    monkeypatch.setattr(data_connection.CallSender, "__init__",
                        lambda self, *a, messages=False, **k: real(self, *a, **k))
    assert read(server.address, "socket", relay=relay) == want
    after = get_stats(server.address).totals
    assert after.data_messages == middle.data_messages
    assert after.data_plane_bytes_sent > middle.data_plane_bytes_sent


def test_auto_picks_the_data_plane_for_a_remote_server_and_shared_memory_on_this_host(server, monkeypatch):
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH) as ld:
        next(iter(ld))
        assert ld.stats()["bytes_received"]["shm"] > 0
    # a server whose shared memory this process cannot read is a remote one
    from batchd.client.transport import shm

    def unavailable(*a, **k):
        raise shm.SharedMemoryUnavailable("another host (test)")

    monkeypatch.setattr(shm.SharedMemorySession, "open", classmethod(lambda cls, *a, **k: unavailable()))
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=11,
                                 transform="aug") as ld:
        got = [digest(b) for b in ld]
        received = ld.stats()["bytes_received"]
    assert received["socket"] > 0 and received["inline"] == received["shm"] == 0
    assert got == read(server.address, "inline")


def test_a_data_connection_killed_mid_epoch_is_resumed_with_nothing_lost_or_repeated(server, caplog):
    reference = read(server.address, "inline")
    kills = 0
    with batchd.RemoteDataLoader(server.address, "fmnist-test", transport="socket", batch_size=BATCH, shuffle=True,
                                 seed=11, transform="aug", timeout=60, reconnect_timeout=30) as ld:
        got = []
        with caplog.at_level(logging.WARNING, logger="batchd.client.loader.loader"):
            for k, batch in enumerate(ld):
                got.append(digest(batch))
                if k in (3, 17, 30):
                    # the server's end of the open data connection goes away (as a killed TCP
                    # connection does): the client is mid-stream or between payloads
                    assert wait_until(lambda: server.data_plane._connections, 10)
                    for connection in list(server.data_plane._connections):
                        connection.abort()
                    kills += 1
        reconnects = ld.stats()["reconnects"]
    assert got == reference, "a batch lost, repeated, out of order or with other bytes"
    assert reconnects >= kills == 3
    assert "lost the stream" in caplog.text
    assert wait_until(lambda: not server.loader.streams and server.loader.slots.in_use == 0)


def test_gpu_transform_decode_on_client_collate_and_resume_over_the_data_plane(tmp_path, make_server):
    rng = np.random.default_rng(0)
    for i in range(40):
        (tmp_path / "photos" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (tmp_path / "photos" / f"c{i % 2}" / f"{i:03d}.jpg").write_bytes(jpeg_bytes(picture(rng, 48, 64)))
    srv = make_server(datasets={"photos": {"kind": "imagefolder", "root": str(tmp_path / "photos")}}, workers=2)

    def flip(images, positions, *, seed, epoch):
        return torch.where((positions % 2 == 1).view(-1, 1, 1, 1), images.flip(2), images)

    def run(transport, **kw):
        with batchd.RemoteDataLoader(srv.address, "photos", batch_size=8, shuffle=True, seed=4, transport=transport,
                                     transform=A.Resize(32, 32), **kw) as ld:
            return [fields_digest(b) if isinstance(b, dict) else repr(b) for b in ld]

    for kw in ({"gpu_transform": flip}, {"decode_on_client": True},
               {"collate_fn": lambda samples: sorted(int(s["index"]) for s in samples)}):
        assert run("socket", **kw) == run("inline", **kw) == run("shm", **kw), kw
    # a resume from the middle of an epoch, on the data plane
    with batchd.RemoteDataLoader(srv.address, "photos", batch_size=8, shuffle=True, seed=4, transport="socket") as ld:
        it = iter(ld)
        first = [digest(next(it)) for _ in range(2)]
        state = ld.state_dict()
    with batchd.RemoteDataLoader(srv.address, "photos", batch_size=8, shuffle=True, seed=4, transport="socket") as ld:
        ld.load_state_dict(state)
        rest = [digest(b) for b in ld]
    with batchd.RemoteDataLoader(srv.address, "photos", batch_size=8, shuffle=True, seed=4, transport="inline") as ld:
        assert first + rest == [digest(b) for b in ld]


def test_two_servers_one_killed_mid_epoch_over_the_data_plane(server_procs, fmnist_root, tmp_path):
    cfg = write_server_config(tmp_path, fmnist_root, workers=1)
    procs = [server_procs(cfg, f"127.0.0.1:{free_port()}") for _ in range(2)]
    for p in procs:
        p.start()
    with batchd.RemoteDataLoader([p.address for p in procs], "fmnist-test", batch_size=100, transport="socket",
                                 probe_interval=60, timeout=60) as ld:
        it = iter(ld)
        indices = [next(it)["index"].clone() for _ in range(10)]
        procs[1].signal(signal.SIGKILL)
        procs[1].wait(10)
        indices += [b["index"].clone() for b in it]
        received = ld.stats()["bytes_received"]
    assert torch.cat(indices).tolist() == list(range(N_TEST)), "a sample missing, repeated or out of order"
    assert received["socket"] > 0 and received["inline"] == received["shm"] == 0


def test_two_loaders_sharing_one_computation_over_the_data_plane(server):
    got: dict[int, list[str]] = {}

    def run(i):
        got[i] = read(server.address, "socket", seed=12)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert got[0] == got[1] == read(server.address, "inline", seed=12)


# --- TLS and tokens -----------------------------------------------------------------------------


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
def test_tls_and_tokens_on_the_data_plane(make_server, fmnist_root, pki, mutual):
    tls = {"cert": str(pki["server_cert"]), "key": str(pki["server_key"])}
    if mutual:
        tls.update(client_ca=str(pki["ca"]), require_client_cert=True)
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2, pipelines={"aug": A.to_dict(RANDOM_AUG)},
                      tls=tls, auth={"tokens": [{"name": "t", "token": TOKEN, "datasets": ["*"]}]})
    assert srv.data_plane.tls
    creds = {"tls_ca": str(pki["ca"]), "token": TOKEN}
    if mutual:
        creds.update(tls_cert=str(pki["client_cert"]), tls_key=str(pki["client_key"]))
    got = read(srv.address, "socket", **creds)
    stats = get_stats(srv.address, tls={"ca": str(pki["ca"]), **({"cert": str(pki["client_cert"]),
                                                                   "key": str(pki["client_key"])} if mutual else {})},
                      token=TOKEN)
    assert stats.totals.data_connections_accepted == 1 and stats.totals.data_plane_bytes_sent > 0
    assert stats.totals.control_frames == 0, "control frames on a TLS data connection"
    with batchd.RemoteDataLoader(srv.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=11,
                                 transform="aug", transport="inline", **creds) as ld:
        assert got == [digest(b) for b in ld]
    with pytest.raises(batchd.AuthenticationError):  # no token: no call, so no data token either
        read(srv.address, "socket", tls_ca=str(pki["ca"]), token=None, **(
            {"tls_cert": str(pki["client_cert"]), "tls_key": str(pki["client_key"])} if mutual else {}))


# --- forks --------------------------------------------------------------------------------------


class Numbers(Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def test_20_forks_of_dataloader_workers_beside_an_open_remote_loader_all_succeed(server_procs, fmnist_root, tmp_path):
    """20 times: a loader over the data plane reads a batch, then DataLoader(num_workers=2) forks its
    workers (each a copy of this process with the loader's data socket in it) and is iterated
    while the loader reads a batch per DataLoader batch. 20 of 20 must complete, every batch the
    one due (a child that touched the parent's data connection would break or steal its bytes)."""
    assert not batchd._grpc_fork.FORK_HANDLERS
    srv = server_procs(write_server_config(tmp_path, fmnist_root), f"127.0.0.1:{free_port()}")
    srv.start()
    failures = []
    for attempt in range(20):
        with batchd.RemoteDataLoader(srv.address, "fmnist-test", batch_size=64, transport="socket", timeout=30,
                                     reconnect_timeout=0) as loader:
            it = iter(loader)
            k = 0
            assert torch.equal(next(it)["index"], torch.arange(64))
            try:
                total = 0
                for numbers in DataLoader(Numbers(), batch_size=4, num_workers=2, timeout=5):
                    total += int(numbers.sum())
                    k += 1
                    assert torch.equal(next(it)["index"], torch.arange(k * 64, (k + 1) * 64))
                assert total == sum(range(16))
            except Exception as e:  # noqa: BLE001 (counted and reported below)
                failures.append(f"attempt {attempt}: {type(e).__name__}: {e}")
            assert loader.stats()["bytes_received"]["socket"] > 0
    assert not failures, failures


def test_an_unreachable_data_port_sends_auto_inline_and_fails_socket(make_server, fmnist_root, monkeypatch, caplog):
    """A data port the client cannot reach (a firewall; a Service forwarding the gRPC port only):
    "auto" warns once and reads inline, every batch once; "socket" fails as a broken call that
    does not come back."""
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2, pipelines={"aug": A.to_dict(RANDOM_AUG)})
    srv.data_plane._listener.close()  # the port refuses connections; the server still offers it
    from batchd.client.transport import shm

    monkeypatch.setattr(shm.SharedMemorySession, "open", classmethod(
        lambda cls, *a, **k: (_ for _ in ()).throw(shm.SharedMemoryUnavailable("another host (test)"))))
    with caplog.at_level(logging.WARNING, logger="batchd.client.loader.loader"):
        with batchd.RemoteDataLoader(srv.address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=11,
                                     transform="aug", transport="auto", reconnect_timeout=10) as ld:
            got = [digest(b) for b in ld]
            received = ld.stats()["bytes_received"]
    assert got == read(srv.address, "inline")
    assert received["inline"] > 0 and received["socket"] == 0
    assert caplog.text.count("come inside the gRPC messages from now on") == 1
    with pytest.raises(ConnectionError, match="data port"):
        read(srv.address, "socket", reconnect_timeout=1)
