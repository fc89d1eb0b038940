"""A shared-memory call's messages and control frames travel on its data connection (issue 36;
docs/design/network-path.md, *Shared-memory calls*): each batch's ``Batch`` message is a frame with
no payload, each grant a control frame with the leases freed since the last one, so a batch costs
no gRPC message on either side. The same batches as inline; every lease comes back. Without a
data connection (the server has no data plane; its data port cannot be reached) the messages
come on the call as before, and an unreachable port is said once, at info.

Real servers on 127.0.0.1:0, in this process (their counters are read directly).
"""

from __future__ import annotations

import logging
import time

import pytest
import torch

import batchd
from helpers import digest, free_port, wait_until
from procs import fmnist_test_config

pytestmark = pytest.mark.timeout(180)

N_TEST, BATCH, EPOCHS = 10_000, 250, 3
PER_EPOCH = N_TEST // BATCH
COUNTED = ("data_messages", "control_frames", "control_messages", "leases_released_on_calls", "batches_sent")


def _counts(server) -> dict[str, int]:
    counters = server.loader.counters
    return {k: int(counters.get(k, 0)) for k in COUNTED}


def _epochs(address: str, transport: str, **kw) -> tuple[list[list[str]], list[torch.Tensor], dict]:
    """EPOCHS epochs of fmnist-test, shuffled: each batch's digest, each epoch's indices, the loader's stats."""
    digests, indices = [], []
    with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=BATCH, shuffle=True, seed=5,
                                 transport=transport, timeout=60, **kw) as ld:
        for epoch in range(EPOCHS):
            ld.set_epoch(epoch)
            got = [(digest(b), b["index"].clone()) for b in ld]  # (no batch held: its lease comes back)
            digests.append([d for d, _ in got])
            indices.append(torch.cat([i for _, i in got]))
        stats = ld.stats()
    return digests, indices, stats


def test_a_shared_memory_call_sends_no_grpc_message_per_batch(make_server, fmnist_root):
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2)
    before = _counts(srv)
    digests, indices, stats = _epochs(srv.address, "shm")
    after = _counts(srv)
    sent = {k: after[k] - before[k] for k in COUNTED}
    for epoch in indices:  # every sample once per epoch, in a new order each epoch
        assert torch.equal(epoch.sort().values, torch.arange(N_TEST))
    assert not torch.equal(indices[0], indices[1])
    assert stats["bytes_received"]["shm"] > 0 and stats["bytes_received"]["inline"] == 0
    assert sent["batches_sent"] == EPOCHS * PER_EPOCH
    assert sent["data_messages"] == EPOCHS * PER_EPOCH, sent  # every message on the data connection
    assert sent["control_frames"] >= PER_EPOCH, sent  # the grants (with releases) as frames
    # on the call: its first open (with the first grants), at most one grant before the data
    # connection opened, the done; nothing per batch, nor per pass (the next opens are frames)
    assert sent["control_messages"] <= 3, sent
    # every lease came back (on frames, or on the call's last messages), none by a ReleaseLeases call
    assert wait_until(lambda: srv.loader.leases.sessions == 0, 10), "the session did not end"
    assert _counts(srv)["leases_released_on_calls"] - before["leases_released_on_calls"] == EPOCHS * PER_EPOCH
    # the same bytes as inline, batch by batch
    inline, _, _ = _epochs(srv.address, "inline")
    assert digests == inline


def test_without_a_data_plane_the_messages_come_on_the_call(make_server, fmnist_root, caplog):
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2, data_plane={"enabled": False})
    before = _counts(srv)
    with caplog.at_level(logging.INFO, logger="batchd.client.loader"):
        digests, indices, stats = _epochs(srv.address, "shm")
    sent = {k: _counts(srv)[k] - before[k] for k in COUNTED}
    assert sent["data_messages"] == 0 and sent["control_frames"] == 0, sent
    assert sent["batches_sent"] == EPOCHS * PER_EPOCH and stats["bytes_received"]["shm"] > 0
    for epoch in indices:
        assert torch.equal(epoch.sort().values, torch.arange(N_TEST))
    assert "offers no data connection" not in caplog.text  # (nothing to say: shared memory carries the bytes)
    assert stats["data_plane_fallbacks"] == 0


def test_an_unreachable_data_port_is_said_once_and_the_messages_come_on_the_call(make_server, fmnist_root, caplog):
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2)
    srv.data_plane.port = free_port()  # calls offer a port where nothing listens (connections refused)
    with caplog.at_level(logging.INFO, logger="batchd.client.loader"):
        digests, indices, stats = _epochs(srv.address, "shm", reconnect_timeout=20)
    for epoch in indices:  # nothing lost or repeated across the fall back
        assert torch.equal(epoch.sort().values, torch.arange(N_TEST))
    assert stats["data_plane_fallbacks"] == 1
    said = [r for r in caplog.records if "come on the gRPC calls from now on" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
    assert not any(r.levelno >= logging.WARNING and "data port" in r.getMessage() for r in caplog.records)
    assert srv.loader.counters.get("data_messages", 0) == 0
