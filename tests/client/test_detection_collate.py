"""``batchd.detection_collate`` gives torchvision's xyxy pixel boxes whatever the pipeline's bbox
format (issue 38, case 7): a client's Compose asking for coco, yolo or albumentations boxes,
through a real server, gives the same targets as one asking for pascal_voc (within float32
rounding of the formats), and a collate told another format than the transform's is refused.
On the code before, coco boxes came as xywh, which torchvision's detectors misread."""

from __future__ import annotations

import functools
import pathlib

import albumentations as A
import numpy as np
import pytest

import batchd
from conftest import running_server

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")


def pipeline(fmt: str) -> A.Compose:
    return A.Compose([A.RandomCrop(40, 44), A.HorizontalFlip(p=0.5), A.Affine(rotate=(-15, 15), p=0.7)],
                     bbox_params=A.BboxParams(format=fmt, label_fields=["labels"]))


def test_detection_collate_gives_xyxy_pixels_whatever_the_bbox_format(tmp_path):
    rect = {"kind": "python", "factory": "batchd_testdata:Rectangles", "args": {"n": 48, "size": 48}}
    with running_server(python_path=[str(PYDATA)], workers=1, cache_dir=tmp_path, datasets={"rect": rect}) as s:
        got = {}
        for fmt in FORMATS:
            with batchd.RemoteDataLoader(s.address, "rect", batch_size=8, seed=3, transform=pipeline(fmt),
                                         collate_fn=batchd.detection_collate) as loader:
                got[fmt] = [t for _, targets in loader for t in targets]
        with pytest.raises(ValueError, match=r"detection_collate was told bbox_format='yolo', but the transform's "
                                             r"bbox_params give the boxes in 'coco'"):
            batchd.RemoteDataLoader(s.address, "rect", batch_size=8, transform=pipeline("coco"),
                                    collate_fn=functools.partial(batchd.detection_collate, bbox_format="yolo"))
    xyxy = got["pascal_voc"]
    assert sum(len(t["boxes"]) for t in xyxy) > 40
    for fmt in FORMATS[1:]:
        for a, b in zip(xyxy, got[fmt]):
            assert a["index"] == b["index"] and b["boxes"].dtype == a["boxes"].dtype
            assert np.allclose(b["boxes"].numpy(), a["boxes"].numpy(), rtol=0, atol=1e-3), (fmt, a["boxes"], b["boxes"])
    for t in xyxy:  # torchvision's convention: x_min < x_max, y_min < y_max, in the 40 x 44 crop
        boxes = t["boxes"].numpy()
        assert (boxes[:, 2] > boxes[:, 0]).all() and (boxes[:, 3] > boxes[:, 1]).all() and boxes.max(initial=0) <= 44


def test_detection_collate_converts_each_format_with_the_samples_own_size():
    import torch

    sample = {"image": torch.zeros(20, 40, 3, dtype=torch.uint8), "boxes": torch.tensor([[0.25, 0.5, 0.5, 0.25]])}
    want = {"pascal_voc": [0.25, 0.5, 0.5, 0.25], "coco": [0.25, 0.5, 0.75, 0.75], "yolo": [0.0, 7.5, 20.0, 12.5],
            "albumentations": [10.0, 10.0, 20.0, 5.0]}
    for fmt, xyxy in want.items():
        _, (target,) = batchd.detection_collate([sample], bbox_format=fmt)
        assert target["boxes"].dtype == torch.float32 and target["boxes"].tolist() == [xyxy], fmt
    assert sample["boxes"].tolist() == [[0.25, 0.5, 0.5, 0.25]], "the sample was modified"
    with pytest.raises(ValueError, match="bbox_format must be one of"):
        batchd.detection_collate([sample], bbox_format="xywh")
