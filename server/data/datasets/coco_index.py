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
* with masks: ``ann_seg_bytes`` / ``ann_seg_offsets``: each annotation's ``segmentation`` as compact
  JSON text, decoded per sample (a polygon's float coordinates keep their exact value).

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
import math
import pathlib

import numpy as np

from ._cache import ArrayFileWriter
from ._files import pack_strings

MAX_CATEGORY_ID = (1 << 20) - 1  # class_names has one entry per id up to the largest
DROPPED_IDS_KEPT = 10  # the first ids of dropped annotations, for the server's log
_INT64 = (-(1 << 63), (1 << 63) - 1)


def _id(v) -> bool:
    return type(v) is int and _INT64[0] <= v <= _INT64[1]


def _num(v) -> bool:
    return (type(v) is int or type(v) is float) and math.isfinite(v)


def _got(v) -> str:
    text = json.dumps(v, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def rle_string_counts(s: str) -> list[int]:
    """The run lengths of a compressed COCO RLE ``counts`` string (pycocotools' ``rleFrString``,
    maskApi.c: 5-bit groups offset by 48, a continuation bit, sign extension, each count from
    the third on stored as the difference to the count two before it).

    Raises ValueError (the reason, without the annotation) for a character outside '0'..'o', a
    string that ends inside a count, or a count that is negative or does not fit 32 bits (where
    pycocotools would silently wrap it and then write outside its mask).
    """
    counts: list[int] = []
    p, n = 0, len(s)
    while p < n:
        x = k = 0
        more = True
        while more:
            if p >= n:
                raise ValueError("the string ends inside a count")
            c = ord(s[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"character {s[p]!r} at position {p} is not in '0'..'o'")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        if not 0 <= x < 1 << 32:
            raise ValueError(f"run {len(counts)} has length {x}")
        counts.append(x)
    return counts


def check_segmentation(where: str, seg, height: int, width: int) -> None:
    """Raise ValueError naming ``where`` (file and annotation) and the field unless ``seg`` is
    what pycocotools' ``annToMask`` reads correctly for an image of ``height`` x ``width``:
    polygons (a non-empty list of parts, each an even count >= 6 of finite numbers: a part of
    4 would be taken for a box by ``frPyObjects``), or RLE ``{"size": [height, width],
    "counts": ...}`` whose runs (a list of non-negative ints, or a compressed string) add up to
    height x width (more would make pycocotools write past the end of its mask)."""
    if type(seg) is list:
        if not seg:
            raise ValueError(f"{where}: field 'segmentation': an empty list (no polygon)")
        for j, part in enumerate(seg):
            if type(part) is not list or len(part) < 6 or len(part) % 2 or not all(_num(v) for v in part):
                raise ValueError(f"{where}: field 'segmentation[{j}]': expected a polygon [x1, y1, x2, y2, x3, y3, ...] "
                                 f"(an even count >= 6 of finite numbers), got {_got(part)}")
        return
    if type(seg) is not dict:
        raise ValueError(f"{where}: field 'segmentation': expected polygons (a list) or RLE (an object), got {_got(seg)}")
    size, counts = seg.get("size"), seg.get("counts")
    if type(size) is not list or [type(v) for v in size] != [int, int] or size != [height, width]:
        raise ValueError(f"{where}: field 'segmentation.size': {_got(size)}, but the image is "
                         f"[height, width] = [{height}, {width}]")
    if type(counts) is list:
        if not all(type(v) is int and 0 <= v < 1 << 32 for v in counts):
            bad = next(v for v in counts if not (type(v) is int and 0 <= v < 1 << 32))
            raise ValueError(f"{where}: field 'segmentation.counts': run length {_got(bad)} is not an integer in [0, 2**32)")
        runs = counts
    elif type(counts) is str:
        try:
            runs = rle_string_counts(counts)
        except ValueError as e:
            raise ValueError(f"{where}: field 'segmentation.counts': not a valid compressed RLE string: {e}") from None
    else:
        raise ValueError(f"{where}: field 'segmentation.counts': expected a list of run lengths or a compressed "
                         f"string, got {_got(counts)}")
    if sum(runs) != height * width:
        raise ValueError(f"{where}: field 'segmentation.counts': the runs cover {sum(runs)} pixels, "
                         f"the image {height} x {width} = {height * width}")


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
            raise ValueError(f"{shown}: field {key!r}: expected a list, got {_got(data.get(key))}")
    return data


def _categories(data: dict, shown: str) -> dict[int, str]:
    """Category id -> name."""
    names: dict[int, str] = {}
    for k, cat in enumerate(data["categories"]):
        cid = cat.get("id") if type(cat) is dict else None
        if type(cid) is not int or not 0 <= cid <= MAX_CATEGORY_ID:
            raise ValueError(f"{shown}: categories[{k}]: field 'id': {_got(cid)}; expected an integer in [0, {MAX_CATEGORY_ID}]")
        if cid in names:
            raise ValueError(f"{shown}: category id {cid}: two categories have this id")
        name = cat.get("name")
        if type(name) is not str:
            raise ValueError(f"{shown}: category id {cid}: field 'name': {_got(name)}; expected a string")
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
            raise ValueError(f"{shown}: images[{k}]: field 'id': {_got(iid)}; expected an integer")
        if iid in by_id:
            raise ValueError(f"{shown}: image id {iid}: two images have this id")
        name = img.get("file_name")
        if type(name) is not str or not name:
            raise ValueError(f"{shown}: image id {iid}: field 'file_name': {_got(name)}; expected a non-empty string")
        for field in ("height", "width"):
            v = img.get(field)
            if type(v) is not int or not 0 < v < 1 << 31:
                raise ValueError(f"{shown}: image id {iid}: field {field!r}: {_got(v)}; expected a positive integer")
        by_id[iid] = img
    images = [by_id[i] for i in sorted(by_id)]
    return images, {img["id"]: pos for pos, img in enumerate(images)}


def _annotations(data: dict, shown: str, images: list[dict], positions: dict[int, int], cats: dict[int, str],
                 masks: bool) -> dict:
    """Every annotation checked, as lists: id, image position, category, bbox, iscrowd, area, and
    (masks) the segmentation's JSON text. Raises ValueError naming the file, annotation id and field."""
    out = {"id": [], "pos": [], "cat": [], "bbox": [], "iscrowd": [], "area": [], "seg": []}
    seen: set[int] = set()
    for k, ann in enumerate(data["annotations"]):
        aid = ann.get("id") if type(ann) is dict else None
        if not _id(aid):
            raise ValueError(f"{shown}: annotations[{k}]: field 'id': {_got(aid)}; expected an integer")
        if aid in seen:
            raise ValueError(f"{shown}: annotation id {aid}: two annotations have this id")
        seen.add(aid)
        where = f"{shown}: annotation id {aid}"
        iid = ann.get("image_id")
        pos = positions.get(iid) if _id(iid) else None
        if pos is None:
            raise ValueError(f"{where}: field 'image_id': {_got(iid)} is not the id of an image in 'images'")
        cid = ann.get("category_id")
        if type(cid) is not int or cid not in cats:
            raise ValueError(f"{where}: field 'category_id': {_got(cid)} is not the id of a category in 'categories'")
        bbox = ann.get("bbox")
        if type(bbox) is not list or len(bbox) != 4 or not all(_num(v) for v in bbox):
            raise ValueError(f"{where}: field 'bbox': expected [x, y, width, height] (4 finite numbers), got {_got(bbox)}")
        if bbox[2] < 0 or bbox[3] < 0:
            raise ValueError(f"{where}: field 'bbox': negative width or height in {_got(bbox)}")
        iscrowd = ann.get("iscrowd")
        if type(iscrowd) is not int or iscrowd not in (0, 1):
            raise ValueError(f"{where}: field 'iscrowd': {_got(iscrowd)}; expected 0 or 1")
        area = ann.get("area")
        if not _num(area) or area < 0:
            raise ValueError(f"{where}: field 'area': {_got(area)}; expected a finite number >= 0")
        if masks:
            seg = ann.get("segmentation")
            check_segmentation(where, seg, images[pos]["height"], images[pos]["width"])
            out["seg"].append(json.dumps(seg, separators=(",", ":")))
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
    ``check_segmentation``); ValueError if no image is left.
    """
    data = _load(json_path, shown)
    cats = _categories(data, shown)
    images, positions = _images(data, shown)
    anns = _annotations(data, shown, images, positions, cats, masks)
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
        if masks:
            seg_bytes, seg_offsets = pack_strings([anns["seg"][i] for i in order])
            w.add("ann_seg_bytes", seg_bytes)
            w.add("ann_seg_offsets", seg_offsets)
        w.meta.update(kind="coco", classes=class_names(cats), counts=counts, dropped_ids=dropped_ids, fingerprint=fingerprint, source=source)
