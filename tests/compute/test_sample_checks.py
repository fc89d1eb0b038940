"""Targets as a detection user's own ``kind: python`` dataset gives them (issue 38, cases 1, 6, 10).

- Integer (and float64) boxes and keypoints leave the worker as float32, equal to one plain
  albumentations Compose in every bbox format (before: cast back to the input dtype, truncated
  in pixel formats and all zeros in yolo and albumentations).
- A bad box or keypoint array (count, shape, NaN, outside the image, inverted) is a SampleError
  naming dataset, index, field, what was expected and what came, in pixels, with a pipeline and
  without, in a batch of one too; ``on_error: skip`` leaves out that sample alone (before: served
  as it was without a pipeline; with one, albumentations' ValueError in normalised coordinates
  ended the stream, skip or not).
- RandomCropNearBBox crops near the box in the sample's ``cropping_bbox`` field, as one Compose does.
"""

from __future__ import annotations

import json
import pathlib
import sys

import albumentations as A
import numpy as np
import pytest

import batchd
from batchd.server.compute import allowlist
from batchd.server.config import PipelineLimits
from inworker import InWorker
from targets_oracle import FORMATS, assert_boxes, in_format, one_compose

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
KEY = np.array([38, 6], np.uint64)
BOXES = [[0, 1, 6, 8], [2, 2, 9, 9]]  # in a 10 x 10 image


@pytest.fixture(scope="module")
def testdata():
    sys.path.insert(0, str(PYDATA))  # the worker runs in this process: it imports as the server would
    import batchd_testdata

    yield batchd_testdata
    sys.path.remove(str(PYDATA))


def boxes(**args) -> dict:
    return {"kind": "python", "factory": "batchd_testdata:Boxes", "args": args}


def resize(fmt: str) -> A.Compose:
    return A.Compose([A.Resize(12, 16)], bbox_params=A.BboxParams(format=fmt, label_fields=["labels"]),
                     keypoint_params=A.KeypointParams(format="xy", remove_invisible=False))


@pytest.mark.parametrize("dtype", ["int64", "int32", "uint16", "float64"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_boxes_and_keypoints_of_any_dtype_leave_as_float32_equal_to_one_compose(testdata, tmp_path, fmt, dtype):
    with InWorker({"b": boxes(dtype=dtype)}, tmp_path) as w:
        _, got = w.batch("b", [0, 1], resize(fmt), key=KEY)
        _, raw = w.batch("b", [0])
    s = testdata.Boxes(dtype=dtype)[0]
    xyxy = np.array(BOXES, np.float64)
    want = one_compose(resize(fmt), KEY, 0, keypoints=True)(
        image=s["image"], bboxes=in_format(xyxy, fmt, 10, 10), ids=np.arange(2),
        keypoints=s["keypoints"].reshape(-1, 3).astype(np.float64), kp_ids=np.repeat(np.arange(2), 2))
    assert_boxes(got["boxes"][0], np.asarray(want["bboxes"]), fmt, 12, 16, f"{fmt}, {dtype} boxes")
    fractional = np.asarray(want["bboxes"]) % 1
    assert (fractional > 0).sum() >= 4, "the expected boxes should have fractions (truncation would show)"
    keypoints = got["keypoints"][0]
    assert keypoints.dtype == np.float32 and keypoints.shape == (2, 2, 3)
    assert np.allclose(keypoints.reshape(-1, 3), want["keypoints"], rtol=0, atol=1e-5), (keypoints, want["keypoints"])
    assert raw["boxes"][0].dtype == np.float32 and raw["boxes"][0].tolist() == BOXES  # no pipeline: float32 too
    assert raw["keypoints"][0].dtype == np.float32


FLIP = A.Compose([A.HorizontalFlip(p=0.5)], bbox_params=A.BboxParams(format="coco", label_fields=["labels"]))
NAN = float("nan")
BAD = {  # field, value at sample 3, what the SampleError says
    "count": ("boxes", [[0, 1, 6, 8], [2, 2, 9, 9], [1, 1, 3, 3]],
              "per-object fields disagree on the number of objects: 'boxes' has 3 ([3, 4]), 'labels' has 2"),
    "labels": ("labels", [0], "per-object fields disagree on the number of objects: 'boxes' has 2 ([2, 4]), 'labels' has 1"),
    "shape": ("boxes", [[0, 1, 6], [2, 2, 9]], "field 'boxes': expected a numeric array [N, 4] (x_min, y_min, x_max, "
                                              "y_max in pixels), got float32 [2, 3]"),
    "nan": ("boxes", [[0, 1, 6, 8], [2, NAN, 9, 9]], "field 'boxes': box 1 is [2, nan, 9, 9]: expected finite pixel "
                                                     "coordinates"),
    "outside": ("boxes", [[0, 1, 6, 8], [2, 2, 12.5, 9]], "field 'boxes': box 1 is [2, 2, 12.5, 9], 2.5 px outside the "
                                                          "image of 10x10 pixels: expected 0 <= x <= 10 and 0 <= y <= 10"),
    "inverted": ("boxes", [[0, 1, 6, 8], [9, 2, 2, 9]], "field 'boxes': box 1 is [9, 2, 2, 9]: expected x_min < x_max "
                                                        "and y_min < y_max"),
    "keypoint nan": ("keypoints", [[[0, 1, 2], [NAN, 8, 2]], [[2, 2, 2], [9, 9, 2]]],
                     "field 'keypoints': point 1 of object 0 is (nan, 8): expected finite pixel coordinates"),
    "keypoint columns": ("keypoints", [[[0], [1]], [[2], [2]]], "field 'keypoints': expected a numeric array [N, K, "
                                                                "D] with D >= 2 (x, y in pixels first), got float32 [2, 2, 1]"),
    "keypoint rank": ("keypoints", [[0, 1], [2, 2]], "field 'keypoints' is float32 [2, 2]: expected float32 [-1, 2, 3]"),
}


@pytest.mark.parametrize("pipeline", [None, FLIP], ids=["no_pipeline", "flip"])
@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_box_or_keypoint_array_is_a_sample_error_in_pixels_and_skip_leaves_out_that_sample(
        testdata, tmp_path, case, pipeline):
    field, bad, says = BAD[case]
    with InWorker({"b": {**boxes(dtype="float32", bad_at=3, bad_field=field, bad=bad), "on_error": "skip"}},
                  tmp_path) as w:
        for indices in ([3], [1, 3, 5]):
            with pytest.raises(batchd.SampleError) as e:
                w.batch("b", indices, pipeline)
            assert e.value.dataset == "b" and e.value.index == 3 and says in e.value.reason, str(e.value)
        done, got = w.batch("b", [1, 3, 5], pipeline, skip=True)
    assert [s[0] for s in done.skipped] == [3] and got["index"].tolist() == [1, 5]


@pytest.mark.parametrize("clip", [False, True])
def test_a_box_just_outside_the_image_is_refused_only_where_albumentations_would_refuse_it(testdata, tmp_path, clip):
    """Half a pixel outside: served as it is without a pipeline, clipped by a pipeline whose
    bbox_params clip, and a SampleError saying so under one that does not clip (albumentations
    would raise in normalised coordinates)."""
    pipe = A.Compose([A.HorizontalFlip(p=1)], bbox_params=A.BboxParams(format="pascal_voc", clip=clip))
    edge = [[0, 1, 6, 8], [2, 2, 10.5, 9]]
    with InWorker({"b": boxes(dtype="float32", bad_at=3, bad=edge)}, tmp_path) as w:
        _, raw = w.batch("b", [3])
        assert raw["boxes"][0].tolist() == edge
        if clip:
            _, got = w.batch("b", [3], pipe)
            assert np.allclose(got["boxes"][0], [[4, 1, 10, 8], [0, 2, 8, 9]], rtol=0, atol=1e-5)  # clipped, flipped
        else:
            with pytest.raises(batchd.SampleError, match=r"box 1 is \[2, 2, 10.5, 9\], outside the image of 10x10 "
                                                         r"pixels, which the pipeline's albumentations refuses.*clip=True"):
                w.batch("b", [3], pipe)


def test_the_box_safe_crops_are_allowed_and_random_crop_near_bbox_crops_near_the_samples_cropping_bbox(testdata,
                                                                                                       tmp_path):
    """The four box-safe crops pass the client allowlist; RandomCropNearBBox reads the sample's
    ``cropping_bbox`` field (pixels) as one Compose reads the key, which passes through as it is."""
    for t in (A.RandomSizedBBoxSafeCrop(8, 8), A.BBoxSafeRandomCrop(), A.AtLeastOneBBoxRandomCrop(8, 8),
              A.RandomCropNearBBox(max_part_shift=(0.1, 0.5))):
        allowlist.check(json.loads(json.dumps(A.to_dict(A.Compose([t])))), PipelineLimits())
    pipe = A.Compose([A.RandomCropNearBBox(max_part_shift=(0.1, 0.5))],
                     bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"]))
    with InWorker({"g": boxes(n=12, size=40, boxes=[[4, 6, 20, 30], [22, 8, 36, 18]], guide=True)}, tmp_path) as w:
        _, got = w.batch("g", list(range(12)), pipe, key=KEY, positions=list(range(12)))
    sizes = set()
    for i in range(12):
        s = testdata.Boxes(n=12, size=40, boxes=[[4, 6, 20, 30], [22, 8, 36, 18]], guide=True)[i]
        one = one_compose(pipe, KEY, i)
        want = one(image=s["image"], bboxes=s["boxes"].astype(np.float64), ids=np.arange(2),
                   cropping_bbox=s["cropping_bbox"].astype(int).tolist())
        assert np.array_equal(got["image"][i], want["image"]), i
        assert_boxes(got["boxes"][i], np.asarray(want["bboxes"]), "pascal_voc", *want["image"].shape[:2], f"sample {i}")
        assert np.array_equal(got["cropping_bbox"][i], s["cropping_bbox"])
        sizes.add(want["image"].shape)
    assert len(sizes) > 3, "the crops should differ from sample to sample"


def test_a_region_decodes_targets_are_checked_on_the_full_frame():
    """A region decode's image is only its window (server/compute/region.py): ``size`` gives the
    full frame the targets are in. A box outside the window but inside the frame passes (as float32);
    one outside the frame is refused naming the frame's size, as for a full decode."""
    from batchd.server.compute.sample_checks import check_targets

    window = np.zeros((6, 5, 3), np.uint8)  # a 5x6 rectangle of a 100x80 frame
    where = {"dataset": "d", "index": 4, "source": "4.jpg", "per_object": lambda f: f in ("boxes", "labels")}
    sample = {"image": window, "boxes": np.array([[0, 0, 100, 80], [40, 10, 60, 70]], np.int64),
              "labels": np.array([1, 2])}
    checked = check_targets(sample, **where, inside=True, size=(80, 100))
    assert checked["boxes"].dtype == np.float32 and checked["boxes"].tolist() == sample["boxes"].tolist()
    with pytest.raises(batchd.SampleError, match=r"outside the image of 5x6 pixels"):
        check_targets(sample, **where)  # (the window's own size: what a check without size= would refuse)
    sample["boxes"][1, 2] = 103
    with pytest.raises(batchd.SampleError, match=r"box 1 is \[40, 10, 103, 70\], 3 px outside the image of 100x80"):
        check_targets(sample, **where, size=(80, 100))
