"""The worker's targets against one plain albumentations Compose, over the whole configuration space.

The data are raw label files as an annotation tool writes them: a COCO JSON whose boxes and
polygons are in fractional pixels, and PNG images of noise of several sizes, served as ``kind:
coco`` with masks. The oracle shares nothing with the code under test (tests/targets_oracle.py):
it reads the files with pycocotools and Pillow, puts the raw COCO xywh boxes in each bbox
format by hand, and runs ONE plain albumentations ``Compose`` of the user's transforms on a
generator of its own (numpy's Philox jumped to the sample's position). The worker (server/compute/
worker.py, in this process, real shared-memory slots and a real shared cache) must give the same
image, masks and surviving objects exactly, and the same boxes within ``BOX_ULPS`` float32 ulps
at the image's size, over

- every allowlisted transform that moves targets (``A.DualTransform``, found in the allowlist,
  not listed by hand; RandomCropNearBBox, which reads a field COCO samples lack, is
  ``test_random_crop_near_bbox_equals_one_compose``);
- bbox formats pascal_voc, coco, yolo and albumentations;
- no prefix, and a cacheable prefix (LongestMaxSize, PadIfNeeded, CenterCrop: it resizes, pads
  and cuts objects, so the boxes it leaves depend on the filters); and a ToGray prefix, which
  moves no box;
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
from PIL import Image
from pycocotools.coco import COCO

from batchd.server.compute import allowlist, prefix as prefixes
from batchd.server.config import PipelineLimits
from batchd.server.data.cache import SharedCache
from helpers import write_png
from inworker import InWorker
from targets_oracle import BOX_ULPS, FORMATS, assert_boxes, in_format, one_compose

pytestmark = pytest.mark.timeout(900)

N = 12
KEY = np.array([0x5EED_0038, 0x0BAD_B0C5], np.uint64)  # the tasks' random key, chosen here
CONSTANT = {"border_mode": cv2.BORDER_CONSTANT, "fill": 0, "fill_mask": 0}
PREFIX = (A.LongestMaxSize(max_size=56), A.PadIfNeeded(60, 60, **CONSTANT), A.CenterCrop(44, 44))

# every allowlisted transform that moves targets, by construction
DUAL = sorted(name for name in allowlist.ALLOWED - allowlist.COMPOSITIONS if issubclass(getattr(A, name), A.DualTransform))
GUIDED = {"RandomCropNearBBox"}  # crops near the box of a sample field (cropping_bbox) COCO samples lack
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
    "RandomSizedBBoxSafeCrop": {"height": 30, "width": 34, "erosion_rate": 0.2},
    "AtLeastOneBBoxRandomCrop": {"height": 30, "width": 26, "erosion_factor": 0.2},
    "BBoxSafeRandomCrop": {"erosion_rate": 0.1}, "RandomCropNearBBox": {"max_part_shift": (0.1, 0.4)},
}


def transform(name: str):
    return getattr(A, name)(**ARGS.get(name, {}))


def write_coco(root, rng: np.random.Generator, n: int = N) -> tuple:
    """``n`` PNG images of noise, 40-56 x 44-60 pixels, and a COCO JSON of 0-4 objects each (image
    0: none), boxes and rectangle polygons in fractional pixels (32nds), category ids distinct per image
    (so the surviving objects can be told by their labels). Returns (JSON path, images folder)."""
    images, annotations = [], []
    for k in range(n):
        h, w = int(rng.integers(40, 57)), int(rng.integers(44, 61))
        write_png(root / "images" / f"{k:03d}.png", rng.integers(0, 256, (h, w, 3), np.uint8))
        images.append({"id": 100 + 7 * k, "file_name": f"{k:03d}.png", "height": h, "width": w})
        count = 0 if k == 0 else int(rng.integers(1, 5))
        for c in rng.permutation(8)[:count]:
            # sizes in sixteenths, corners at odd 32nds: no edge on a whole or half pixel, where the
            # transforms that rasterize boxes (ElasticTransform...) would turn float rounding into a pixel
            bw, bh = rng.integers(64, 8 * w) / 16, rng.integers(64, 8 * h) / 16
            x, y = (2 * rng.integers(0, 16 * (w - bw)) + 1) / 32, (2 * rng.integers(0, 16 * (h - bh)) + 1) / 32
            box = [float(v) for v in (x, y, bw, bh)]
            annotations.append({"id": len(annotations) + 1, "image_id": 100 + 7 * k, "category_id": int(c) + 1,
                                "bbox": box, "area": round(bw * bh, 3), "iscrowd": 0,
                                "segmentation": [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]})
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": c, "name": f"c{c}"} for c in range(1, 9)]}))
    return path, root / "images"


def oracle_samples(json_path, images) -> list[dict]:
    """Every sample as pycocotools and Pillow read it, in image id order: image, raw xywh boxes
    (float64), labels and masks (``annToMask``)."""
    coco = COCO(str(json_path))
    out = []
    for img_id in sorted(coco.imgs):
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        with Image.open(images / coco.imgs[img_id]["file_name"]) as im:
            image = np.asarray(im.convert("RGB"))
        h, w = image.shape[:2]
        out.append({"image": image, "xywh": np.array([a["bbox"] for a in anns], np.float64).reshape(-1, 4),
                    "labels": np.array([a["category_id"] for a in anns], np.int64),
                    "masks": np.array([coco.annToMask(a) for a in anns], np.uint8).reshape(-1, h, w)})
    return out


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("oracle")
    json_path, images = write_coco(root, np.random.default_rng(38))
    return {"kind": "coco", "images": str(images), "annotations": str(json_path), "masks": True}, \
        oracle_samples(json_path, images)


@pytest.fixture(scope="module")
def workers(data, tmp_path_factory):
    """(a worker without a cache, a worker with one, the cache). The cached worker's dataset has
    ``reduced_decode: false``: with it on, a pipeline starting with a random crop is never cached
    (its decode depends on the draw, server/compute/region.py), and the grid's crops should be."""
    tmp = tmp_path_factory.mktemp("oracle-workers")
    prefix = f"batchd-test-oracle-{tmp.name[-6:]}-"
    cache = SharedCache.create(f"{prefix}cache", memory_bytes=64 << 20, datasets=["det"], workers=1, build="b")
    full = {**data[0], "reduced_decode": False}
    try:
        with InWorker({"det": data[0]}, tmp) as plain, InWorker({"det": full}, tmp, cache_prefix=prefix) as cached:
            assert cached.worker.cache is not None
            yield plain, cached, cache
    finally:
        cache.close()


def user_pipeline(name: str, fmt: str, prefix: bool, each: bool) -> A.Compose:
    """What a client sends: [prefix,] the transform, under its bbox params."""
    t = transform(name)
    assert {"bboxes", "mask", "masks"} <= set(t.targets), f"{name} does not move every target"
    return A.Compose([*(PREFIX if prefix else ()), t],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"], min_visibility=0.3,
                                              check_each_transform=each))


def expected(pipe: A.Compose, fmt: str, s: dict, position: int) -> dict:
    """What ONE albumentations Compose gives for sample ``s`` under its stream."""
    h, w = s["image"].shape[:2]
    n = len(s["labels"])
    x, y, bw, bh = s["xywh"].T
    boxes = s["xywh"] if fmt == "coco" else in_format(np.stack([x, y, x + bw, y + bh], 1), fmt, h, w)
    masks = {"masks": list(s["masks"])} if n else {}  # albumentations cannot stack 0 masks
    out = one_compose(pipe, KEY, position)(image=s["image"], bboxes=boxes, ids=np.arange(n), **masks)
    kept = np.asarray(out["ids"], np.int64)
    oh, ow = out["image"].shape[:2]
    return {"image": out["image"], "boxes": np.asarray(out["bboxes"], np.float64).reshape(-1, 4),
            "labels": s["labels"][kept], "masks": np.stack(out["masks"])[kept] if n else np.zeros((0, oh, ow), np.uint8)}


def assert_equals_one_compose(worker: InWorker, pipe: A.Compose, fmt: str, samples: list[dict], what: str,
                              indices=range(N), positions=None) -> float:
    """The worker's batch equals the oracle's samples; returns the largest box difference in ulps."""
    indices = list(indices)
    positions = [3 * i + 1 for i in indices] if positions is None else list(positions)
    _, got = worker.batch("det", indices, pipe, key=KEY, positions=positions)
    worst = 0.0
    for j, (i, position) in enumerate(zip(indices, positions)):
        want, where = expected(pipe, fmt, samples[i], position), f"{what}, sample {i}"
        image = got["image"][j]
        assert np.array_equal(image, want["image"]), f"{where}: image"
        assert got["labels"][j].tolist() == want["labels"].tolist(), \
            f"{where}: other objects survive ({got['labels'][j]} vs {want['labels']})"
        assert np.array_equal(got["masks"][j], want["masks"]), f"{where}: masks"
        worst = max(worst, assert_boxes(got["boxes"][j], want["boxes"], fmt, *image.shape[:2], where))
    return worst


@pytest.mark.parametrize("each", [True, False], ids=["check_each", "check_at_end"])
@pytest.mark.parametrize("prefix", [False, True], ids=["no_prefix", "prefix"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("name", sorted(set(DUAL) - GUIDED))
def test_the_worker_equals_one_albumentations_compose(data, workers, name, fmt, prefix, each):
    plain, cached, cache = workers
    pipe = user_pipeline(name, fmt, prefix, each)
    allowlist.check(json.loads(json.dumps(A.to_dict(pipe))), PipelineLimits())  # a client may send it
    what = f"{name} {fmt} {'with' if prefix else 'without'} prefix, check_each_transform={each}"
    assert_equals_one_compose(plain, pipe, fmt, data[1], what + ", no cache")
    before = cache.stats()["det"]
    for attempt in ("miss", "hit"):
        assert_equals_one_compose(cached, pipe, fmt, data[1], f"{what}, cache {attempt}")
    assert cache.stats()["det"]["hits"] > before["hits"], "the second pass should come from the cache"


def test_every_dual_transform_is_covered():
    """A transform added to the allowlist is in the grid above by construction; this says which."""
    assert {"Affine", "RandomCrop", "HorizontalFlip", "PadIfNeeded", "LongestMaxSize", "CoarseDropout",
            "RandomSizedBBoxSafeCrop", "BBoxSafeRandomCrop", "AtLeastOneBBoxRandomCrop"} <= set(DUAL) - GUIDED
    assert GUIDED <= set(DUAL) and not set(ARGS) - set(DUAL), "arguments for a transform that is not in the grid"


@pytest.mark.parametrize("params", [
    {"clip": True}, {"min_area": 40.0}, {"filter_invalid_bboxes": True, "clip": True}, {"max_accept_ratio": 3.0},
    {"min_visibility": 0.0}, {"min_width": 6.0, "min_height": 6.0},
], ids=lambda p: ",".join(p))
@pytest.mark.parametrize("fmt", FORMATS)
def test_other_bbox_params_equal_one_compose_too(data, workers, fmt, params):
    """The processors' other filters (clipping, min_area, invalid boxes, aspect ratio, min sizes),
    under the prefix and an Affine that moves boxes out of the image, cache off, miss and hit."""
    plain, cached, _ = workers
    pipe = A.Compose([*PREFIX, transform("Affine")],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"], **{"min_visibility": 0.3, **params}))
    allowlist.check(json.loads(json.dumps(A.to_dict(pipe))), PipelineLimits())
    for worker, what in ((plain, "no cache"), (cached, "cache miss"), (cached, "cache hit")):
        assert_equals_one_compose(worker, pipe, fmt, data[1], f"{fmt} {params}, {what}")


@pytest.mark.parametrize("each", [True, False], ids=["check_each", "check_at_end"])
@pytest.mark.parametrize("name", ["Affine", "HorizontalFlip"])
def test_a_to_gray_prefix_with_boxes_equals_one_compose(data, workers, name, each):
    """A prefix that changes only the pixels (ToGray, p=1: cacheable, server/compute/prefix.py)
    before a dual transform, boxes in format coco: the same as one plain Compose, cache off, miss
    and hit."""
    plain, cached, cache = workers
    pipe = A.Compose([A.ToGray(p=1), transform(name)],
                     bbox_params=A.BboxParams(format="coco", label_fields=["labels"], min_visibility=0.3,
                                              check_each_transform=each))
    assert prefixes.prefix_length(pipe) == 1, "ToGray(p=1) should be the pipeline's cacheable prefix"
    what = f"ToGray + {name}, coco, check_each_transform={each}"
    assert_equals_one_compose(plain, pipe, "coco", data[1], f"{what}, no cache")
    before = cache.stats()["det"]
    for attempt in ("miss", "hit"):
        assert_equals_one_compose(cached, pipe, "coco", data[1], f"{what}, cache {attempt}")
    assert cache.stats()["det"]["hits"] > before["hits"], "the second pass should come from the cache"


@pytest.mark.parametrize("fill", [0, "random"])
def test_a_widened_dropout_leaves_the_draws_of_the_transforms_after_it_as_albumentations_does(data, workers, fill):
    """CoarseDropout and GridDropout (widened: 128-bit seeds for a random fill) then a flip and an
    Affine, 192 samples: the flips, the Affine and (with a constant fill, the default) every byte
    are one Compose's; with ``fill="random"`` only the hole's values differ (docs/targets.md). Before,
    the widened seed took 16 more bytes from the stream and 108 of 200 samples flipped otherwise."""
    plain, _, _ = workers
    pipe = A.Compose([A.CoarseDropout(num_holes_range=(1, 3), hole_height_range=(0.1, 0.3),
                                      hole_width_range=(0.1, 0.3), fill=fill, p=0.9),
                      A.GridDropout(ratio=0.3, fill=fill, p=0.5), A.HorizontalFlip(p=0.5),
                      A.Affine(rotate=(-20, 20), p=0.8)],
                     bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"]))
    indices, positions = [k % N for k in range(192)], range(192)
    if fill == 0:
        assert_equals_one_compose(plain, pipe, "pascal_voc", data[1], "dropouts then a flip", indices, positions)
        return
    _, got = plain.batch("det", indices, pipe, key=KEY, positions=list(positions))
    for j, (i, position) in enumerate(zip(indices, positions)):  # boxes and masks move as one Compose moves them
        want = expected(pipe, "pascal_voc", data[1][i], position)
        assert got["labels"][j].tolist() == want["labels"].tolist() and np.array_equal(got["masks"][j], want["masks"])
        assert_boxes(got["boxes"][j], want["boxes"], "pascal_voc", *want["image"].shape[:2], f"sample {i}")


def test_the_box_difference_is_a_few_float32_ulps(data, workers):
    """The figure docs/targets.md states: the worker's boxes (COCO xywh to float32 xyxy at index
    build, then albumentations' converters into the format) against one Compose given the raw
    xywh in the format by hand: at most BOX_ULPS float32 ulps at the image's size, and not all
    equal (so the comparison is not vacuous)."""
    plain, _, _ = workers
    worst = {}
    for fmt in FORMATS:
        pipe = A.Compose([A.Affine(rotate=(-30, 30), scale=(0.7, 1.3), p=1)],
                         bbox_params=A.BboxParams(format=fmt, label_fields=["labels"]))
        worst[fmt] = assert_equals_one_compose(plain, pipe, fmt, data[1], fmt)
    assert max(worst.values()) <= BOX_ULPS and max(worst.values()) > 0, worst
