"""Reduced JPEG decoding when the pipeline starts by downsizing."""

from __future__ import annotations

import struct

import albumentations as A
import cv2
import numpy as np
import pytest

from batchd.server.compute import pipeline
from batchd.server.data.decode import decode_rgb, jpeg_orientation, read_rgb

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def photo(tmp_path):
    rng = np.random.default_rng(0)
    image = cv2.GaussianBlur(rng.integers(0, 255, (900, 1200, 3), dtype=np.uint8), (0, 0), 3)
    path = tmp_path / "big.jpg"
    cv2.imwrite(str(path), image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    png = tmp_path / "big.png"
    cv2.imwrite(str(png), image)
    return path, png


def test_jpeg_is_decoded_at_the_largest_reduction_that_stays_big_enough(photo):
    jpg, _ = photo
    assert read_rgb(str(jpg)).shape == (900, 1200, 3)
    assert read_rgb(str(jpg), min_size=(256, 256)).shape == (450, 600, 3)  # 1/4 would be 225 high
    assert read_rgb(str(jpg), min_size=(100, 100)).shape == (113, 150, 3)  # 1/8, rounded up
    assert read_rgb(str(jpg), min_size=(500, 500)).shape == (900, 1200, 3)  # 1/2 would be too small


def test_other_formats_are_decoded_in_full(photo):
    _, png = photo
    assert read_rgb(str(png), min_size=(100, 100)).shape == (900, 1200, 3)


@pytest.mark.parametrize(
    "compose, expected",
    [
        (A.Compose([A.Resize(256, 320), A.HorizontalFlip()]), (256, 320)),
        (A.Compose([A.SmallestMaxSize(max_size=224), A.CenterCrop(224, 224)]), (224, 224)),
        (A.Compose([A.RandomCrop(200, 200), A.Resize(100, 100)]), None),  # crops first: needs full size
        (A.Compose([A.Resize(256, 256, p=0.5)]), None),  # not always applied
        (A.Compose([A.LongestMaxSize(max_size=256)]), (256,)),  # its longest side (decode.min_dims)
        (A.Compose([A.LongestMaxSize(max_size=[256, 320])]), None),  # drawn: needs full size
        (A.Compose([A.RandomResizedCrop(size=(64, 64))]), None),  # decoded at its drawn window's scale (region.py)
        (None, None),
    ],
)
def test_decode_min_size_follows_the_first_transform(compose, expected):
    assert pipeline.decode_min_size(compose) == expected


def with_orientation(jpeg: bytes, orientation: int, order: bytes = b"MM") -> bytes:
    """``jpeg`` with an APP1 Exif segment after SOI whose IFD0 holds only Orientation (SHORT)."""
    o = ">" if order == b"MM" else "<"
    tiff = order + struct.pack(o + "HIH", 42, 8, 1) + struct.pack(o + "HHIHH", 0x0112, 3, 1, orientation, 0)
    body = b"Exif\0\0" + tiff + struct.pack(o + "I", 0)
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


@pytest.fixture(scope="module")
def wide_jpeg():
    """A 1600x400 (width x height) JPEG as stored, smooth noise."""
    rng = np.random.default_rng(1)
    image = cv2.GaussianBlur(rng.integers(0, 255, (400, 1600, 3), dtype=np.uint8), (0, 0), 2)
    ok, data = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
    assert ok
    return data.tobytes()


@pytest.mark.parametrize("order", [b"MM", b"II"])
@pytest.mark.parametrize("orientation", range(1, 9))
def test_reduced_decoding_follows_the_exif_orientation(wide_jpeg, orientation, order):
    """OpenCV turns the image upright (orientations 5-8 swap height and width); the reduction is
    chosen for the upright size, so the decoded image is never smaller than min_size."""
    data = np.frombuffer(with_orientation(wide_jpeg, orientation, order), np.uint8)
    assert jpeg_orientation(memoryview(data)) == orientation
    full = decode_rgb(data)
    assert full.shape == ((1600, 400, 3) if orientation >= 5 else (400, 1600, 3))  # OpenCV reads our tag
    h, w = full.shape[:2]
    for min_size in [(h // 16, w), (h, w // 16), (h // 4, w // 4), (100, 100)]:  # (100, 400): the issue
        reduced = decode_rgb(data, min_size=min_size)
        assert reduced.shape[0] >= min_size[0] and reduced.shape[1] >= min_size[1], (min_size, reduced.shape)
        assert reduced.shape[0] * w == reduced.shape[1] * h  # the same aspect: upright, reduced


def test_an_upright_resize_of_a_turned_jpeg_equals_the_full_decode(wide_jpeg, make_server, tmp_path):
    """The issue's case, through a server: orientation 6, Resize(100, 400). Decoding at 1/4 gave
    400x100 then a 4x upsampled width (mean |diff| 1.38); now it decodes in full, as a dataset
    with reduced_decode off does, byte for byte."""
    import batchd

    for i, orientation in enumerate((6, 8, 1)):
        (tmp_path / "c").mkdir(exist_ok=True)
        (tmp_path / "c" / f"{i}.jpg").write_bytes(with_orientation(wide_jpeg, orientation))
    resize = A.Compose([A.Resize(100, 400)])
    folder = {"kind": "imagefolder", "root": str(tmp_path)}
    server = make_server(workers=1, datasets={"on": folder, "off": {**folder, "reduced_decode": False}})
    batches = []
    for name in ("on", "off"):
        with batchd.RemoteDataLoader(server.address, name, batch_size=3, transform=resize, timeout=60) as loader:
            batches.append(next(iter(loader))["image"].numpy())
    assert batches[0].shape == (3, 100, 400, 3)
    assert np.array_equal(batches[0][:2], batches[1][:2])  # orientations 6 and 8: decoded in full either way
    assert np.abs(batches[0][2].astype(int) - batches[1][2]).mean() < 2  # upright: reduced by 4, close
