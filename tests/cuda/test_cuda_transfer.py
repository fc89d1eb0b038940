"""CUDA copies: pinned buffers reused behind events, shared-memory slots registered and copied
directly, a lock for concurrent receivers, and the device index a loader binds to.

Skipped without CUDA. Run on a GPU machine with `python -m pytest tests/cuda -q`.
"""

from __future__ import annotations

import threading

import pytest
import torch

import batchd
from batchd.client.transfer import CudaTransfer, TransferStopped

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

_DELAY_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s of a GPU's clock, so copies are still queued


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_batches_on_the_device_equal_cpu_batches(fmnist_server, transport):
    kw = dict(batch_size=256, shuffle=True, seed=1, transform="flip", transport=transport)
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda", **kw) as gpu, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", **kw) as cpu:
        for g, c in zip(gpu, cpu):
            assert g["image"].is_cuda and g["label"].is_cuda
            for key in ("image", "label", "index"):
                assert torch.equal(g[key].cpu(), c[key])
        if transport == "shm":  # same host: copied straight from registered slots
            assert gpu._transfer.maps_host_memory and gpu._transfer._registered


def _delay(transfer: CudaTransfer) -> None:
    with torch.cuda.stream(transfer.stream):
        torch.cuda._sleep(_DELAY_CYCLES)


def test_pinned_slots_are_not_overwritten_while_a_copy_is_in_flight():
    """Every copy waits behind a sleep on the side stream: without the event wait before a slot is
    reused, batch i + 2 overwrites the pinned bytes batch i is still to be copied from."""
    transfer = CudaTransfer(torch.device("cuda"), slots=2, register_host_memory=False)
    outs = []
    for i in range(6):
        _delay(transfer)
        out, event = transfer.to_device({"x": torch.full((16, 1024, 1024), i, dtype=torch.uint8)})
        outs.append(transfer.hand_over(out, event))
    torch.cuda.synchronize()
    for i, out in enumerate(outs):
        assert torch.all(out["x"] == i), f"batch {i} holds another batch's bytes"
    assert all(buf.is_pinned() for slot in transfer._pinned for buf in slot.values())


def test_concurrent_receivers_and_a_stopped_one():
    transfer = CudaTransfer(torch.device("cuda"), slots=2, register_host_memory=False)
    stopped = threading.Event()
    stopped.set()
    k = transfer._next
    with pytest.raises(TransferStopped):
        transfer.to_device({"x": torch.zeros(4)}, stopped)
    assert transfer._next == k, "a stopped receiver took a pinned slot"
    results: dict[int, list] = {0: [], 1: []}

    def receive(t: int) -> None:
        for i in range(8):
            _delay(transfer)
            value = 10 * t + i
            results[t].append((value, transfer.to_device({"x": torch.full((4, 1024, 1024), value, dtype=torch.uint8)})))

    threads = [threading.Thread(target=receive, args=(t,)) for t in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    torch.cuda.synchronize()
    for t in (0, 1):
        for value, (out, _) in results[t]:
            assert torch.all(out["x"] == value), f"receiver {t}: batch {value} holds another batch's bytes"


@two_gpus
def test_a_loader_on_the_second_gpu(fmnist_server):
    kw = dict(batch_size=256, shuffle=True, seed=2)
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda:1", **kw) as gpu, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", **kw) as cpu:
        for g, c in zip(gpu, cpu):
            assert g["image"].device == torch.device("cuda", 1)
            assert torch.equal(g["image"].cpu(), c["image"])
    previous = torch.cuda.current_device()
    torch.cuda.set_device(1)  # as DDP rank 1 does; "cuda" then means cuda:1, also with several servers
    try:
        with batchd.RemoteDataLoader([fmnist_server.address, fmnist_server.address.replace("127.0.0.1", "localhost")],
                                     "fmnist-test", device="cuda", **kw) as ld:
            assert ld.device == torch.device("cuda", 1) and ld._transfer.stream.device == torch.device("cuda", 1)
            assert all(b["image"].device == torch.device("cuda", 1) for b in ld)
    finally:
        torch.cuda.set_device(previous)
