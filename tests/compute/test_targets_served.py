"""Targets through a real server and ``batchd.RemoteDataLoader``: the randomness statistics and
the decoded-sample cache, as tests/compute/test_targets.py checks them in-process.

- Flips stay independent with boxes and masks present: 1,200 samples of filled rectangles
  (tests/pydata/batchd_testdata.py, ``kind: python``) through a client-sent Compose that carries
  ``bbox_params``, chi-square on the joint frequencies of two flips read from the boxes.
- The cache keeps image and targets together: ``kind: coco`` (generated Fashion-COCO, ``masks:
  true``) under a pipeline whose deterministic prefix (a resize) is cached; two epochs with the
  cache give the bytes of two epochs without it, every field, and the second epoch is all hits.
"""

from __future__ import annotations

import pathlib

import albumentations as A
import pytest

import batchd
from conftest import running_server
from helpers import fields_digest
from test_targets import FLIPS, assert_independent_flips, rectangles, read_flips
from test_targets import testdata  # noqa: F401  (the fixture: tests/pydata importable here)

pytestmark = pytest.mark.timeout(180)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"


def test_flips_stay_independent_with_targets_present_through_a_server(testdata, tmp_path):
    n, side = 1200, 40
    flips = A.Compose(FLIPS.transforms, bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"]))
    with running_server(python_path=[str(PYDATA)], workers=2, cache_dir=tmp_path,
                        datasets={"rect": rectangles(n, side, max_objects=1)}) as server:
        with batchd.RemoteDataLoader(server.address, "rect", batch_size=200, shuffle=True, seed=2024,
                                     transform=flips) as loader:
            served = [{name: value[j].numpy() for name, value in b.items() if name != "name"}
                      for b in loader for j in range(len(b["index"]))]
    assert sorted(int(s["index"]) for s in served) == list(range(n))
    h, v = read_flips(served, testdata.Rectangles(n, side, max_objects=1), side)
    assert_independent_flips(h, v, "with targets, through a server", min_count=900)


CACHED = A.Compose([A.Resize(96, 96), A.HorizontalFlip(p=0.5), A.RandomCrop(64, 64)],
                   bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], min_visibility=0.3))


def two_epochs(server) -> list[str]:
    with batchd.RemoteDataLoader(server.address, "det", batch_size=8, shuffle=True, seed=11, transform=CACHED,
                                 timeout=60) as loader:
        return [fields_digest(b) for _ in range(2) for b in loader]


def test_the_cache_gives_the_same_bytes_with_targets_through_a_server(fashion_coco, tmp_path):
    det = {"det": {"kind": "coco", "images": str(fashion_coco / "images" / "train"),
                   "annotations": str(fashion_coco / "annotations" / "instances_train.json"), "masks": True}}
    with running_server(workers=1, cache_dir=tmp_path, datasets=det) as plain:
        assert plain.loader.cache is None
        want = two_epochs(plain)
    with running_server(workers=2, cache_dir=tmp_path, datasets=det, cache={"memory_bytes": "16MiB"}) as cached:
        got = two_epochs(cached)
        stats = cached.loader.cache.stats()["det"]
    assert len(want) == 16 and want[:8] != want[8:], "the two epochs should differ (other draws)"
    assert got == want, "other bytes with the cache than without"
    assert stats["misses"] == 60 and stats["hits"] == 60, stats  # epoch 2 is all hits: the prefix was cached


@pytest.mark.parametrize("fmt", ["coco", "yolo", "albumentations"])
def test_a_clients_format_under_a_cacheable_prefix_equals_one_compose_through_a_server(fashion_coco, tmp_path, fmt):
    """Table 13's setup through real servers: ``kind: coco`` with masks, boxes asked in ``fmt``
    under a LongestMaxSize + PadIfNeeded prefix, cache off and on (two epochs: misses then hits):
    every batch equals ONE albumentations Compose run here on pycocotools' sample (the boxes
    given in ``fmt`` by hand, tests/targets_oracle.py) on a stream of the test's own (boxes
    within BOX_ULPS float32 ulps, everything else exactly). On main the
    prefix and the rest each converted the boxes: coco and yolo failed ("x_max is less than or
    equal to x_min"), albumentations' boxes were divided by W and H twice."""
    import cv2
    import numpy as np

    import coco_oracle
    from targets_oracle import assert_boxes, in_format, one_compose

    pipe = A.Compose([A.LongestMaxSize(max_size=96), A.PadIfNeeded(96, 96, border_mode=cv2.BORDER_CONSTANT),
                      A.HorizontalFlip(p=0.5), A.RandomCrop(80, 80)],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"], min_visibility=0.3))
    oracle = coco_oracle.samples(fashion_coco / "annotations" / "instances_train.json", fashion_coco / "images" / "train")

    def expected(s: dict, position: int, epoch: int) -> dict:
        # the epoch's key as batchd/sampler.py defines it, by numpy itself
        key = np.random.SeedSequence([11, epoch], spawn_key=(1,)).generate_state(2, np.uint64)
        n, (h, w) = len(s["boxes"]), s["image"].shape[:2]
        out = one_compose(pipe, key, position)(image=s["image"], bboxes=in_format(s["boxes"], fmt, h, w),
                                               ids=np.arange(n), **({"masks": s["masks"]} if n else {}))
        kept = np.asarray(out["ids"], np.int64)
        return {"image": out["image"], "boxes": np.asarray(out["bboxes"], np.float64).reshape(-1, 4),
                "labels": s["labels"][kept], "masks": np.asarray(out["masks"], np.uint8)[kept] if n else None}

    det = {"det": {"kind": "coco", "images": str(fashion_coco / "images" / "train"),
                   "annotations": str(fashion_coco / "annotations" / "instances_train.json"), "masks": True}}
    for cache in (None, {"memory_bytes": "16MiB"}):
        with running_server(workers=2, cache_dir=tmp_path, datasets=det, **({"cache": cache} if cache else {})) as s:
            with batchd.RemoteDataLoader(s.address, "det", batch_size=8, shuffle=True, seed=11, transform=pipe,
                                         timeout=60) as loader:
                checked = 0
                for epoch in (0, 1):
                    loader.set_epoch(epoch)
                    for b in loader:
                        for j, (index, position) in enumerate(zip(b["index"].tolist(), b["position"].tolist())):
                            want = expected(oracle[index], position, epoch)
                            where = f"{fmt}, cache {'on' if cache else 'off'}, epoch {epoch}, sample {index}"
                            assert np.array_equal(b["image"][j].numpy(), want["image"]), where
                            assert_boxes(b["boxes"][j].numpy(), want["boxes"], fmt, *want["image"].shape[:2], where)
                            assert np.array_equal(b["labels"][j].numpy(), want["labels"]), where
                            if want["masks"] is not None:
                                assert np.array_equal(b["masks"][j].numpy(), want["masks"]), where
                            checked += 1
            if cache:
                stats = s.loader.cache.stats()["det"]
                assert stats["hits"] == 60 and stats["misses"] == 60, stats
        assert checked == 120
