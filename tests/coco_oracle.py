"""The oracle of ``kind: coco``: pycocotools' reading of a COCO JSON in torchvision's order.

The expected target of an image is what torchvision's ``CocoDetection`` (sorted image ids,
``coco.loadAnns(coco.getAnnIds(id))``) with the detection references' box conversion gives:
float32 xywh -> xyxy, clamped to the image, boxes without area dropped; masks from
``coco.annToMask``. Crowd annotations are kept (with ``iscrowd``), as torchvision's v2 wrapper
does. Used by tests/data/test_coco.py (the dataset in-process) and tests/client/test_coco_served.py
(through a server).
"""

from __future__ import annotations

import pathlib

import numpy as np
import torch
from PIL import Image
from pycocotools.coco import COCO


def expected(coco: COCO, img_id: int, masks: bool) -> tuple[dict, list[int]]:
    """The oracle's target of image ``img_id`` (torchvision's order and box conversion,
    pycocotools' masks), without the image, and the ids of the annotations it keeps."""
    img = coco.imgs[img_id]
    h, w = img["height"], img["width"]
    anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
    boxes = torch.as_tensor([a["bbox"] for a in anns], dtype=torch.float32).reshape(-1, 4)
    boxes[:, 2:] += boxes[:, :2]  # references/detection/coco_utils.py ConvertCocoPolysToMask
    boxes[:, 0::2].clamp_(min=0, max=w)
    boxes[:, 1::2].clamp_(min=0, max=h)
    keep = ((boxes[:, 3] > boxes[:, 1]) & (boxes[:, 2] > boxes[:, 0])).numpy()
    anns = [a for a, k in zip(anns, keep) if k]
    out = {"boxes": boxes.numpy()[keep], "labels": np.array([a["category_id"] for a in anns], np.int64),
           "iscrowd": np.array([a["iscrowd"] for a in anns], np.int64),
           "area": np.array([a["area"] for a in anns], np.float32), "image_id": img_id}
    if masks:
        out["masks"] = np.array([coco.annToMask(a) for a in anns], np.uint8).reshape(-1, h, w)
    return out, [a["id"] for a in anns]


def image(coco: COCO, img_id: int, images: pathlib.Path) -> np.ndarray:
    """Image ``img_id`` as torchvision's ``CocoDetection._load_image`` reads it, RGB uint8 [H, W, 3]:
    ``PIL.Image.open(path).convert("RGB")``, the stored pixels (no EXIF turn). Not OpenCV: its
    ``imread`` turns a JPEG by its EXIF orientation, as the server once did, and an oracle that
    shares the server's reader cannot see that the boxes did not turn with it."""
    with Image.open(images / coco.imgs[img_id]["file_name"]) as im:
        return np.asarray(im.convert("RGB"))


def samples(json_path: pathlib.Path, images: pathlib.Path, masks: bool = True) -> list[dict]:
    """Every sample of the JSON in torchvision's order (sorted image ids): image and target fields."""
    coco = COCO(str(json_path))
    return [{"image": image(coco, i, images), **expected(coco, i, masks)[0]} for i in sorted(coco.imgs)]
