"""Reduced JPEG decoding when the pipeline starts by downsizing."""

from __future__ import annotations

import albumentations as A
import cv2
import numpy as np
import pytest

from batchd.server.compute import pipeline
from batchd.server.data.datasets._files import read_rgb

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
        (A.Compose([A.LongestMaxSize(max_size=256)]), None),
        (None, None),
    ],
)
def test_decode_min_size_follows_the_first_transform(compose, expected):
    assert pipeline.decode_min_size(compose) == expected
