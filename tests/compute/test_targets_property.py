"""A property (hypothesis): whatever a dataset's boxes, the worker gives what one plain Compose gives.

Drawn: an image of 12-40 x 12-40 pixels; 0-4 boxes of integer or float dtype (int32, int64,
uint16, float32, float64; fractional pixels in 32nds, exact in every float dtype), keypoints of
the same dtype; extra fields of every kind a sample may hold (int, float, bool, str, bytes, int32
and float16 arrays); a bbox format; a cacheable prefix or none (Resize, LongestMaxSize +
PadIfNeeded, CenterCrop, ToGray); flips, quarter turns, a transpose, a RandomCrop and a
CoarseDropout after it; ``check_each_transform`` true or false. The worker (in this process, a real
slot) and the oracle (tests/targets_oracle.py: one plain albumentations Compose on the test's own
stream, boxes in the format by hand) must agree: the same image and labels exactly, boxes
float32 within ``BOX_ULPS``, keypoints float32 within as much, every extra field as it was (value
and dtype), or both refuse the sample. No silent difference: a truncated, zeroed, re-typed or
dropped target fails it.
"""

from __future__ import annotations

import pathlib
import sys

import albumentations as A
import cv2
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import batchd
from inworker import InWorker
from targets_oracle import BOX_ULPS, FORMATS, assert_boxes, in_format, one_compose, scale

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
KEY = np.array([1, 38], np.uint64)
DTYPES = ("int32", "int64", "uint16", "float32", "float64")
CONSTANT = {"border_mode": cv2.BORDER_CONSTANT, "fill": 0, "fill_mask": 0}
EXTRA = {"count": ["int", 7], "weight": ["float", 0.25], "flag": ["bool", True], "name": ["str", "photo-é"],
         "raw": ["bytes", [0, 1, 255]], "ids": ["int32", [3, -4]], "half": ["float16", [[0.5, 1.5]]]}


@pytest.fixture(scope="module", autouse=True)
def pydata():
    sys.path.insert(0, str(PYDATA))  # the worker runs in this process: it imports as the server would
    yield
    sys.path.remove(str(PYDATA))


@st.composite
def cases(draw) -> dict:
    h, w = draw(st.integers(12, 40)), draw(st.integers(12, 40))
    dtype = draw(st.sampled_from(DTYPES))
    whole = dtype.startswith(("int", "uint"))
    boxes = []
    for _ in range(draw(st.integers(0, 4))):
        x0, y0 = draw(st.integers(0, 32 * (w - 1) - 1)), draw(st.integers(0, 32 * (h - 1) - 1))
        x1, y1 = draw(st.integers(x0 + 32, 32 * w)), draw(st.integers(y0 + 32, 32 * h))
        box = [x0 / 32, y0 / 32, x1 / 32, y1 / 32]
        boxes.append([float(int(v)) for v in box] if whole else box)
    boxes = [b for b in boxes if b[2] > b[0] and b[3] > b[1]]
    prefix = draw(st.sampled_from(["none", "resize", "longest", "center", "gray"]))
    after = {"none": (h, w), "gray": (h, w), "resize": (h + 6, w // 2 + 4), "longest": (30, 30),
             "center": (h - 4, w - 3)}[prefix]
    rest = draw(st.lists(st.sampled_from(["hflip", "vflip", "rot90", "transpose", "crop", "dropout"]), max_size=3))
    return {"h": h, "w": w, "seed": draw(st.integers(0, 2**16)), "dtype": dtype, "boxes": boxes,
            "fmt": draw(st.sampled_from(FORMATS)), "prefix": prefix, "after": after, "rest": rest,
            "each": draw(st.booleans()), "extra": {k: EXTRA[k] for k in draw(st.sets(st.sampled_from(sorted(EXTRA))))}}


def pipeline(case: dict) -> A.Compose:
    h, w = case["h"], case["w"]
    prefix = {"none": [], "gray": [A.ToGray(p=1)], "resize": [A.Resize(h + 6, w // 2 + 4)],
              "longest": [A.LongestMaxSize(max_size=30), A.PadIfNeeded(30, 30, **CONSTANT)],
              "center": [A.CenterCrop(h - 4, w - 3)]}[case["prefix"]]
    ah, aw = case["after"]
    steps = {"hflip": lambda: A.HorizontalFlip(p=0.5), "vflip": lambda: A.VerticalFlip(p=0.5),
             "rot90": lambda: A.RandomRotate90(p=0.5), "transpose": lambda: A.Transpose(p=0.5),
             "crop": lambda: A.RandomCrop(max(1, ah * 3 // 4), max(1, aw * 3 // 4)),
             "dropout": lambda: A.CoarseDropout(num_holes_range=(1, 2), hole_height_range=(0.2, 0.4),
                                                hole_width_range=(0.2, 0.4), p=0.8)}
    rest = [steps[name]() for name in case["rest"]]
    if "crop" in case["rest"] and any(n in ("rot90", "transpose") for n in case["rest"]):
        rest = [t for t in rest if not isinstance(t, A.RandomCrop)]  # (a turn may swap H and W before the crop)
    return A.Compose(prefix + rest, bbox_params=A.BboxParams(format=case["fmt"], label_fields=["labels"],
                                                               check_each_transform=case["each"]),
                     keypoint_params=A.KeypointParams(format="xy", remove_invisible=False))


def run_worker(case: dict, tmp_path, pipe: A.Compose):
    ds = {"kind": "python", "factory": "batchd_testdata:Given",
          "args": {"h": case["h"], "w": case["w"], "seed": case["seed"], "boxes": case["boxes"],
                   "box_dtype": case["dtype"], "extra": case["extra"]}}
    with InWorker({"g": ds}, tmp_path) as w:
        try:
            return w.batch("g", [0], pipe, key=KEY, positions=[5])[1]
        except (batchd.SampleError, ValueError) as e:
            return e


def run_oracle(case: dict, pipe: A.Compose):
    import batchd_testdata

    s = batchd_testdata.Given(case["h"], case["w"], case["seed"], case["boxes"], case["dtype"], case["extra"])[0]
    n = len(s["boxes"])
    try:
        return one_compose(pipe, KEY, 5, keypoints=True)(
            image=s["image"], bboxes=in_format(np.array(case["boxes"], np.float64).reshape(-1, 4), case["fmt"],
                                               case["h"], case["w"]),
            ids=np.arange(n), keypoints=s["keypoints"].reshape(-1, 3).astype(np.float64),
            kp_ids=np.repeat(np.arange(n), 2)), s
    except ValueError as e:
        return e, s


@settings(max_examples=100, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=cases())
def test_the_worker_gives_what_one_compose_gives_whatever_the_boxes(tmp_path, case):
    pipe = pipeline(case)
    got, (want, s) = run_worker(case, tmp_path, pipe), run_oracle(case, pipe)
    if isinstance(want, Exception) or isinstance(got, Exception):
        assert isinstance(want, Exception) and isinstance(got, Exception), f"one refused, the other not: {got!r} vs {want!r}"
        return
    where = f"{case}"
    image = got["image"][0]
    assert np.array_equal(image, want["image"]), where
    kept = np.asarray(want["ids"], np.int64)
    assert got["labels"][0].tolist() == s["labels"][kept].tolist(), where
    oh, ow = image.shape[:2]
    assert_boxes(got["boxes"][0], np.asarray(want["bboxes"], np.float64).reshape(-1, 4), case["fmt"], oh, ow, where)
    points = got["keypoints"][0]
    assert points.dtype == np.float32 and points.shape == (len(kept), 2, 3), where
    want_points = np.asarray(want["keypoints"], np.float64).reshape(-1, 2, 3)[kept]
    assert np.abs(points - want_points).max(initial=0) <= BOX_ULPS * scale("pascal_voc", oh, ow), where
    for name, value in s.items():
        if name in case["extra"]:
            sent = got[name][0]
            if isinstance(value, (str, bytes)):
                assert sent == value, (name, where)
            else:
                assert np.asarray(sent).dtype == np.asarray(value).dtype and np.array_equal(sent, value), (name, where)
