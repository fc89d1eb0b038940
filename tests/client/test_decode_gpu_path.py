"""The nvJPEG decode path's own logic, on the CPU: which torchvision it needs, and a downscale that
follows the server's ``jpeg_reduce`` (OpenCV stands in for nvJPEG, which cannot run here; the
real decoder is tests/cuda/test_cuda_decode.py's).
"""

from __future__ import annotations

import json
import sys
import tomllib
import types

import albumentations as A
import cv2
import numpy as np
import pytest
import torch

from batchd.client.device import decode
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from helpers import fine_detail, jpeg_bytes, opencv_as_nvjpeg

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("version, decodes", [("0.18.1", False), ("0.18.0+cu121", False), ("0.9.1", False),
                                              ("", False), ("0.19.0", True), ("0.19.1+cu124", True),
                                              ("0.22.0a0+git1234", True), ("1.0.0", True)])
def test_torchvision_must_decode_lists_on_cuda(version, decodes):
    assert decode.decodes_lists_on_cuda(version) is decodes


@pytest.mark.parametrize("version, loads", [("0.18.1", False), ("0.19.0", True)])
def test_an_older_torchvision_falls_back_to_opencv(monkeypatch, version, loads):
    """A torchvision that imports but is too old is not used (its decode_jpeg takes one file on CUDA)."""
    io = types.ModuleType("torchvision.io")
    io.decode_jpeg, io.ImageReadMode = object(), types.SimpleNamespace(RGB="RGB")
    torchvision = types.ModuleType("torchvision")
    torchvision.__version__, torchvision.io = version, io
    monkeypatch.setitem(sys.modules, "torchvision", torchvision)
    monkeypatch.setitem(sys.modules, "torchvision.io", io)
    decode._torchvision_decoder.cache_clear()
    try:
        assert decode.gpu_decode_available(torch.device("cuda", 0)) is loads
        assert not decode.gpu_decode_available(torch.device("cpu"))
    finally:
        decode._torchvision_decoder.cache_clear()


def test_the_gpu_extra_names_the_torchvision_the_decoder_needs():
    with open("pyproject.toml", "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert "torchvision>=%d.%d" % decode.TORCHVISION_MIN in extras["gpu"]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from conftest import running_server

    rng = np.random.default_rng(3)
    root = tmp_path_factory.mktemp("large")
    for i, (h, w, orientation) in enumerate([(240, 320, 0), (300, 300, 0), (481, 353, 0), (322, 246, 3)]):
        path = root / "a" / f"{i}.jpg"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(jpeg_bytes(fine_detail(rng, h, w), orientation=orientation, quality=92))
    datasets = {"reduced": {"kind": "imagefolder", "root": str(root)},  # reduced_decode on (the default)
                "full": {"kind": "imagefolder", "root": str(root), "reduced_decode": False}}
    with running_server(cache_dir=tmp_path_factory.mktemp("idx"), datasets=datasets, workers=1) as s:
        yield s


def _jpeg_batch_from(server, dataset: str, resize: tuple[int, int]) -> dict[str, torch.Tensor]:
    """The server's one JPEG batch of ``dataset`` under Resize(*resize), as the client's CPU tensors."""
    import grpc

    pipeline = pb.Pipeline(albumentations_json=json.dumps(A.to_dict(A.Compose([A.Resize(*resize)]))))
    with grpc.insecure_channel(server.address) as channel:
        request = pb.StreamBatchesRequest(dataset=dataset, batch_size=8, pipeline=pipeline,
                                          image_encoding=pb.IMAGE_ENCODING_JPEG)
        (batch,) = loader_pb2_grpc.BatchLoaderStub(channel).StreamBatches(request, timeout=60)
    return {t.name: torch.from_numpy(np.frombuffer(t.data, np.dtype(t.dtype)).reshape(tuple(t.shape)).copy())
            for t in batch.tensors}


@pytest.mark.parametrize("dataset", ["reduced", "full"])
def test_the_gpu_path_downscales_as_the_server_decodes(monkeypatch, server, dataset):
    """Where the server decodes at 1/2, 1/4 (``jpeg_reduce``), a bilinear resize from the full image
    aliases (mean |diff| from the server's bytes 12-35 of 255 here); reducing as libjpeg does first
    keeps the server's detail (0.7-0.9 at 1/4; 2.2 for the image left at 0.35x after 1/2, where
    the server's own INTER_LINEAR aliases what differs)."""
    monkeypatch.setattr(decode, "_torchvision_decoder", lambda: (opencv_as_nvjpeg, "RGB"))
    batch = _jpeg_batch_from(server, dataset, (56, 72))
    reduce = batch["jpeg_reduce"].tolist()
    assert set(reduce) == ({2, 4} if dataset == "reduced" else {1})
    ours, server_bytes = decode.decode_gpu(batch, torch.device("cpu")).image, decode.decode_cpu(batch).image
    assert ours.shape == server_bytes.shape == (4, 56, 72, 3)
    for i, n in enumerate(reduce):
        diff = (ours[i].int() - server_bytes[i].int()).abs().float().mean().item()
        assert diff < 3.0, f"sample {i} (jpeg_reduce {n}): mean |diff| {diff:.2f} from the server's decode"


def test_reduce_like_libjpeg_takes_the_mean_of_each_block():
    image = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (3, 13, 10), dtype=np.uint8))
    for n in (2, 4, 8):
        h, w = -(-13 // n), -(-10 // n)  # partial blocks at the bottom and right edges
        expected = torch.tensor([[[image[c, n * i : n * i + n, n * j : n * j + n].double().mean().item()
                                   for j in range(w)] for i in range(h)] for c in range(3)])
        assert torch.equal(decode.reduce_like_libjpeg(image, n), expected.round().to(torch.uint8))
    assert decode.reduce_like_libjpeg(image, 1) is image


def test_libjpeg_at_a_quarter_is_within_rounding_of_the_block_mean():
    """The claim reduce_like_libjpeg rests on, checked against libjpeg itself (OpenCV's
    IMREAD_REDUCED_COLOR_4) on a smooth picture, where its scaled IDCT and a box filter agree."""
    y, x = np.mgrid[0:160, 0:200]
    rgb = np.stack([x * 255 // 199, y * 255 // 159, (x + y) * 127 // 358], -1).astype(np.uint8)
    data = np.frombuffer(jpeg_bytes(rgb, quality=100), np.uint8)
    full = torch.from_numpy(cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)).permute(2, 0, 1)
    quarter = cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_REDUCED_COLOR_4), cv2.COLOR_BGR2RGB)
    ours = decode.reduce_like_libjpeg(full, 4).permute(1, 2, 0).numpy()
    assert ours.shape == quarter.shape and np.abs(ours.astype(int) - quarter.astype(int)).mean() < 1.0
