"""The targets of a sample, checked in the worker before its pipeline: bad boxes are bad samples.

Every sample of every kind, as the dataset gives it (``kind: python``'s ``__getitem__``, a
built-in kind's decode; before the pipeline's prefix, so before the cache; a region decode's,
server/compute/region.py, on the full frame its targets are in), goes through ``check_targets``:

* per-object fields (``FieldSpec.per_object``: ``boxes``, ``labels``, ``masks``, ``keypoints``,
  ``iscrowd``, ``area``, the dataset's own) are arrays with a first dimension, and agree on N;
* ``boxes``: a numeric array [N, 4], x_min, y_min, x_max, y_max in pixels; every value finite;
  x_min < x_max and y_min < y_max (an empty or inverted box is refused: albumentations refuses it,
  and torchvision's detection models assert positive widths and heights); no edge outside the
  image ([0, W] x [0, H]) by more than ``OUTSIDE_PX`` (1 pixel); and, when the pipeline moves
  boxes without ``clip`` (``inside``), none outside it at all (albumentations' own range check,
  ``bbox_utils.check_bboxes``: it would refuse the sample, in normalised coordinates);
* ``keypoints``: a numeric array [N, K, D], D >= 2 (x, y first, in pixels), x and y finite
  (points outside the image are fine: each object keeps its K points, docs/targets.md).

A failure is a ``SampleError`` naming the dataset, the index, the field, what was expected and
what came, in the sample's own pixel coordinates (so ``on_error: skip`` leaves out that sample
alone). A sample that passes leaves with ``boxes`` and ``keypoints`` as float32, whatever dtype
the dataset gave: the pipeline works in float32 and the batch carries float32 (targets.py).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from batchd.errors import SampleError
from batchd.server.compute.targets import check_objects

OUTSIDE_PX = 1.0  # pixels a box edge may lie outside the image (annotation tools' pixel-edge conventions)
_NUMBERS = "biuf"  # numpy dtype kinds of numbers (bool, int, unsigned, float)


def check_targets(sample: dict, *, dataset: str, index: int, source: str, per_object: Callable[[str], bool],
                  inside: bool = False, size: tuple[int, int] | None = None) -> dict:
    """``sample`` with ``boxes`` and ``keypoints`` as float32 (a new dict if either is present),
    after the checks of the module docstring. ``inside``: the pipeline moves boxes without
    ``clip``, so a box must lie inside the image (albumentations' tolerance). ``size``: the
    image's (height, width) when ``sample["image"]`` is not the whole frame its targets are in
    (a region decode, server/compute/region.py: only a window of it, at m/8); default the
    image's own. Raises SampleError."""

    def bad(reason: str) -> SampleError:
        return SampleError(dataset, index, source, reason)

    try:
        check_objects(sample, per_object)
    except ValueError as e:
        raise bad(str(e)) from None
    boxes, keypoints = sample.get("boxes"), sample.get("keypoints")
    if boxes is None and keypoints is None:
        return sample
    if size is None:
        image = sample.get("image")
        size = tuple(image.shape[:2]) if getattr(image, "ndim", 0) >= 2 else None
    out = dict(sample)
    if boxes is not None:
        out["boxes"] = _boxes(boxes, size, inside, bad)
    if keypoints is not None:
        out["keypoints"] = _keypoints(keypoints, bad)
    return out


def _boxes(boxes, size: tuple[int, int] | None, inside: bool, bad: Callable[[str], SampleError]) -> np.ndarray:
    """float32 [N, 4] boxes, checked (``check_targets``)."""
    expected = "expected a numeric array [N, 4] (x_min, y_min, x_max, y_max in pixels)"
    if not isinstance(boxes, np.ndarray) or boxes.dtype.kind not in _NUMBERS or boxes.ndim != 2 or boxes.shape[1] != 4:
        raise bad(f"field 'boxes': {expected}, got {_describe(boxes)}")
    values = boxes.astype(np.float64, copy=False)
    finite = np.isfinite(values).all(1)
    if not finite.all():
        k = int(np.argmin(finite))
        raise bad(f"field 'boxes': box {k} is {_box(values[k])}: expected finite pixel coordinates")
    order = (values[:, 2] > values[:, 0]) & (values[:, 3] > values[:, 1])
    if not order.all():
        k = int(np.argmin(order))
        raise bad(f"field 'boxes': box {k} is {_box(values[k])}: expected x_min < x_max and y_min < y_max "
                  "(an empty or inverted box)")
    if size is not None and len(values):
        h, w = size
        low, high = np.array([0.0, 0.0, 0.0, 0.0]), np.array([w, h, w, h], np.float64)
        outside = np.maximum(low - values, values - high).max(1)  # pixels past the nearest edge
        if (outside > OUTSIDE_PX).any():
            k = int(np.argmax(outside > OUTSIDE_PX))
            raise bad(f"field 'boxes': box {k} is {_box(values[k])}, {outside[k]:g} px outside the image of "
                      f"{w}x{h} pixels: expected 0 <= x <= {w} and 0 <= y <= {h}, give or take {OUTSIDE_PX:g} px")
        if inside:
            normalised = values / high
            ok = ((normalised >= 0) & (normalised <= 1)) | np.isclose(normalised, 0) | np.isclose(normalised, 1)
            if not ok.all():
                k = int(np.argmin(ok.all(1)))
                raise bad(f"field 'boxes': box {k} is {_box(values[k])}, outside the image of {w}x{h} pixels, "
                          f"which the pipeline's albumentations refuses: expected 0 <= x <= {w} and 0 <= y <= {h} "
                          "(bbox_params clip=True clips such boxes to the image first)")
    return boxes if boxes.dtype == np.float32 else boxes.astype(np.float32)


def _keypoints(keypoints, bad: Callable[[str], SampleError]) -> np.ndarray:
    """float32 [N, K, D] keypoints, checked (``check_targets``)."""
    if (not isinstance(keypoints, np.ndarray) or keypoints.dtype.kind not in _NUMBERS or keypoints.ndim != 3
            or keypoints.shape[2] < 2):
        raise bad(f"field 'keypoints': expected a numeric array [N, K, D] with D >= 2 (x, y in pixels first), "
                  f"got {_describe(keypoints)}")
    xy = keypoints[..., :2].astype(np.float64, copy=False)
    finite = np.isfinite(xy).all(-1)
    if not finite.all():
        n, k = (int(i) for i in np.argwhere(~finite)[0])
        raise bad(f"field 'keypoints': point {k} of object {n} is ({xy[n, k, 0]:g}, {xy[n, k, 1]:g}): expected finite "
                  "pixel coordinates (mark a missing point in a visibility column instead)")
    return keypoints if keypoints.dtype == np.float32 else keypoints.astype(np.float32)


def _box(row: np.ndarray) -> str:
    return "[" + ", ".join(f"{v:g}" for v in row) + "]"


def _describe(value) -> str:
    """``int64 [3, 3]``, or the type of a value that is not an array."""
    if isinstance(value, np.ndarray):
        return f"{value.dtype} {list(value.shape)}"
    return type(value).__name__
