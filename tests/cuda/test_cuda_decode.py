"""JPEG batches decoded on the GPU (nvJPEG through torchvision): deterministic, batch-independent,
close to OpenCV's decode.

Skipped without CUDA or without a torchvision that loads with this torch. Run on a GPU machine
with `python -m pytest tests/cuda -q -s` (-s prints the measured differences from OpenCV).
"""

from __future__ import annotations

import pathlib

import cv2
import numpy as np
import pytest
import torch

import batchd
from batchd.client import decode

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    pytest.mark.skipif(torch.cuda.is_available() and not decode.gpu_decode_available(torch.device("cuda")),
                       reason="needs torchvision (nvJPEG) loadable with this torch"),
]

PHOTOS = pathlib.Path("/usr/share/backgrounds/mate/nature")


def _picture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // (w - 1), y * 255 // (h - 1), (x + y) * 127 // (h + w - 2)], -1).astype(np.int32)
    img += rng.integers(-12, 12, (h, w, 3))
    for _ in range(3):
        y0, x0 = rng.integers(0, h - 4), rng.integers(0, w - 4)
        img[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def _files(n: int = 12) -> list[bytes]:
    """n JPEGs of 96x128 (baseline, progressive, grey, quality 75-95), then up to 2 photos."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        bgr = cv2.cvtColor(_picture(rng, 96, 128), cv2.COLOR_RGB2BGR)
        if i % 5 == 4:
            bgr = cv2.cvtColor(bgr, cv2.COLOR_BGR2GRAY)
        ok, buf = cv2.imencode(".jpg", bgr, [cv2.IMWRITE_JPEG_QUALITY, 75 + 5 * (i % 5),
                                             cv2.IMWRITE_JPEG_PROGRESSIVE, int(i % 3 == 2)])
        assert ok
        out.append(buf.tobytes())
    if PHOTOS.is_dir():
        out += [p.read_bytes() for p in sorted(PHOTOS.glob("*.jpg"))[:2]]
    return out


def _batch(files: list[bytes], resize: tuple[int, int] = (0, 0)) -> dict[str, torch.Tensor]:
    """A JPEG batch as the client receives it (CPU tensors; see server/compute/encoded.py)."""
    offsets = np.cumsum([0, *map(len, files)]).astype(np.int64)
    n = len(files)
    return {"label": torch.zeros(n, dtype=torch.int64), "index": torch.arange(n), "position": torch.arange(n),
            "jpeg_offsets": torch.from_numpy(offsets), "jpeg_resize": torch.tensor(resize, dtype=torch.int64),
            "jpeg": torch.from_numpy(np.frombuffer(b"".join(files), np.uint8).copy())}


RESIZE = (112, 144)


def test_the_same_batch_decodes_to_the_same_bytes_twice():
    batch = _batch(_files(), RESIZE)
    a = decode.decode_gpu(batch, torch.device("cuda"))
    b = decode.decode_gpu(batch, torch.device("cuda"))
    assert a.is_cuda and a.dtype == torch.uint8 and a.shape == (len(_files()), *RESIZE, 3)
    assert torch.equal(a, b)


def test_a_batch_decodes_as_its_images_one_by_one_and_in_another_order():
    files = _files()
    whole = decode.decode_gpu(_batch(files, RESIZE), torch.device("cuda"))
    for i, f in enumerate(files):
        assert torch.equal(decode.decode_gpu(_batch([f], RESIZE), torch.device("cuda"))[0], whole[i]), i
    order = list(reversed(range(len(files))))
    reordered = decode.decode_gpu(_batch([files[i] for i in order], RESIZE), torch.device("cuda"))
    assert torch.equal(reordered, whole[order])


@pytest.mark.parametrize("resize", [(0, 0), RESIZE])
def test_gpu_decode_is_close_to_opencv(resize):
    files = _files(12)
    batch = _batch(files if resize != (0, 0) else files[:12], resize)  # the photos (other sizes) only with a resize
    gpu = decode.decode_gpu(batch, torch.device("cuda")).cpu().int()
    cpu = decode.decode_cpu(batch).int()
    assert gpu.shape == cpu.shape
    diff = (gpu - cpu).abs().float()
    mse = (diff**2).mean().item()
    psnr = 10 * np.log10(255**2 / mse) if mse else float("inf")
    print(f"\nnvJPEG vs OpenCV, resize {resize}: {(diff > 0).float().mean().item():.1%} of values differ, "
          f"mean |d| {diff.mean().item():.3f}, max |d| {diff.max().item():.0f}, PSNR {psnr:.1f} dB")
    assert diff.mean().item() < 2.0 and psnr > 35


def test_exif_orientation_is_applied_on_the_gpu():
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(_picture(np.random.default_rng(5), 40, 64), cv2.COLOR_RGB2BGR))
    data = buf.tobytes()
    tiff = b"MM\x00\x2a\x00\x00\x00\x08\x00\x01" + b"\x01\x12\x00\x03\x00\x00\x00\x01\x00\x06\x00\x00" + b"\0\0\0\0"
    app1 = b"\xff\xe1" + (len(tiff) + 8).to_bytes(2, "big") + b"Exif\0\0" + tiff
    batch = _batch([data[:2] + app1 + data[2:]])
    gpu, cpu = decode.decode_gpu(batch, torch.device("cuda")).cpu(), decode.decode_cpu(batch)
    assert gpu.shape == cpu.shape == (1, 64, 40, 3)  # rotated 90 degrees, as OpenCV shows it
    assert (gpu.int() - cpu.int()).abs().float().mean() < 2.0


def test_loader_decodes_on_the_gpu_through_a_real_server(make_server, tmp_path):
    files = _files(10)[:10]  # 96x128 each (no photos: no resize here)
    for i, f in enumerate(files):
        p = tmp_path / "jpegs" / ("a" if i % 2 else "b") / f"{i}.jpg"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(f)
    server = make_server(datasets={"j": {"kind": "imagefolder", "root": str(tmp_path / "jpegs")}})
    kw = dict(batch_size=4, shuffle=True, seed=3, transform=None)

    def epoch(**extra):
        with batchd.RemoteDataLoader(server.address, "j", **kw, **extra) as loader:
            return [{k: v.cpu() for k, v in b.items()} for b in loader]

    on_gpu, again, on_cpu = epoch(device="cuda", decode_on_client=True), epoch(device="cuda", decode_on_client=True), \
        epoch(decode_on_client=True)
    assert len(on_gpu) == len(on_cpu) == 3
    for a, b, c in zip(on_gpu, again, on_cpu):
        assert torch.equal(a["image"], b["image"])  # deterministic run to run
        assert torch.equal(a["index"], c["index"]) and torch.equal(a["position"], c["position"])
        assert (a["image"].int() - c["image"].int()).abs().float().mean() < 2.0
