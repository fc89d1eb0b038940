"""CUDA copies: pinned buffers reused behind events, shared-memory slots registered and copied
directly (and a refused registration), a lock for concurrent receivers that ``hand_over`` does
not wait for, an error after a queued copy, and the device index a loader binds to.

Skipped without CUDA. Run on a GPU machine with `python -m pytest tests/cuda -q`. The copies
that must be waited for sit behind ``torch.cuda._sleep`` on the side stream, so a missing wait
shows other bytes instead of passing by luck.
"""

from __future__ import annotations

import logging
import mmap
import threading

import numpy as np
import pytest
import torch

import batchd
from batchd.client.device.transfer import CudaTransfer, TransferStopped

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

_DELAY_CYCLES = 200_000_000  # torch.cuda._sleep: about 0.1 s of a GPU's clock, so copies are still queued


@pytest.mark.parametrize("transport", ["shm", "socket", "inline"])
def test_batches_on_the_device_equal_cpu_batches(fmnist_server, transport):
    kw = dict(batch_size=256, shuffle=True, seed=1, transform="flip", transport=transport)
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda", **kw) as gpu, \
         batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", **kw) as cpu:
        for g, c in zip(gpu, cpu):
            assert g["image"].is_cuda and g["label"].is_cuda
            for key in ("image", "label", "index"):
                assert torch.equal(g[key].cpu(), c[key])
        if transport == "shm":  # same host: copied straight from registered slots
            assert gpu._transfer.maps_host_memory and gpu._transfer.host.registered


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
    for i, out in enumerate(outs):  # on the current stream, which waits for each copy's event: no synchronize
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
    for t in (0, 1):
        for value, (out, event) in results[t]:
            transfer.hand_over(out, event)
            assert torch.all(out["x"] == value), f"receiver {t}: batch {value} holds another batch's bytes"


def test_hand_over_does_not_wait_for_the_copy_lock():
    """A receiver holds the copy lock through a whole batch's pinned memcpy and event waits; the
    consumer's hand_over of the batch before must not queue behind it."""
    transfer = CudaTransfer(torch.device("cuda"), register_host_memory=False)
    out, event = transfer.to_device({"x": torch.ones(1024)})
    handed = threading.Event()
    consumer = threading.Thread(target=lambda: (transfer.hand_over(out, event), handed.set()))
    with transfer._lock:  # a receiver in the middle of its copy
        consumer.start()
        assert handed.wait(10), "hand_over waited for the copy lock"
    consumer.join()
    assert torch.all(out["x"] == 1)


def _registered_batch(transfer: CudaTransfer) -> tuple[mmap.mmap, dict[str, torch.Tensor]]:
    """A batch in host memory registered with ``transfer`` (as a shared-memory slot is)."""
    mm = mmap.mmap(-1, 1 << 22)
    base = np.frombuffer(mm, np.uint8)
    if not transfer.register(base.ctypes.data, len(mm)):
        pytest.skip("this device refuses read-only host registration")
    base[:] = 7
    image = torch.from_numpy(base[: 64 * 64 * 64 * 3].reshape(64, 64, 64, 3))
    return mm, {"image": image, "position": torch.arange(64)}


@pytest.mark.parametrize("registered", [False, True])
def test_an_error_after_the_copy_was_queued_waits_for_the_copy(registered):
    """gpu_transform raises after the copy was queued behind a sleep: to_device must not raise (and
    let the leased slot or pinned buffer go) before the copy has read it."""
    transfer = CudaTransfer(torch.device("cuda"), register_host_memory=registered)
    if registered:
        mm, batch = _registered_batch(transfer)
    else:
        mm, batch = None, {"image": torch.full((64, 64, 64, 3), 7, dtype=torch.uint8), "position": torch.arange(64)}

    def failing(images, positions, *, seed, epoch):
        raise RuntimeError("gpu_transform failed")

    _delay(transfer)
    with pytest.raises(RuntimeError, match="gpu_transform failed"):
        transfer.to_device(batch, registered=registered, finish=failing)
    assert transfer.stream.query(), "to_device raised while its copy was still queued"
    assert not transfer._holding
    transfer.close()  # unregisters the memory
    del mm  # only now may it be unmapped


def test_a_refused_registration_falls_back_and_the_next_kernel_runs(fmnist_server, caplog):
    """CUDA refuses every registration (flags it does not know: cudaErrorInvalidValue). The error
    must not stay pending in the receiver thread, whose next kernel (the GpuTransform) would raise
    it; the batches go through pinned buffers, the same bytes."""
    kw = dict(batch_size=500, shuffle=True, seed=5, transport="shm")
    finish = batchd.GpuTransform(mean=0.286, std=0.353, hflip=0.5, crop=24)
    with caplog.at_level(logging.WARNING, logger="batchd.client.device.host_register"), \
            batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", device="cuda", gpu_transform=finish, **kw) as gpu, \
            batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", gpu_transform=finish, **kw) as cpu:
        gpu._transfer.host.flags = 0x80  # not a cudaHostRegister flag
        n = 0
        for g, c in zip(gpu, cpu):
            assert torch.equal(g["image"].cpu(), c["image"]) and torch.equal(g["index"].cpu(), c["index"])
            n += 1
        assert n == len(cpu) == 20
        assert not gpu._transfer.maps_host_memory and not gpu._transfer.host.registered
    assert "cudaHostRegister of a shared-memory segment" in caplog.text and "CUDA error 1)" in caplog.text
    torch.ones(8, device="cuda").add_(1)  # and nothing is pending in this thread either
    torch.cuda.synchronize()


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
