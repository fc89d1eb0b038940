"""CUDA double buffering: pinned buffers reused, copies on a side stream, consumer waits on an event.

Skipped without CUDA. Run on a GPU machine with `python -m pytest tests/cuda -q`.
"""

from __future__ import annotations

import pytest
import torch

import batchd
from batchd.client.transfer import CudaTransfer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_batches_on_the_device_equal_cpu_batches(fmnist_server):
    kw = dict(batch_size=256, shuffle=True, seed=1, transform="flip")
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda", **kw) as gpu, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", **kw) as cpu:
        for g, c in zip(gpu, cpu):
            assert g["image"].is_cuda and g["label"].is_cuda
            for key in ("image", "label", "index"):
                assert torch.equal(g[key].cpu(), c[key])


def test_pinned_slots_are_not_overwritten_while_a_copy_is_in_flight():
    transfer = CudaTransfer(torch.device("cuda"), slots=2)
    batches = [{"x": torch.full((64, 1024, 1024), i, dtype=torch.uint8)} for i in range(6)]
    outs = []
    for b in batches:
        out, event = transfer.to_device(b)
        outs.append(transfer.hand_over(out, event))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert int(out["x"].float().mean().item()) == i
    assert all(buf.is_pinned() for slot in transfer._pinned for buf in slot.values())
