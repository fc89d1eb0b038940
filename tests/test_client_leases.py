"""The client side of shared memory and leases, against real servers: copy-on-write mappings,
abandoned calls naming the leases they received, retried releases, progress reports, and a
reconnect that closes the old session.
"""

from __future__ import annotations

import gc
import os
import uuid

import pytest
import torch

import batchd
from batchd.client import shm as client_shm

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
