"""JPEG batches decoded on the GPU (nvJPEG through torchvision): deterministic, batch-independent,
close to OpenCV's decode (also where the server decodes at a reduced size); a file nvJPEG refuses
named or skipped; finished by a GpuTransform and read through several servers at once.

Skipped without CUDA or without a torchvision that loads with this torch. Run on a GPU machine
with `python -m pytest tests/cuda -q -s` (-s prints the measured differences from OpenCV).
"""

from __future__ import annotations

import pathlib

import albumentations as A
import cv2
import numpy as np
import pytest
import torch

import batchd
from batchd.client.device import decode
from batchd.errors import SampleError
from helpers import fine_detail, jpeg_batch, jpeg_bytes, picture, without_quantisation_tables

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and not decode.gpu_decode_available(torch.device("cuda")),
                       reason="needs torchvision (nvJPEG) loadable with this torch"),
]

PHOTOS = pathlib.Path("/usr/share/backgrounds/mate/nature")


def _files(n: int = 12) -> list[bytes]:
    """n JPEGs of 96x128 (baseline, progressive, grey, quality 75-95), then up to 2 photos."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        bgr = cv2.cvtColor(picture(rng, 96, 128), cv2.COLOR_RGB2BGR)
        if i % 5 == 4:
            bgr = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 75 + 5 * (i % 5),
                                             cv2.IMWRITE_JPEG_PROGRESSIVE, int(i % 3 == 2)])
        assert ok
        out.append(buf.tobytes())
    if PHOTOS.is_dir():
        out += [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:2]]
    return out


RESIZE = (112, 144)


def test_the_same_batch_decodes_to_the_same_bytes_twice():
    batch = jpeg_batch(_files(), RESIZE)
    a = decode.decode_gpu(batch, torch.device("cuda")).image
    b = decode.decode_gpu(batch, torch.device("cuda")).image
    assert a.is_cuda and a.dtype == torch.uint8 and a.shape == (len(_files()), *RESIZE, 3)
    assert torch.equal(a, b)


def test_a_batch_decodes_as_its_images_one_by_one_and_in_another_order():
    files = _files()
    whole = decode.decode_gpu(jpeg_batch(files, RESIZE), torch.device("cuda")).image
    for i, f in enumerate(files):
        assert torch.equal(decode.decode_gpu(jpeg_batch([f], RESIZE), torch.device("cuda")).image[0], whole[i]), i
    order = list(reversed(range(len(files))))
    reordered = decode.decode_gpu(jpeg_batch([files[i] for i in order], RESIZE), torch.device("cuda")).image
    assert torch.equal(reordered, whole[order])


@pytest.mark.parametrize("resize", [(0, 0), RESIZE])
def test_gpu_decode_is_close_to_opencv(resize):
    files = _files(12)
    batch = jpeg_batch(files if resize != (0, 0) else files[:12], resize)  # the photos (other sizes) only with a resize
    gpu = decode.decode_gpu(batch, torch.device("cuda")).image.cpu().int()
    cpu = decode.decode_cpu(batch).image.int()
    assert gpu.shape == cpu.shape
    diff = (gpu - cpu).abs().float()
    mse = (diff**2).mean().item()
    psnr = 10 * np.log10(255**2 / mse) if mse else float("inf")
    print(f"\nnvJPEG vs OpenCV, resize {resize}: {(diff > 0).float().mean().item():.1%} of values differ, "
          f"mean |d| {diff.mean().item():.3f}, max |d| {diff.max().item():.0f}, PSNR {psnr:.1f} dB")
    assert diff.mean().item() < 2.0 and psnr > 35


def test_exif_orientation_is_applied_on_the_gpu():
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(picture(np.random.default_rng(5), 40, 64), cv2.COLOR_RGB2BGR))
    data = buf.tobytes()
    tiff = b"MM\x00\x2a\x00\x00\x00\x08\x00\x01" + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00" + b"\0\0\0\0"
    app1 = b"\xff\xe1" + (len(tiff) + 8).to_bytes(2, "big") + b"Exif\0\0" + tiff
    batch = jpeg_batch([data[:2] + app1 + data[2:]])
    gpu, cpu = decode.decode_gpu(batch, torch.device("cuda")).image.cpu(), decode.decode_cpu(batch).image
    assert gpu.shape == cpu.shape == (1, 64, 40, 3)  # rotated 90 degrees, as OpenCV shows it
    assert (gpu.int() - cpu.int()).abs().float().mean() < 2.0


def test_a_file_nvjpeg_refuses_is_named_or_skipped():
    files = _files(6)[:6]
    files[2] = without_quantisation_tables(files[2])  # passes the server's check; no decoder can decode it
    batch = jpeg_batch(files, RESIZE, indices=[40, 41, 42, 43, 44, 45])
    with pytest.raises(SampleError) as info:
        decode.decode_gpu(batch, torch.device("cuda"), "photos")
    assert (info.value.dataset, info.value.index) == ("photos", 42) and "nvJPEG cannot decode" in info.value.reason
    decoded = decode.decode_gpu(batch, torch.device("cuda"), "photos", on_error="skip")
    assert decoded.left_out == [2]
    good = decode.decode_gpu(jpeg_batch(files[:2] + files[3:], RESIZE), torch.device("cuda")).image
    assert torch.equal(decoded.image, good)
    assert torch.ones(4, device="cuda").add_(1).sum().item() == 8  # the device works on after the refusal


def _jpeg_server(make_server, root: pathlib.Path, files: list[bytes], **dataset):
    for i, f in enumerate(files):
        p = root / ("a" if i % 2 else "b") / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f)
    return make_server(datasets={"j": {"kind": "imagefolder", "root": str(root), **dataset}})


def _epoch(address, **kw) -> list[dict[str, torch.Tensor]]:
    kw = dict(dict(batch_size=4, shuffle=True, seed=3), **kw)
    with batchd.RemoteDataLoader(address, "j", **kw) as loader:
        return [{k: v.cpu() for k, v in b.items()} for b in loader]


def test_loader_decodes_on_the_gpu_through_a_real_server(make_server, tmp_path):
    server = _jpeg_server(make_server, tmp_path, _files(10)[:10])  # 96x128 each (no photos: no resize here)
    on_gpu, again = (_epoch(server.address, device="cuda", decode_on_client=True) for _ in range(2))
    on_cpu = _epoch(server.address, decode_on_client=True)
    assert len(on_gpu) == len(on_cpu) == 3
    for a, b, c in zip(on_gpu, again, on_cpu):
        assert torch.equal(a["image"], b["image"])  # deterministic run to run
        assert torch.equal(a["index"], c["index"]) and torch.equal(a["position"], c["position"])
        assert (a["image"].int() - c["image"].int()).abs().float().mean() < 2.0


def test_a_file_nvjpeg_refuses_is_skipped_through_the_loader(make_server, tmp_path):
    files = _files(10)[:10]
    files[7] = without_quantisation_tables(files[7])
    server = _jpeg_server(make_server, tmp_path, files, on_error="skip", max_skipped_fraction=0.5)
    on_gpu = _epoch(server.address, device="cuda", decode_on_client=True)
    on_cpu = _epoch(server.address, decode_on_client=True)  # OpenCV refuses it too
    assert [b["index"].tolist() for b in on_gpu] == [b["index"].tolist() for b in on_cpu]
    assert [i for b in on_gpu for i in b.get("skipped", torch.zeros(0)).tolist()] == [7]
    for a, c in zip(on_gpu, on_cpu):
        assert a["image"].shape == c["image"].shape and (a["image"].int() - c["image"].int()).abs().float().mean() < 2


def test_decode_on_client_with_gpu_transform_through_one_and_several_servers(make_server, tmp_path):
    """The finished batches are the GpuTransform of the decoded ones (bit for bit, on any device),
    and two servers at once give the bytes of one: their receivers take turns on the side stream."""
    server = _jpeg_server(make_server, tmp_path, _files(40)[:40])
    finish = batchd.GpuTransform(mean=(0.5, 0.4, 0.3), std=(0.25, 0.2, 0.3), hflip=0.5, vflip=0.5, crop=(64, 80),
                                 dtype=torch.bfloat16)
    plain = _epoch(server.address, device="cuda", decode_on_client=True)
    finished = _epoch(server.address, device="cuda", decode_on_client=True, gpu_transform=finish)
    several = _epoch([server.address, server.address.replace("127.0.0.1", "localhost")], device="cuda",
                     decode_on_client=True, gpu_transform=finish)
    assert len(plain) == len(finished) == len(several) == 10
    for p, f, s in zip(plain, finished, several):
        assert torch.equal(f["image"], finish(p["image"], p["position"], seed=3, epoch=0))
        assert f["image"].shape == (4, 3, 64, 80) and f["image"].dtype == torch.bfloat16
        for key in ("image", "index", "position"):
            assert torch.equal(s[key], f[key]), key


def test_gpu_decode_follows_the_servers_reduced_decode(make_server, tmp_path):
    """Images at least twice the Resize: the server decodes them at 1/2 or 1/4; the GPU path,
    decoding at full size, reduces alike before resizing (a plain bilinear resize aliases)."""
    rng = np.random.default_rng(3)
    files = [jpeg_bytes(fine_detail(rng, h, w), quality=92) for h, w in [(240, 320), (300, 300), (481, 353)] * 2]
    server = _jpeg_server(make_server, tmp_path, files)
    on_gpu = _epoch(server.address, device="cuda", decode_on_client=True, transform=A.Resize(56, 72))
    served = _epoch(server.address, transform=A.Resize(56, 72))
    for a, c in zip(on_gpu, served):
        assert a["image"].shape == c["image"].shape
        diff = (a["image"].int() - c["image"].int()).abs().float().mean().item()
        print(f"\nnvJPEG reduced vs the server's reduced decode: mean |d| {diff:.2f}")
        assert diff < 3.0
