"""loader.profile() on a CUDA device: the copy and gpu_transform are device times read from CUDA
events, and a gpu_transform that keeps the copy's stream busy makes the loader copy-bound; the
loop's wait is an NVTX range. Skipped without CUDA (`python -m pytest tests/cuda -q` on a GPU).
"""

from __future__ import annotations

import pytest
import torch

import batchd

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def slow_finish(images, positions, *, seed, epoch):
    """About 50 ms of device time on the copy's stream per batch (a spin kernel), images unchanged."""
    torch.cuda._sleep(50_000_000)
    return images


def test_device_times_come_from_events_and_a_busy_copy_stream_is_copy_bound(make_server, fmnist_root):
    server = make_server(datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=100, device="cuda",
                                 gpu_transform=slow_finish) as loader:
        for i, batch in enumerate(loader):
            assert batch["image"].is_cuda
            if i == 20:
                break
        p = loader.profile()  # (waits for the copies in flight)
    assert p["verdict"] == "copy-bound", p.table()
    assert p["stages"]["gpu_transform"] / p["batches"] > 0.02  # the spin kernel's device time
    assert p["stages"]["copy"] > 0  # measured between CUDA events, not zero
    assert p["shares"]["gpu_transform"] > 0.3


def test_a_fast_device_loop_stays_trainer_bound(make_server, fmnist_root):
    server = make_server(datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=100, device="cuda") as loader:
        for i, batch in enumerate(loader):
            torch.cuda._sleep(20_000_000)  # the training step, on the default stream
            torch.cuda.synchronize()
            if i == 20:
                break
        p = loader.profile()
    assert p["verdict"] == "trainer-bound", p.table()
    assert 0 < p["stages"]["copy"] < p["stages"]["step"]
