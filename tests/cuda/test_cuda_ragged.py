"""Ragged batches on a CUDA device: each ragged field copied once (its flat buffer), then split into
views on the device; str / bytes stay on the CPU; collate_fn gets device tensors.

Skipped without CUDA (the CPU side of the same code path: tests/client/test_ragged_batches.py::
test_a_ragged_field_is_copied_as_one_tensor_then_split). Run on a GPU machine with
`python -m pytest tests/cuda -q`.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import DataLoader

import batchd
import batches
from batch_server import BatchServer

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

N, B = 10, 4
RAGGED, STACKED, STRINGS = ("image", "boxes", "labels", "masks"), ("label", "index", "position"), ("name", "blob")


@pytest.fixture(scope="module")
def server():
    with BatchServer(batches.detection_samples, N) as s:
        yield s


@pytest.mark.parametrize("transport", ["shm", "socket", "inline"])
def test_ragged_fields_are_views_of_one_device_copy(server, transport):
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, device="cuda", transport=transport) as ld:
        for batch in ld:
            torch.cuda.current_stream().synchronize()
            batches.assert_batch_holds(batch, batches.detection_samples(batch["index"].tolist()))
            for name in RAGGED:  # one device buffer per field, each sample a view of it
                assert all(t.is_cuda for t in batch[name])
                batches.assert_views_of_one_buffer(name, batch[name])
            assert all(batch[name].is_cuda for name in STACKED)
            assert all(isinstance(v, str | bytes) for name in STRINGS for v in batch[name])


def test_one_host_to_device_copy_per_field_and_batch(server):
    """The profiler counts the host-to-device copies: at most one per tensor field per batch (3
    stacked + 4 ragged), not one per sample (B x 4 more)."""
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, device="cuda", transport="inline") as ld:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            n = sum(1 for _ in ld)
            torch.cuda.synchronize()
    copies = [e for e in prof.events() if "Memcpy HtoD" in e.name]
    assert n == 3 and 0 < len(copies) <= n * (len(STACKED) + len(RAGGED)), [e.name for e in copies]


def test_collate_fn_gets_device_tensors_in_the_iterating_thread(server):
    def fn(samples):
        assert threading.current_thread() is threading.main_thread()  # after hand_over, on the loop's stream
        assert all(s["image"].is_cuda and s["boxes"].is_cuda and isinstance(s["name"], str) for s in samples)
        return tuple(zip(*[(s.pop("image"), s) for s in samples]))

    want = list(DataLoader(_ImageTarget(), batch_size=B, collate_fn=lambda x: tuple(zip(*x))))
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, device="cuda", collate_fn=fn) as ld:
        got = list(ld)
    for (images, targets), (want_images, want_targets) in zip(got, want, strict=True):
        assert all(torch.equal(a.cpu(), b) for a, b in zip(images, want_images, strict=True))
        for t, w in zip(targets, want_targets, strict=True):
            assert list(t) == list(w)
            assert all(torch.equal(t[k].cpu(), w[k]) if isinstance(w[k], torch.Tensor) else t[k] == w[k] for k in w)


def test_gpu_transform_refuses_ragged_images_on_the_device(server):
    with batchd.RemoteDataLoader(server.address, "handmade", batch_size=B, device="cuda",
                                 gpu_transform=batchd.GpuTransform()) as ld:
        with pytest.raises(ValueError, match="images of different sizes"):
            next(iter(ld))


class _ImageTarget(torch.utils.data.Dataset):
    """The samples as torchvision's detection datasets give them: (image, target dict), on the CPU."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int):
        sample = batches.torch_sample(i)
        return sample.pop("image"), sample
