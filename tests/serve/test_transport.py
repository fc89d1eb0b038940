"""Transports: shared memory (leased slots) and inline bytes (optionally LZ4), against a real server."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import batchd
from batchd.client import shm as client_shm
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)


def _batches(address, transport, **kw):
    with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=100, shuffle=True, seed=3,
                                 transport=transport, **kw) as loader:
        return list(loader), loader


def test_shared_memory_equals_inline_bytes(fmnist_server):
    shm_batches, shm_loader = _batches(fmnist_server.address, "shm", transform="flip")
    inline_batches, _ = _batches(fmnist_server.address, "inline", transform="flip")
    lz4_batches, _ = _batches(fmnist_server.address, "inline", transform="flip", compression="lz4")
    assert shm_loader._shm is not None
    assert len(shm_batches) == len(inline_batches) == len(lz4_batches) == 100
    for a, b, c in zip(shm_batches, inline_batches, lz4_batches):
        for key in ("image", "label", "index"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])


def test_keeping_every_batch_neither_corrupts_nor_deadlocks(fmnist_server):
    """list(loader) holds all 100 batches: the first max_leases_per_session stay in leased slots,
    the rest arrive inline, and none is overwritten while held."""
    kept, loader = _batches(fmnist_server.address, "shm")
    reference, _ = _batches(fmnist_server.address, "inline")
    max_held = fmnist_server.config.max_leases_per_session
    assert fmnist_server.loader.leases.held(loader._shm.session) == max_held  # the rest came inline
    # read again after more streams have run on the server: still the original bytes
    _batches(fmnist_server.address, "shm")
    for a, b in zip(kept, reference):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])
    indices = torch.cat([b["index"] for b in kept])
    assert indices.unique().numel() == indices.numel() == 10_000


def test_slots_go_back_when_tensors_are_freed(fmnist_server):
    leases = fmnist_server.loader.leases
    loader = batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=500, transport="shm")
    held = [next(iter(loader))]  # abandons the iteration after one batch
    session = loader._shm.session
    # the batch we hold, plus any the server sent ahead before the stream was cancelled (those
    # come back when the session ends); count once the cancelled stream has ended on the server
    assert wait_until(lambda: not fmnist_server.loader.streams)
    before = leases.held(session)
    assert before >= 1
    held.clear()
    gc.collect()
    assert wait_until(lambda: leases.held(session) <= before - 1), "the lease was not released after the batch was freed"
    # the loader keeps working after its first iteration was abandoned
    assert sum(b["image"].shape[0] for b in loader) == 10_000
    loader.close()
    assert wait_until(lambda: leases.sessions == 0 or session not in leases._sessions)


def test_close_waits_for_batches_still_held(fmnist_server):
    leases = fmnist_server.loader.leases
    loader = batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=500, transport="shm")
    batch = next(iter(loader))
    expected = batch["image"].clone()
    session = loader._shm.session
    loader.close()
    # a second loader churns through slots; the held batch must not change
    _batches(fmnist_server.address, "shm")
    assert torch.equal(batch["image"], expected)
    assert session in leases._sessions and leases.held(session) >= 1
    del batch
    gc.collect()
    assert wait_until(lambda: session not in leases._sessions), "the session did not end after the last batch was freed"


def test_falls_back_to_inline_when_shared_memory_is_not_shared(fmnist_server, tmp_path, monkeypatch, caplog):
    # A client whose /dev/shm is another directory: as in a container without the server's IPC namespace.
    monkeypatch.setattr(client_shm, "SHM_DIR", tmp_path)
    with caplog.at_level(logging.WARNING, logger="batchd.client.loader"):
        batches, loader = _batches(fmnist_server.address, "auto")
    assert loader._shm is None
    assert sum(b["image"].shape[0] for b in batches) == 10_000
    assert any("shared memory with" in r.message and "unavailable" in r.message for r in caplog.records)
    with pytest.raises(RuntimeError, match="transport='shm'"):
        _batches(fmnist_server.address, "shm")


def test_bad_transport_arguments(fmnist_server):
    with pytest.raises(ValueError, match="transport"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport="tcp")
    with pytest.raises(ValueError, match="compression"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", compression="gzip")
