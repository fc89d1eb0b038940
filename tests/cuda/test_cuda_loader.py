"""The loader on CUDA under delays that expose a missing wait, and the GPUs a process touches.

* Every copy queued behind ``torch.cuda._sleep`` on the side stream: without the consumer's
  ``wait_event`` the batch is read before it lands, and a shared-memory slot whose lease went
  back before its copy ran holds another batch by then (the server reuses free slots at once).
* The consumer's stream behind a sleep: without ``record_stream``, a batch freed by the host is
  recycled for the next copy before the consumer's queued work has read it.
* A process that uses only ``cuda:1`` makes no CUDA context on GPU 0.

Over the socket data plane, payloads land in pinned buffers that go back to their pool when the
batch's source tensors are let go: that must wait for the copy's event too.

Skipped without CUDA. Run on a GPU machine with `python -m pytest tests/cuda -q`.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import batchd
from batchd.client.device.transfer import CudaTransfer
from procs import fmnist_test_config

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

_DELAY_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s of a GPU's clock


@pytest.fixture
def tight_server(make_server, fmnist_root):
    """Few slots and no history: a slot given back is written with the next batch at once."""
    return make_server(workers=2, datasets=fmnist_test_config(fmnist_root), max_slots=8, share_window=0)


@pytest.fixture
def delayed_copies(monkeypatch):
    to_device = CudaTransfer.to_device

    def delayed(self, *args, **kwargs):
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            torch.cuda._sleep(_DELAY_CYCLES)
        return to_device(self, *args, **kwargs)

    monkeypatch.setattr(CudaTransfer, "to_device", delayed)


@pytest.mark.parametrize("transport", ["shm", "socket", "inline"])
@pytest.mark.parametrize("finish", [None, batchd.GpuTransform(mean=0.286, std=0.353, hflip=0.5, crop=24)])
def test_batches_equal_cpu_batches_behind_a_delayed_side_stream(tight_server, delayed_copies, transport, finish):
    kw = dict(batch_size=500, shuffle=True, seed=11, transport=transport, gpu_transform=finish)
    with batchd.RemoteDataLoader(tight_server.address, "fmnist-test", device="cuda", **kw) as gpu, \
         batchd.RemoteDataLoader(tight_server.address, "fmnist-test", **kw) as cpu:
        n = 0
        for g, c in zip(gpu, cpu):
            for key in ("image", "label", "index"):  # read on the consumer's stream, no synchronize
                assert torch.equal(g[key].cpu(), c[key]), f"batch {n}: {key} is not the batch's"
            n += 1
        assert n == len(cpu) == 20
        if transport == "shm":
            assert gpu._transfer.maps_host_memory and gpu._transfer.host.registered
        if transport == "socket":  # received into pinned buffers, copied straight from them
            assert gpu.stats()["bytes_received"]["socket"] > 0
            assert all(c.data.pool.pinned and c.data.pool.allocated for c in _connections(gpu))


def _connections(loader) -> list:
    """The ServerConnection of a single-server loader."""
    return [loader.servers.server.conn]


@pytest.mark.parametrize("transport", ["shm", "socket", "inline"])
def test_batches_are_not_recycled_while_a_delayed_consumer_still_reads_them(tight_server, transport):
    kw = dict(batch_size=500, shuffle=True, seed=12, transport=transport)
    kept = []
    with batchd.RemoteDataLoader(tight_server.address, "fmnist-test", device="cuda", **kw) as gpu:
        it = iter(gpu)
        for g in it:
            torch.cuda._sleep(_DELAY_CYCLES)  # the training step still runs on the consumer's stream ...
            kept.append({k: v.clone() for k, v in g.items()})  # ... and this read is queued behind it
            del g  # the host lets go of the batch now: its memory must wait for that read
    with batchd.RemoteDataLoader(tight_server.address, "fmnist-test", **kw) as cpu:
        expected = list(cpu)
    assert len(kept) == len(expected) == 20
    for i, (g, c) in enumerate(zip(kept, expected)):
        assert torch.equal(g["image"].cpu(), c["image"]) and torch.equal(g["index"].cpu(), c["index"]), i


_ONLY_CUDA_1 = """
import ctypes, sys
import torch, batchd

finish = batchd.GpuTransform(mean=0.286, std=0.353, hflip=0.5, crop=24)
with batchd.RemoteDataLoader(sys.argv[1], "fmnist-test", batch_size=500, shuffle=True, device="cuda:1",
                             transport=sys.argv[2], gpu_transform=finish) as loader:
    n = sum(int(b["image"].shape[0]) for b in loader)
    registered = len(loader._transfer.host.registered)
cuda = ctypes.CDLL("libcuda.so.1")
device, flags, active = ctypes.c_int(), ctypes.c_uint(), ctypes.c_int()
assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
assert cuda.cuDevicePrimaryCtxGetState(device, ctypes.byref(flags), ctypes.byref(active)) == 0
print(n, registered, active.value)
"""


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
@pytest.mark.parametrize("transport", ["shm", "socket", "inline"])
def test_a_process_using_only_cuda_1_makes_no_context_on_gpu_0(fmnist_server, transport):
    """Receiver threads start with device 0 current, as does the registry's helper thread: each
    must switch before its first CUDA call, or the driver makes a context (hundreds of MB) on
    GPU 0 in every DDP rank."""
    result = subprocess.run([sys.executable, "-c", _ONLY_CUDA_1, fmnist_server.address, transport],
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr
    n, registered, active = map(int, result.stdout.split())
    assert n == 10_000
    assert active == 0, "a process that only used cuda:1 has a CUDA context on GPU 0"
    assert (registered > 0) == (transport == "shm")  # (socket: pinned buffers, not registered mappings)
