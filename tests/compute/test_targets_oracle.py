"""The worker's targets against one plain albumentations Compose, over the whole configuration space.

The oracle is albumentations itself: for every case, the user's Compose is rebuilt here as ONE
plain ``A.Compose`` (the same transforms and params; label fields carrying each box's and each
keypoint's object), attached to the sample's own random stream (``SampleRandom``, re-keyed to
``(seed, epoch, position)``) and called on the sample's targets, the boxes given in the
pipeline's format by albumentations' own converters. The worker (server/compute/worker.py, in this
process, real shared-memory slots and a real shared cache) must give the same image, mask, boxes,
keypoints and surviving objects, bit for bit, over

- every allowlisted transform that moves targets (``A.DualTransform``, found in the allowlist,
  not listed by hand);
- bbox formats pascal_voc, coco, yolo and albumentations, with keypoints;
- no prefix, and a cacheable prefix (LongestMaxSize, PadIfNeeded, CenterCrop: it resizes, pads
  and cuts objects, so the boxes it leaves depend on the filters); and a ToGray prefix, which
  moves no box (``test_a_to_gray_prefix_with_boxes_equals_one_compose``);
- ``check_each_transform`` true and false (false: albumentations filters only at the end);
- no cache, and a cache (a miss, then a hit).

What the worker adds to one Compose, and so the oracle too (docs/targets.md): ``min_width`` and
``min_height`` of at least 0.01 px (a box cut to zero width is gone), and the masks and other
per-object fields of dropped boxes are dropped with them (albumentations keeps every mask).
"""

from __future__ import annotations

import json

import albumentations as A
import cv2
import numpy as np
import pytest
from albumentations.core import bbox_utils

from batchd.sampler import sample_key
from batchd.server.compute import allowlist, prefix as prefixes
from batchd.server.compute.pipeline import SampleRandom
from batchd.server.config import PipelineLimits
from batchd.server.data.cache import SharedCache
from inworker import InWorker
from test_targets import rectangles, samples  # noqa: F401
from test_targets import testdata  # noqa: F401  (the fixture: tests/pydata importable here)

pytestmark = pytest.mark.timeout(600)

N, SIZE, SEED, EPOCH = 14, 48, 5, 3
MIN_SIDE = 0.01  # docs/targets.md: the worker's BboxParams min_width / min_height are at least this
FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")
CONSTANT = {"border_mode": cv2.BORDER_CONSTANT, "fill": 0, "fill_mask": 0}
PREFIX = (A.LongestMaxSize(max_size=56), A.PadIfNeeded(60, 60, **CONSTANT), A.CenterCrop(44, 44))

# every allowlisted transform that moves targets, by construction
DUAL = sorted(name for name in allowlist.ALLOWED - allowlist.COMPOSITIONS if issubclass(getattr(A, name), A.DualTransform))
# arguments for those that need them (or whose defaults are for large images); others: their defaults
ARGS = {
    "CenterCrop": {"height": 36, "width": 30}, "RandomCrop": {"height": 32, "width": 36},
    "RandomResizedCrop": {"size": (40, 40), "scale": (0.3, 1.0)},
    "RandomSizedCrop": {"min_max_height": (20, 40), "size": (36, 36)}, "Resize": {"height": 52, "width": 40},
    "LongestMaxSize": {"max_size": 40}, "SmallestMaxSize": {"max_size": 56},
    "PadIfNeeded": {"min_height": 56, "min_width": 64, **CONSTANT},
    "Affine": {"scale": (0.5, 1.2), "rotate": (-30, 30), "translate_percent": (-0.2, 0.2), "p": 0.9},
    "CoarseDropout": {"num_holes_range": (2, 6), "hole_height_range": (0.1, 0.4), "hole_width_range": (0.1, 0.4),
                      "p": 0.9},
    "GridDropout": {"ratio": 0.5, "p": 0.9},
}


def transform(name: str):
    return getattr(A, name)(**ARGS.get(name, {}))


def user_pipeline(name: str, fmt: str, prefix: bool, each: bool) -> A.Compose:
    """What a client sends: [prefix,] the transform, under its bbox and keypoint params."""
    t = transform(name)
    assert {"bboxes", "keypoints", "mask", "masks"} <= set(t.targets), f"{name} does not move every target"
    return A.Compose([*(PREFIX if prefix else ()), t],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"], min_visibility=0.3,
                                              check_each_transform=each),
                     keypoint_params=A.KeypointParams(format="xy", remove_invisible=False, check_each_transform=each))


def plain_compose(pipe: A.Compose) -> A.Compose:
    """The oracle: one albumentations Compose of ``pipe``'s transforms and params, with label
    fields ``ids`` (each box's object) and ``kp_ids`` (each keypoint's), and min_width /
    min_height raised to MIN_SIDE (docs/targets.md)."""
    spec = A.to_dict(pipe)["transform"]
    bbox = {**spec["bbox_params"], "label_fields": ["ids"], "min_width": max(spec["bbox_params"]["min_width"], MIN_SIDE),
            "min_height": max(spec["bbox_params"]["min_height"], MIN_SIDE)}
    fresh = A.from_dict(A.to_dict(pipe))
    return A.Compose(fresh.transforms, bbox_params=A.BboxParams(**bbox),
                     keypoint_params=A.KeypointParams(**{**spec["keypoint_params"], "label_fields": ["kp_ids"]}))


def in_format(boxes: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """xyxy pixel boxes in ``fmt``, by albumentations' own converters."""
    if fmt == "pascal_voc" or not len(boxes):
        return boxes
    normalized = bbox_utils.convert_bboxes_to_albumentations(boxes, "pascal_voc", shape)
    return normalized if fmt == "albumentations" else bbox_utils.convert_bboxes_from_albumentations(normalized, fmt, shape)


def expected(pipe: A.Compose, fmt: str, s: dict, position: int) -> dict:
    """What ONE albumentations Compose gives for sample ``s`` under its stream; None if it drops
    keypoints (ElasticTransform, GridDistortion and OpticalDistortion drop points they move out of
    the image whatever ``remove_invisible`` says; batchd keeps K points per object)."""
    oracle = plain_compose(pipe)
    rnd = SampleRandom()
    rnd.attach(oracle)
    rnd.start(sample_key(seed=SEED, epoch=EPOCH), position)
    masks = {"masks": list(s["masks"])} if len(s["masks"]) else {}  # albumentations cannot stack 0 masks
    out = oracle(image=s["image"], mask=s["mask"], bboxes=in_format(s["boxes"], fmt, s["image"].shape[:2]),
                 ids=s["ids"], keypoints=s["keypoints"].reshape(-1, 3), kp_ids=np.repeat(s["ids"], 4), **masks)
    kept = np.searchsorted(s["ids"], np.asarray(out["ids"], np.int64))
    want = {"image": out["image"], "mask": out["mask"], "ids": np.asarray(out["ids"], np.int64),
            "boxes": np.asarray(out["bboxes"], np.float32).reshape(-1, 4), "labels": s["labels"][kept]}
    h, w = out["image"].shape[:2]
    want["masks"] = np.stack(out["masks"])[kept] if len(s["masks"]) else np.zeros((0, h, w), np.uint8)
    if len(out["keypoints"]) != 4 * len(s["ids"]):
        return None  # albumentations dropped keypoints (remove_invisible=False or not): the worker refuses
    want["keypoints"] = np.asarray(out["keypoints"], np.float32).reshape(len(s["ids"]), 4, 3)[kept]
    return want


@pytest.fixture(scope="module")
def workers(testdata, tmp_path_factory):
    """(a worker without a cache, a worker with one, the cache)."""
    tmp = tmp_path_factory.mktemp("oracle")
    prefix = f"batchd-test-oracle-{tmp.name[-6:]}-"
    cache = SharedCache.create(f"{prefix}cache", memory_bytes=64 << 20, datasets=["rect"], workers=1, build="b")
    try:
        with InWorker({"rect": rectangles(N, SIZE)}, tmp) as plain, \
                InWorker({"rect": rectangles(N, SIZE)}, tmp, cache_prefix=prefix) as cached:
            assert cached.worker.cache is not None
            yield plain, cached, cache
    finally:
        cache.close()


def assert_equals_one_compose(worker: InWorker, pipe: A.Compose, fmt: str, ds, what: str) -> None:
    """The worker's batch of every sample equals the oracle's samples; where the oracle drops
    keypoints, the worker refuses the batch with an error saying so, and gives the others."""
    indices = list(range(N))
    wants = {i: expected(pipe, fmt, ds[i], 3 * i + 1) for i in indices}
    if any(w is None for w in wants.values()):
        with pytest.raises(ValueError, match="the pipeline dropped keypoints"):
            worker.batch("rect", indices, pipe, seed=SEED, epoch=EPOCH, positions=[3 * i + 1 for i in indices])
        indices = [i for i in indices if wants[i] is not None]
    _, got = worker.batch("rect", indices, pipe, seed=SEED, epoch=EPOCH, positions=[3 * i + 1 for i in indices])
    for j, i in enumerate(indices):
        want = wants[i]
        where = f"{what}, sample {i}"
        assert np.array_equal(got["image"][j] if isinstance(got["image"], list) else got["image"][j], want["image"]), \
            f"{where}: image"
        mask = got["mask"][j]
        assert np.array_equal(mask, want["mask"]), f"{where}: mask"
        assert got["ids"][j].tolist() == want["ids"].tolist(), f"{where}: other objects survive ({got['ids'][j]} vs " \
                                                                f"{want['ids']})"
        assert np.array_equal(got["boxes"][j], want["boxes"]), f"{where}: boxes {got['boxes'][j]} vs {want['boxes']}"
        assert np.array_equal(got["labels"][j], want["labels"]), f"{where}: labels"
        assert np.array_equal(got["masks"][j], want["masks"]), f"{where}: masks"
        assert np.array_equal(got["keypoints"][j], want["keypoints"]), f"{where}: keypoints"


@pytest.mark.parametrize("each", [True, False], ids=["check_each", "check_at_end"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix", "prefix"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", DUAL)
def test_the_worker_equals_one_albumentations_compose(testdata, workers, name, fmt, prefix, each):
    plain, cached, cache = workers
    pipe = user_pipeline(name, fmt, prefix, each)
    allowlist.check(json.loads(json.dumps(A.to_dict(pipe))), PipelineLimits())  # a client may send it
    ds = testdata.Rectangles(N, SIZE)
    what = f"{name} {fmt} {'with' if prefix else 'without'} prefix, check_each_transform={each}"
    assert_equals_one_compose(plain, pipe, fmt, ds, what + ", no cache")
    before = cache.stats()["rect"]
    for attempt in ("miss", "hit"):
        assert_equals_one_compose(cached, pipe, fmt, ds, f"{what}, cache {attempt}")
    after = cache.stats()["rect"]
    assert after["hits"] > before["hits"], "the second pass should come from the cache"


def test_every_dual_transform_is_covered():
    """A transform added to the allowlist is in the grid above by construction; this says which."""
    assert {"Affine", "RandomCrop", "HorizontalFlip", "PadIfNeeded", "LongestMaxSize", "CoarseDropout"} <= set(DUAL)
    assert not set(ARGS) - set(DUAL), "arguments for a transform that is not an allowlisted dual transform"


@pytest.mark.parametrize("params", [
    {"clip": True}, {"min_area": 40.0}, {"filter_invalid_bboxes": True, "clip": True}, {"max_accept_ratio": 3.0},
    {"min_visibility": 0.0}, {"min_width": 6.0, "min_height": 6.0},
], ids=lambda p: ",".join(p))
@pytest.mark.parametrize("fmt", FORMATS)
def test_other_bbox_params_equal_one_compose_too(testdata, workers, fmt, params):
    """The processors' other filters (clipping, min_area, invalid boxes, aspect ratio, min sizes),
    under the prefix and an Affine that moves boxes out of the image, cache off, miss and hit."""
    plain, cached, _ = workers
    pipe = A.Compose([*PREFIX, transform("Affine")],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"], **{"min_visibility": 0.3, **params}),
                     keypoint_params=A.KeypointParams(format="xy", remove_invisible=False))
    allowlist.check(json.loads(json.dumps(A.to_dict(pipe))), PipelineLimits())
    ds = testdata.Rectangles(N, SIZE)
    for worker, what in ((plain, "no cache"), (cached, "cache miss"), (cached, "cache hit")):
        assert_equals_one_compose(worker, pipe, fmt, ds, f"{fmt} {params}, {what}")


@pytest.mark.parametrize("each", [True, False], ids=["check_each", "check_at_end"])
@pytest.mark.parametrize("name", ["Affine", "HorizontalFlip"])
def test_a_to_gray_prefix_with_boxes_equals_one_compose(testdata, workers, name, each):
    """A prefix that changes only the pixels (ToGray, p=1: cacheable, server/compute/prefix.py)
    before a dual transform, boxes in format coco: the same as one plain Compose, cache off, miss
    and hit (on the code before the two-stage pipeline the prefix converted the boxes as well:
    "x_max is less than or equal to x_min")."""
    plain, cached, cache = workers
    pipe = A.Compose([A.ToGray(p=1), transform(name)],
                     bbox_params=A.BboxParams(format="coco", label_fields=["labels"], min_visibility=0.3,
                                              check_each_transform=each),
                     keypoint_params=A.KeypointParams(format="xy", remove_invisible=False, check_each_transform=each))
    assert prefixes.prefix_length(pipe) == 1, "ToGray(p=1) should be the pipeline's cacheable prefix"
    allowlist.check(json.loads(json.dumps(A.to_dict(pipe))), PipelineLimits())
    ds = testdata.Rectangles(N, SIZE)
    what = f"ToGray + {name}, coco, check_each_transform={each}"
    assert_equals_one_compose(plain, pipe, "coco", ds, f"{what}, no cache")
    before = cache.stats()["rect"]
    for attempt in ("miss", "hit"):
        assert_equals_one_compose(cached, pipe, "coco", ds, f"{what}, cache {attempt}")
    assert cache.stats()["rect"]["hits"] > before["hits"], "the second pass should come from the cache"
