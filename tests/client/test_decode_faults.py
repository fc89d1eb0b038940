"""JPEG files the client cannot decode (``decode_on_client``): named, or skipped as the dataset's
``on_error`` says, on the OpenCV path through a real server and on the nvJPEG path's own logic
(OpenCV standing in for nvJPEG, which cannot run here); and batches whose every sample was
skipped, finished by a ``GpuTransform`` with a crop.

The bad files have their quantisation tables cut out: their headers pass the server's check, so
the server sends them, and neither OpenCV nor nvJPEG can decode them.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import batchd
from batchd.client.transport.datasets import describe_dataset
from batchd.client.device import decode
from batchd.errors import SampleError
from helpers import jpeg_batch, jpeg_bytes, opencv_as_nvjpeg, picture, without_quantisation_tables

pytestmark = pytest.mark.timeout(120)

BAD = (1, 4, 5)  # with batch_size 2 and no shuffle: batch 0 loses sample 1, batch 2 loses both samples


def _files(n: int = 6) -> list[bytes]:
    rng = np.random.default_rng(7)
    good = [jpeg_bytes(picture(rng, 40, 48)) for _ in range(n)]
    return [without_quantisation_tables(f) if i in BAD else f for i, f in enumerate(good)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import running_server

    root = tmp_path_factory.mktemp("undecodable")
    for i, data in enumerate(_files()):
        path = root / ("a" if i < 3 else "b") / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    files = {"kind": "imagefolder", "root": str(root)}
    datasets = {"raise": files, "skip": {**files, "on_error": "skip", "max_skipped_fraction": 0.6}}
    with running_server(cache_dir=tmp_path_factory.mktemp("idx"), datasets=datasets, workers=2) as s:
        yield s


def _epoch(server, dataset: str, **kw) -> list[dict[str, torch.Tensor]]:
    with batchd.RemoteDataLoader(server.address, dataset, batch_size=2, **kw) as loader:
        return [{k: v.clone() for k, v in b.items()} for b in loader]


def test_the_server_tells_the_client_the_datasets_on_error(server):
    assert describe_dataset(server.address, "raise").on_error == "raise"
    assert describe_dataset(server.address, "skip").on_error == "skip"


@pytest.mark.parametrize("transport", ["auto", "socket"])
@pytest.mark.parametrize("decode_on_client", [False, True])
def test_an_undecodable_file_fails_the_epoch_naming_the_sample(server, decode_on_client, transport):
    with pytest.raises(SampleError) as info:
        _epoch(server, "raise", decode_on_client=decode_on_client, transport=transport)
    assert info.value.dataset == "raise" and info.value.index == BAD[0]


@pytest.mark.parametrize("transport", ["shm", "inline", "socket"])
def test_an_undecodable_file_is_skipped_as_the_server_skips_it(server, transport):
    served = _epoch(server, "skip", transport=transport)
    decoded_here = _epoch(server, "skip", transport=transport, decode_on_client=True)
    assert [b["skipped"].tolist() if "skipped" in b else [] for b in served] == [[1], [], [4, 5]]
    assert len(decoded_here) == len(served) == 3
    for here, there in zip(decoded_here, served):
        assert sorted(here) == sorted(there)
        for name in there:
            assert here[name].shape == there[name].shape and torch.equal(here[name], there[name]), name


@pytest.mark.parametrize("decode_on_client", [False, True])
@pytest.mark.parametrize("channels_last", [False, True])
def test_a_batch_whose_every_sample_was_skipped_is_finished_to_the_crop_size(server, decode_on_client, channels_last):
    finish = batchd.GpuTransform(crop=(8, 6), hflip=0.5, mean=0.5, std=0.25, channels_last=channels_last)
    batches = _epoch(server, "skip", gpu_transform=finish, decode_on_client=decode_on_client)
    assert [tuple(b["image"].shape) for b in batches] == [(1, 3, 8, 6), (2, 3, 8, 6), (0, 3, 8, 6)]
    assert all(b["image"].dtype == torch.float32 for b in batches)
    assert batches[2]["index"].numel() == 0 and batches[2]["skipped"].tolist() == [4, 5]


# --- the nvJPEG path's own logic: a failed batch call is retried file by file ---------------------


@pytest.fixture
def stand_in(monkeypatch):
    monkeypatch.setattr(decode, "_torchvision_decoder", lambda: (opencv_as_nvjpeg, "RGB"))


def test_the_gpu_path_names_the_file_nvjpeg_refused(stand_in):
    files = _files()
    batch = jpeg_batch(files[:4], indices=[20, 21, 22, 23])  # sample 21 is the bad one
    with pytest.raises(SampleError) as info:
        decode.decode_gpu(batch, torch.device("cpu"), "photos", on_error="raise")
    assert (info.value.dataset, info.value.index, info.value.path) == ("photos", 21, "#21")
    assert "nvJPEG cannot decode the JPEG sent" in info.value.reason


def test_the_gpu_path_skips_the_file_nvjpeg_refused_and_keeps_the_rest(stand_in):
    files = _files()
    decoded = decode.decode_gpu(jpeg_batch(files, indices=list(range(30, 36))), torch.device("cpu"), "photos",
                                on_error="skip")
    assert decoded.left_out == list(BAD)
    good = [f for i, f in enumerate(files) if i not in BAD]
    assert torch.equal(decoded.image, decode.decode_gpu(jpeg_batch(good), torch.device("cpu")).image)
    batch = {k: v for k, v in jpeg_batch(files, indices=list(range(30, 36))).items() if k not in decode.ENCODED}
    decode.leave_out(batch, decoded.left_out)
    assert batch["index"].tolist() == [30, 32, 33] and batch["skipped"].tolist() == [31, 34, 35]
    assert batch["label"].shape == batch["position"].shape == (3,)


def test_the_gpu_path_blames_no_file_when_nvjpeg_refuses_them_all(monkeypatch):
    def broken(files, mode, device):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(decode, "_torchvision_decoder", lambda: (broken, "RGB"))
    with pytest.raises(RuntimeError, match="illegal memory access") as info:
        decode.decode_gpu(jpeg_batch(_files()[:3]), torch.device("cpu"), "photos", on_error="skip")
    assert not isinstance(info.value, SampleError)
