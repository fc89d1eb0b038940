"""A COCO "instances" JSON checked and packed into the memory-mapped index of ``kind: coco``.

The JSON is parsed once, by the server, when it builds the index; workers only map the result.
For n images (sorted by id, as torchvision's ``CocoDetection`` orders them) and M annotations
kept, the ``.bidx`` file (see ``_cache``) holds:

* ``path_bytes`` / ``path_offsets``: each image's ``file_name`` (packed strings, see ``_files``);
* ``image_ids`` int64 [n]; ``heights``, ``widths`` int32 [n]: the JSON's sizes, in pixels;
* ``ann_offsets`` int64 [n + 1]: image i's annotations are rows ``ann_offsets[i]:ann_offsets[i+1]``
  of the per-annotation arrays, in the JSON's order (pycocotools' ``getAnnIds(imgIds=id)``);
* ``ann_ids`` int64 [M]; ``ann_boxes`` float32 [M, 4] (x1, y1, x2, y2 in pixels); ``ann_labels``
  int64 [M] (category ids); ``ann_iscrowd`` int64 [M]; ``ann_area`` float32 [M] (the JSON's ``area``);
* with masks: each annotation's ``segmentation``, checked and packed by ``coco_segments``.

and in ``meta``: ``classes`` (category names indexed by category id, "" for unused ids),
``counts`` (annotations kept, dropped of zero size or outside their image, empty images) and
``dropped_ids`` (the first ``DROPPED_IDS_KEPT`` dropped annotations' ids).

Boxes: ``bbox`` [x, y, w, h] becomes float32 [x, y, x + w, y + h], the sum taken in float32 as
torchvision does, then clipped to the image ([0, width] x [0, height], as torchvision's
detection references clamp them; albumentations refuses boxes outside the image). A box with
zero width or height, or none left after clipping, is dropped with its annotation and counted.
"""

from __future__ import annotations

import json
import pathlib

import numpy as np

from ._cache import ArrayFileWriter
from ._files import pack_strings
from .coco_segments import SegmentationPacker, finite_numbers, short_json

MAX_CATEGORY_ID = (1 << 20) - 1  # class_names has one entry per id up to the largest
DROPPED_IDS_KEPT = 10  # the first ids of dropped annotations, for the server's log
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _id(v) -> bool:
    return type(v) is int and _INT64[0] <= v <= _INT64[1]


def _load(path: str, shown: str) -> dict:
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{shown}: COCO annotation file not found") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(f"{shown}: not a readable JSON file: {e}") from None
    if type(data) is not dict:
        raise ValueError(f"{shown}: expected a JSON object with 'images', 'annotations' and 'categories'")
    for key in ("images", "annotations", "categories"):
        if type(data.get(key)) is not list:
            raise ValueError(f"{shown}: field {key!r}: expected a list, got {short_json(data.get(key))}")
    return data


def _categories(data: dict, shown: str) -> dict[int, str]:
    """Category id -> name."""
    names: dict[int, str] = {}
    for k, cat in enumerate(data["categories"]):
        cid = cat.get("id") if type(cat) is dict else None
        if type(cid) is not int or not 0 <= cid <= MAX_CATEGORY_ID:
            raise ValueError(f"{shown}: categories[{k}]: field 'id': {short_json(cid)}; expected an integer in [0, {MAX_CATEGORY_ID}]")
        if cid in names:
            raise ValueError(f"{shown}: category id {cid}: two categories have this id")
        name = cat.get("name")
        if type(name) is not str:
            raise ValueError(f"{shown}: category id {cid}: field 'name': {short_json(name)}; expected a string")
        names[cid] = name
    return names


def class_names(cats: dict[int, str]) -> list[str]:
    """Category names indexed by category id, "" for ids no category has: ``labels`` (category
    ids) index it directly, as a classification label indexes ``classes``."""
    classes = [""] * (max(cats) + 1 if cats else 0)
    for cid, name in cats.items():
        classes[cid] = name
    return classes


def _images(data: dict, shown: str) -> tuple[list[dict], dict[int, int]]:
    """(images sorted by id, id -> position)."""
    by_id: dict[int, dict] = {}
    for k, img in enumerate(data["images"]):
        iid = img.get("id") if type(img) is dict else None
        if not _id(iid):
            raise ValueError(f"{shown}: images[{k}]: field 'id': {short_json(iid)}; expected an integer")
        if iid in by_id:
            raise ValueError(f"{shown}: image id {iid}: two images have this id")
        name = img.get("file_name")
        if type(name) is not str or not name:
            raise ValueError(f"{shown}: image id {iid}: field 'file_name': {short_json(name)}; expected a non-empty string")
        for field in ("height", "width"):
            v = img.get(field)
            if type(v) is not int or not 0 < v < 1 << 31:
                raise ValueError(f"{shown}: image id {iid}: field {field!r}: {short_json(v)}; expected a positive integer")
        by_id[iid] = img
    images = [by_id[i] for i in sorted(by_id)]
    return images, {img["id"]: pos for pos, img in enumerate(images)}


def _annotations(data: dict, shown: str, images: list[dict], positions: dict[int, int], cats: dict[int, str],
                 segments: SegmentationPacker | None) -> dict:
    """Every annotation checked, as lists: id, image position, category, bbox, iscrowd, area; its
    segmentation checked and packed into ``segments`` if given. Raises ValueError naming the
    file, annotation id and field."""
    out = {"id": [], "pos": [], "cat": [], "bbox": [], "iscrowd": [], "area": []}
    seen: set[int] = set()
    for k, ann in enumerate(data["annotations"]):
        aid = ann.get("id") if type(ann) is dict else None
        if not _id(aid):
            raise ValueError(f"{shown}: annotations[{k}]: field 'id': {short_json(aid)}; expected an integer")
        if aid in seen:
            raise ValueError(f"{shown}: annotation id {aid}: two annotations have this id")
        seen.add(aid)
        where = f"{shown}: annotation id {aid}"
        iid = ann.get("image_id")
        pos = positions.get(iid) if _id(iid) else None
        if pos is None:
            raise ValueError(f"{where}: field 'image_id': {short_json(iid)} is not the id of an image in 'images'")
        cid = ann.get("category_id")
        if type(cid) is not int or cid not in cats:
            raise ValueError(f"{where}: field 'category_id': {short_json(cid)} is not the id of a category in 'categories'")
        bbox = ann.get("bbox")
        if type(bbox) is not list or len(bbox) != 4 or not finite_numbers(bbox):
            raise ValueError(f"{where}: field 'bbox': expected [x, y, width, height] (4 finite numbers), got {short_json(bbox)}")
        if bbox[2] < 0 or bbox[3] < 0:
            raise ValueError(f"{where}: field 'bbox': negative width or height in {short_json(bbox)}")
        iscrowd = ann.get("iscrowd")
        if type(iscrowd) is not int or iscrowd not in (0, 1):
            raise ValueError(f"{where}: field 'iscrowd': {short_json(iscrowd)}; expected 0 or 1")
        area = ann.get("area")
        if not finite_numbers([area]) or area < 0:
            raise ValueError(f"{where}: field 'area': {short_json(area)}; expected a finite number >= 0")
        if segments is not None:
            segments.add(where, ann.get("segmentation"), images[pos]["height"], images[pos]["width"])
        out["id"].append(aid)
        out["pos"].append(pos)
        out["cat"].append(cid)
        out["bbox"].append(bbox)
        out["iscrowd"].append(iscrowd)
        out["area"].append(area)
    return out


def xyxy_boxes(bbox: np.ndarray, widths: np.ndarray, heights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(boxes float32 [M, 4] xyxy clipped to each box's image, keep bool [M]) from ``bbox``
    [M, 4] xywh and each box's image ``widths`` / ``heights`` [M]. ``keep``: the box has
    positive width and height after clipping."""
    boxes = np.asarray(bbox, dtype=np.float32).reshape(-1, 4).copy()
    boxes[:, 2:] += boxes[:, :2]
    np.clip(boxes[:, 0::2], 0, widths.astype(np.float32)[:, None], out=boxes[:, 0::2])
    np.clip(boxes[:, 1::2], 0, heights.astype(np.float32)[:, None], out=boxes[:, 1::2])
    keep = (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
    return boxes, keep


def build_index(json_path: str, shown: str, out: pathlib.Path, *, masks: bool, skip_empty: bool,
                fingerprint: str, source) -> None:
    """Check the COCO JSON at ``json_path`` (named ``shown`` in errors) and write its index to
    ``out`` (layout in the module docstring). ``fingerprint``: the dataset's; ``source``: what the
    index was built from (kept in its meta).

    Raises FileNotFoundError if the file is missing; ValueError naming the file, and the entry
    (image, category or annotation id) and field, for anything malformed (see ``_annotations``,
    ``coco_segments``); ValueError if no image is left.
    """
    data = _load(json_path, shown)
    cats = _categories(data, shown)
    images, positions = _images(data, shown)
    segments = SegmentationPacker() if masks else None
    anns = _annotations(data, shown, images, positions, cats, segments)
    del data
    n = len(images)
    heights = np.array([img["height"] for img in images], dtype=np.int32)
    widths = np.array([img["width"] for img in images], dtype=np.int32)
    pos = np.asarray(anns["pos"], dtype=np.int64)
    boxes, keep = xyxy_boxes(anns["bbox"], widths[pos], heights[pos])
    raw = np.asarray(anns["bbox"], dtype=np.float64).reshape(-1, 4)
    zero = (raw[:, 2] == 0) | (raw[:, 3] == 0)
    ann_ids = np.asarray(anns["id"], dtype=np.int64)
    counts = {"dropped_zero_size": int((~keep & zero).sum()), "dropped_outside_image": int((~keep & ~zero).sum())}
    dropped_ids = ann_ids[~keep][:DROPPED_IDS_KEPT].tolist()
    order = np.flatnonzero(keep)
    order = order[np.argsort(pos[order], kind="stable")]  # by image, each image's in the JSON's order
    per_image = np.bincount(pos[order], minlength=n)
    counts["empty_images"] = int((per_image == 0).sum())
    image_rows = np.arange(n)
    if skip_empty:
        image_rows = np.flatnonzero(per_image)
        per_image = per_image[image_rows]
    counts["skipped_empty_images"] = n - len(image_rows)
    counts["annotations"] = len(order)
    if len(image_rows) == 0:
        raise ValueError(f"{shown}: no images" + (" with annotations (skip_empty: true)" if n else ""))
    ann_offsets = np.zeros(len(image_rows) + 1, dtype=np.int64)
    np.cumsum(per_image, out=ann_offsets[1:])
    path_bytes, path_offsets = pack_strings([images[i]["file_name"] for i in image_rows])
    with ArrayFileWriter(out) as w:
        w.add("path_bytes", path_bytes)
        w.add("path_offsets", path_offsets)
        w.add("image_ids", np.array([images[i]["id"] for i in image_rows], dtype=np.int64))
        w.add("heights", heights[image_rows])
        w.add("widths", widths[image_rows])
        w.add("ann_offsets", ann_offsets)
        w.add("ann_ids", ann_ids[order])
        w.add("ann_boxes", boxes[order])
        w.add("ann_labels", np.asarray(anns["cat"], dtype=np.int64)[order])
        w.add("ann_iscrowd", np.asarray(anns["iscrowd"], dtype=np.int64)[order])
        w.add("ann_area", np.asarray(anns["area"], dtype=np.float32)[order])
        if segments is not None:
            segments.write(w, order)
        w.meta.update(kind="coco", classes=class_names(cats), counts=counts, dropped_ids=dropped_ids, fingerprint=fingerprint, source=source)
