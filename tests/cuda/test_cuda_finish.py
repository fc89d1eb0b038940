"""GpuTransform on a CUDA device gives the CPU's output bit for bit, without synchronising the host.

Skipped without CUDA. Run on a GPU machine with `python -m pytest tests/cuda -q`.
"""

from __future__ import annotations

import inspect

import numpy as np
import pytest
import torch

import batchd
from batchd import GpuTransform

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def images_and_positions(b=64, h=57, w=61, c=3):
    rng = np.random.default_rng(1)
    images = torch.from_numpy(rng.integers(0, 256, (b, h, w, c), dtype=np.uint8))
    positions = torch.from_numpy(rng.permutation(10 * b)[:b].astype(np.int64)) + (1 << 33)
    return images, positions


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("augment", [dict(), dict(hflip=0.5, vflip=0.5), dict(hflip=0.5, vflip=0.3, crop=(48, 40))])
@pytest.mark.parametrize("positions_on", ["cuda", "cpu"])
def test_gpu_output_equals_cpu_output(dtype, channels_last, augment, positions_on):
    images, positions = images_and_positions()
    transform = GpuTransform(**IMAGENET, dtype=dtype, channels_last=channels_last, **augment)
    cpu = transform(images, positions, seed=9, epoch=4)
    gpu = transform(images.cuda(), positions.to(positions_on), seed=9, epoch=4)
    assert gpu.is_cuda and gpu.dtype == dtype and gpu.shape == cpu.shape
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert gpu.is_contiguous(memory_format=fmt)
    assert torch.equal(gpu.cpu(), cpu)


def test_draws_on_the_gpu_equal_draws_on_the_cpu():
    positions = torch.arange(0, 1 << 40, 1 << 24)
    transform = GpuTransform(hflip=0.5, vflip=0.5, crop=(100, 50))
    cpu = transform.params(positions, seed=2**63 + 5, epoch=7, height=224, width=224)
    gpu = transform.params(positions.cuda(), seed=2**63 + 5, epoch=7, height=224, width=224)
    for a, b in zip(cpu, gpu):
        assert b.is_cuda and torch.equal(a, b.cpu())


def test_no_host_synchronisation_on_a_side_stream():
    images, positions = images_and_positions()
    images, positions = images.cuda(), positions.cuda()
    transform = GpuTransform(**IMAGENET, dtype=torch.bfloat16, hflip=0.5, vflip=0.5, crop=48)
    expected = transform(images, positions, seed=1, epoch=0)  # builds the device lookup table
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(stream):
            out = transform(images, positions, seed=1, epoch=0)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


@pytest.mark.skipif("gpu_transform" not in inspect.signature(batchd.RemoteDataLoader.__init__).parameters,
                    reason="RemoteDataLoader has no gpu_transform hook yet")
def test_loader_on_cuda_equals_loader_on_cpu(fmnist_server):
    kw = dict(batch_size=100, shuffle=True, seed=3, drop_last=False)
    finish = GpuTransform(mean=0.286, std=0.353, dtype=torch.bfloat16, hflip=0.5, crop=24)
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda", gpu_transform=finish, **kw) as gpu, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", gpu_transform=finish, **kw) as cpu:
        n = 0
        for g, c in zip(gpu, cpu):
            assert g["image"].is_cuda and g["image"].shape == (len(c["index"]), 1, 24, 24)
            assert torch.equal(g["image"].cpu(), c["image"])
            n += 1
        assert n == len(cpu)
