"""The oracle of the targets: ONE plain albumentations Compose on a stream of the test's own.

Nothing here is batchd's code: the boxes are put in each bbox format by hand from the raw label
(pixels, float64), the Compose is rebuilt from the user's (``A.from_dict``: albumentations' own
classes, not the server's widened ones), and its random state is the test's own generator: numpy's
``Philox(key=key).jumped(position)`` (numpy: "random/parallel.rst", jumping: its counter starts at
[0, 0, position, 0], the sample stream's documented definition, batchd/sampler.py) handed to the
Compose with ``Compose.set_random_state``, with a ``random.Random`` drawing from that same
generator (``StreamRandom``: ``random()`` is the generator's ``random()``, ``getrandbits(k)`` the
top k bits of consecutive raw 64-bit words, ``gauss`` a normal deviate: the contract of the
stream every transform draws from, server/compute/pipeline.py).

The worker's boxes take another path to the same numbers (COCO xywh to float32 xyxy at index
build, then albumentations' converters into the format, float32 throughout), so they are
compared within ``BOX_ULPS`` float32 ulps at the image's size (``assert_boxes``); images, masks
and the surviving objects are compared exactly.
"""

from __future__ import annotations

import random

import albumentations as A
import numpy as np

FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")
MIN_SIDE = 0.01  # docs/targets.md: the worker's BboxParams min_width / min_height are at least this
# Largest difference between the worker's boxes and one Compose's, in float32 ulps at the image's
# side (spacing(float32(max(H, W))) px for pixel formats, spacing(1.0) for normalised ones); the
# figure docs/targets.md states. Measured: see ulps() and the oracle test's report.
BOX_ULPS = 4


class StreamRandom(random.Random):
    """A ``random.Random`` whose draws come from a numpy Generator: ``random()`` its ``random()``,
    ``getrandbits(k)`` the top k bits of ceil(k / 64) raw 64-bit words (first word most
    significant), ``gauss(mu, sigma)`` ``mu + sigma * standard_normal()``; seeding does nothing."""

    def __init__(self, generator: np.random.Generator):
        self.generator = generator
        super().__init__()

    def seed(self, a=None, version=2) -> None:
        pass

    def random(self) -> float:
        return self.generator.random()

    def getrandbits(self, k: int) -> int:
        words = -(-k // 64)
        value = 0
        for _ in range(words):
            value = (value << 64) | int(self.generator.bit_generator.random_raw())
        return value >> (64 * words - k)

    def gauss(self, mu: float = 0.0, sigma: float = 1.0) -> float:
        return mu + sigma * float(self.generator.standard_normal())


def stream(key: np.ndarray, position: int) -> np.random.Generator:
    """The sample's stream: Philox under ``key`` (uint64 [2]) jumped ``position`` times."""
    return np.random.Generator(np.random.Philox(key=np.asarray(key, np.uint64)).jumped(position))


def in_format(xyxy: np.ndarray, fmt: str, height: int, width: int) -> np.ndarray:
    """float64 [N, 4] pixel boxes (x_min, y_min, x_max, y_max) in ``fmt``, by hand."""
    x0, y0, x1, y1 = np.asarray(xyxy, np.float64).reshape(-1, 4).T
    columns = {"pascal_voc": (x0, y0, x1, y1), "coco": (x0, y0, x1 - x0, y1 - y0),
               "yolo": ((x0 + x1) / 2 / width, (y0 + y1) / 2 / height, (x1 - x0) / width, (y1 - y0) / height),
               "albumentations": (x0 / width, y0 / height, x1 / width, y1 / height)}[fmt]
    return np.stack(columns, 1)


def plain_compose(pipe: A.Compose, *, keypoints: bool = False) -> A.Compose:
    """``pipe``'s transforms and params as one plain Compose (albumentations' own classes), with
    label fields ``ids`` (each box's object) and ``kp_ids`` (each keypoint's), and min_width /
    min_height at least MIN_SIDE (docs/targets.md)."""
    spec = A.to_dict(pipe)["transform"]
    given = spec.get("bbox_params") or {"format": "pascal_voc"}
    bbox = {**given, "label_fields": ["ids"], "min_width": max(given.get("min_width") or 0, MIN_SIDE),
            "min_height": max(given.get("min_height") or 0, MIN_SIDE)}
    fresh = A.from_dict(A.to_dict(pipe))
    kp = spec.get("keypoint_params") or {"format": "xy", "remove_invisible": False}
    return A.Compose(fresh.transforms, bbox_params=A.BboxParams(**bbox),
                     keypoint_params=A.KeypointParams(**{**kp, "label_fields": ["kp_ids"]}) if keypoints else None)


def one_compose(pipe: A.Compose, key: np.ndarray, position: int, *, keypoints: bool = False) -> A.Compose:
    """``plain_compose(pipe)`` drawing from the sample's stream (``stream(key, position)``)."""
    one = plain_compose(pipe, keypoints=keypoints)
    generator = stream(key, position)
    one.set_random_state(generator, StreamRandom(generator))
    return one


def scale(fmt: str, height: int, width: int) -> float:
    """The float32 ulp a box of ``fmt`` is compared in: at the image's larger side in pixels, at 1 normalised."""
    return float(np.spacing(np.float32(1.0 if fmt in ("yolo", "albumentations") else max(height, width))))


def ulps(got: np.ndarray, want: np.ndarray, fmt: str, height: int, width: int) -> float:
    """The largest difference between two box arrays, in ``scale`` ulps (0 for two empty arrays)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / scale(fmt, height, width)) if got.size else 0.0


def assert_boxes(got: np.ndarray, want: np.ndarray, fmt: str, height: int, width: int, what: str) -> float:
    """float32 boxes ``got`` equal ``want`` within BOX_ULPS (``ulps``); returns the ulps."""
    assert got.dtype == np.float32, f"{what}: boxes are {got.dtype}, not float32"
    assert got.shape == np.shape(want), f"{what}: boxes {got.shape} vs {np.shape(want)}:\n{got}\n{want}"
    u = ulps(got, want, fmt, height, width)
    assert u <= BOX_ULPS, f"{what}: boxes differ by {u:.1f} ulps (> {BOX_ULPS}):\n{got}\nvs one Compose\n{want}"
    return u
