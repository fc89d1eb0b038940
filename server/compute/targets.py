"""Targets through albumentations: boxes, masks and keypoints move with the image; per-object fields stay aligned.

A sample's fields meet a pipeline's ``Compose`` as albumentations targets:

* ``image`` -> ``image=``; ``mask`` (semantic segmentation, [H, W]) -> ``mask=``; ``masks``
  ([N, H, W], one per object) -> ``masks=``;
* ``boxes`` (float32 [N, 4], xyxy in pixels) -> ``bboxes=`` under ``BboxParams(format="pascal_voc")``;
* ``keypoints`` ([N, K, D], D >= 2: x, y, then e.g. visibility) -> ``keypoints=`` as N*K points
  under ``KeypointParams(format="xy", remove_invisible=False)``; columns after x, y travel along.

So a flip, crop, resize or rotation moves every target with the image, drawn from the sample's one
random stream (the Compose's transforms draw from it, ``pipeline.SampleRandom``).

**Objects stay aligned.** Every box carries its object number in an internal label field
(``BOX_OBJECT``); when albumentations drops a box (cropped away, under ``min_area`` or
``min_visibility``), every per-object field of the sample (``labels``, ``masks``, ``keypoints``,
``iscrowd``, ``area``, the dataset's own; ``FieldSpec.per_object``) is indexed with the surviving
numbers, so it drops the same objects (albumentations never drops masks itself). Keypoints are
never dropped on their own (``remove_invisible`` must be false): an object keeps its K points, in
or out of the image. Other fields (Python ints, floats, str, bytes, other arrays) pass through
untouched; ``area`` is not recomputed.

**Params.** A Compose's own ``bbox_params`` / ``keypoint_params`` are used (a client's are
allowlisted, ``allowlist_fields.bbox_params``) with their ``label_fields`` replaced by the object
number (each name given must be a per-object field of the sample), and ``min_width`` /
``min_height`` at least ``MIN_SIDE`` (albumentations keeps boxes cropped to zero width, and a
later rotation widens them again over none of their object's pixels). Without them, a sample with
boxes gets ``BboxParams(format="pascal_voc")`` and one with keypoints ``KeypointParams(format="xy",
remove_invisible=False)``. A bbox ``format`` other than pascal_voc (coco, yolo, albumentations):
the boxes are converted into it before the Compose (albumentations' own conversions) and come out
in it. Targets keep their dtype (albumentations returns float64 boxes and may widen masks).
"""

from __future__ import annotations

import functools
import json
from typing import Any, Callable

import albumentations as A
import numpy as np
from albumentations.core import bbox_utils

BOX_OBJECT = "batchd_box_object"  # internal label fields: each box's / keypoint's object number
KEYPOINT_OBJECT = "batchd_keypoint_object"
GEOMETRIC = ("boxes", "keypoints")  # fields that need a processor (bbox_params / keypoint_params)
_BOX_FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")
MIN_SIDE = 0.01  # pixels: a box thinner than this after a transform was cut away (its object is dropped)


def has_geometry(sample: dict) -> bool:
    """True if the sample has boxes or keypoints (they need albumentations' processors)."""
    return "boxes" in sample or "keypoints" in sample


def check_objects(sample: dict, per_object: Callable[[str], bool]) -> int | None:
    """N, the number of objects of the sample (None without per-object fields). Raises ValueError
    naming the fields if their first dimensions differ, or one is not an array with a first dimension."""
    n, first = None, None
    for name, value in sample.items():
        if not per_object(name):
            continue
        shape = getattr(value, "shape", None)
        if not shape:
            raise ValueError(f"per-object field {name!r} must be an array with one entry per object along its first "
                             f"dimension, got {type(value).__name__}{list(shape) if shape is not None else ''}")
        if n is None:
            n, first = shape[0], name
        elif shape[0] != n:
            raise ValueError(f"per-object fields disagree on the number of objects: {first!r} has {n} "
                             f"({list(sample[first].shape)}), {name!r} has {shape[0]} ({list(shape)})")
    return n


class TargetPipeline:
    """An albumentations Compose applied to a sample dict (see the module docstring).

    ``spec``: the Compose as ``A.to_dict`` returns it; ``compose``: that Compose itself, used as
    it is for samples without boxes or keypoints when it has no bbox/keypoint params (so those
    samples are augmented exactly as an image-only pipeline augments them). ``attach(compose)`` is
    called on every Compose built here (``SampleRandom.attach``: they draw from the sample's stream).
    """

    def __init__(self, spec: dict[str, Any], compose: A.Compose | None = None,
                 attach: Callable[[A.Compose], None] | None = None, force_apply: bool = False):
        self.spec = spec
        self.force_apply = force_apply  # run without the Compose's own p draw (a prefix: p is 1)
        top = spec["transform"]
        self.bbox_params = top.get("bbox_params") or None
        self.keypoint_params = top.get("keypoint_params") or None
        self._attach = attach
        self._variants: dict[tuple[bool, bool], A.Compose] = {}
        if compose is not None and self.bbox_params is None and self.keypoint_params is None:
            self._variants[(False, False)] = compose

    @classmethod
    def of(cls, compose: A.Compose, attach: Callable[[A.Compose], None] | None = None) -> "TargetPipeline":
        return cls(A.to_dict(compose), compose, attach)

    @classmethod
    def of_transforms(cls, transforms, like: "TargetPipeline | None",
                      seal: Callable[[A.Compose], None]) -> "TargetPipeline":
        """A Compose of ``transforms`` with ``like``'s bbox and keypoint params, run with
        ``force_apply`` (no draw for its p): a cacheable prefix applied to samples with boxes or
        keypoints. ``seal(compose)`` gives it the random state it may not draw from."""
        top = {"__class_fullname__": "Compose", "p": 1.0, "transforms": [t.to_dict()["transform"] for t in transforms]}
        if like is not None:
            top["bbox_params"], top["keypoint_params"] = like.bbox_params, like.keypoint_params
        return cls({"transform": top}, attach=seal, force_apply=True)

    def __call__(self, sample: dict, per_object: Callable[[str], bool]) -> dict:
        """The sample after the Compose (see ``apply``)."""
        compose = self._variant("boxes" in sample, "keypoints" in sample, sample, per_object)
        call = functools.partial(compose, force_apply=True) if self.force_apply else compose
        return apply(call, sample, per_object, (self.bbox_params or {}).get("format", "pascal_voc"))

    def _variant(self, boxes: bool, keypoints: bool, sample: dict, per_object: Callable[[str], bool]) -> A.Compose:
        """The Compose for a sample with (or without) boxes and keypoints, built once each."""
        for params in (self.bbox_params if boxes else None, self.keypoint_params if keypoints else None):
            for name in (params or {}).get("label_fields") or ():
                if name not in sample or not per_object(name):
                    raise ValueError(f"label_fields names {name!r}, which is not a per-object field of the sample "
                                     f"(per-object fields: {sorted(f for f in sample if per_object(f))}); every "
                                     "per-object field follows the boxes anyway")
        key = (boxes, keypoints)
        compose = self._variants.get(key)
        if compose is None:
            top = dict(self.spec["transform"])
            top["bbox_params"] = _bbox_params(self.bbox_params) if boxes else None
            top["keypoint_params"] = _keypoint_params(self.keypoint_params) if keypoints else None
            try:
                compose = A.from_dict({**self.spec, "transform": top})
            except Exception as e:  # albumentations raises ValueError, KeyError, pydantic errors...
                raise ValueError(f"albumentations cannot build the pipeline with targets: {type(e).__name__}: {e}") from None
            if self._attach is not None:
                self._attach(compose)
            self._variants[key] = compose
        return compose


class Prefix:
    """A pipeline's deterministic prefix (``prefix.Split.prefix``) applied to a sample dict: one
    transform at a time to image, mask and masks (as ``Split.apply_prefix`` does to an image), or,
    for a sample with boxes or keypoints, as a Compose with the pipeline's params (``like``)."""

    def __init__(self, transforms, like: TargetPipeline | None, seal: Callable[[A.Compose], None]):
        """seal(compose): the random state of the Compose built for samples with boxes or keypoints
        (its transforms draw nothing: a generator no one else uses, or one that raises if drawn from)."""
        self.transforms, self.like, self.seal = tuple(transforms), like, seal
        self._compose: TargetPipeline | None = None

    def __call__(self, sample: dict, per_object: Callable[[str], bool]) -> dict:
        if not self.transforms:
            return sample
        if has_geometry(sample):
            if self._compose is None:
                self._compose = TargetPipeline.of_transforms(self.transforms, self.like, self.seal)
            return self._compose(sample, per_object)
        return apply(self._chain, sample, per_object)

    def params_name(self) -> str:
        """The bbox and keypoint params the prefix applies to samples with boxes or keypoints, as
        canonical text ("" when it has no transforms or the pipeline gives none): part of a cache
        entry's name, since a crop under ``min_visibility`` keeps other boxes than one without."""
        if not self.transforms or self.like is None or (self.like.bbox_params is None and self.like.keypoint_params is None):
            return ""
        return "|targets:" + json.dumps([self.like.bbox_params, self.like.keypoint_params], sort_keys=True, default=str)

    def _chain(self, **data):
        for t in self.transforms:
            data = t(**data)
        return data


def apply(call: Callable[..., dict], sample: dict, per_object: Callable[[str], bool],
          bbox_format: str = "pascal_voc") -> dict:
    """``call(image=..., mask=..., masks=..., bboxes=..., keypoints=..., <object numbers>)`` (a
    Compose, or transforms in turn) on the sample's targets; the result is a new dict (fields not
    handed to albumentations are the same objects, per-object ones indexed by the surviving
    boxes). Raises ValueError for targets that do not fit (per-object fields of different N,
    keypoints not [N, K, >= 2], boxes albumentations refuses)."""
    if "image" not in sample:
        raise ValueError(f"the pipeline needs an 'image' field; the sample has {sorted(sample)}")
    n = check_objects(sample, per_object)
    boxes, keypoints = sample.get("boxes"), sample.get("keypoints")
    data: dict[str, Any] = {"image": sample["image"]}
    if "mask" in sample:
        data["mask"] = sample["mask"]
    masks = sample.get("masks")
    if masks is not None and len(masks):
        data["masks"] = masks  # albumentations cannot stack 0 masks: an empty [0, H, W] is rebuilt below
    height, width = sample["image"].shape[:2]
    if boxes is not None:
        if boxes.ndim != 2 or boxes.shape[1] < 4:
            raise ValueError(f"boxes must be [N, 4] (xyxy pixels), got {list(boxes.shape)}")
        data["bboxes"] = _to_format(boxes, bbox_format, (height, width))
        data[BOX_OBJECT] = np.arange(len(boxes))
    if keypoints is not None:
        if keypoints.ndim != 3 or keypoints.shape[2] < 2:
            raise ValueError(f"keypoints must be [N, K, 2 or more] (x, y, ...), got {list(keypoints.shape)}")
        data["keypoints"] = keypoints.reshape(-1, keypoints.shape[2])
        data[KEYPOINT_OBJECT] = np.repeat(np.arange(len(keypoints)), keypoints.shape[1])
    out = call(**data)
    result = dict(sample)
    result["image"] = out["image"]
    if "mask" in sample:
        result["mask"] = _same_dtype(out["mask"], sample["mask"])
    kept = None
    if boxes is not None:
        kept = np.asarray(out[BOX_OBJECT], np.int64)
        result["boxes"] = np.asarray(out["bboxes"]).reshape(-1, boxes.shape[1]).astype(boxes.dtype, copy=False)
    if keypoints is not None:
        moved = np.asarray(out["keypoints"])
        if not np.array_equal(np.asarray(out[KEYPOINT_OBJECT]), data[KEYPOINT_OBJECT]):
            raise ValueError("the pipeline dropped keypoints; batchd keeps each object's K keypoints "
                             "(keypoint_params remove_invisible must be false)")
        result["keypoints"] = moved.reshape(keypoints.shape).astype(keypoints.dtype, copy=False)
    if masks is not None:
        if len(masks):
            result["masks"] = _same_dtype(np.asarray(out["masks"]), masks)
        else:
            result["masks"] = np.zeros((0, *out["image"].shape[:2], *masks.shape[3:]), masks.dtype)
    if kept is not None and n:
        for name, value in sample.items():
            if name != "boxes" and per_object(name):
                result[name] = result[name][kept]
    return result


def _bbox_params(given: dict | None) -> dict:
    params = dict(given or {"format": "pascal_voc"})
    if params.get("format") not in _BOX_FORMATS:
        raise ValueError(f"bbox_params format must be one of {list(_BOX_FORMATS)}, got {params.get('format')!r}")
    params["label_fields"] = [BOX_OBJECT]
    # albumentations keeps a box cropped to zero width or height (min_width 0), which a rotation
    # then widens again over no pixels of its object; such an object is gone: drop it
    for side in ("min_width", "min_height"):
        params[side] = max(float(params.get(side) or 0.0), MIN_SIDE)
    return params


def _keypoint_params(given: dict | None) -> dict:
    params = dict(given or {"format": "xy", "remove_invisible": False})
    if params.get("format") != "xy":
        raise ValueError(f"keypoint_params format must be 'xy' (keypoints are [N, K, D] with x, y first), "
                         f"got {params.get('format')!r}")
    if params.get("remove_invisible", True):
        raise ValueError("keypoint_params remove_invisible must be false: batchd keeps each object's K keypoints "
                         "(A.KeypointParams(format='xy', remove_invisible=False))")
    params["label_fields"] = [KEYPOINT_OBJECT]
    return params


def _to_format(boxes: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """xyxy pixel boxes [N, 4+] in albumentations' ``fmt`` (columns after 4 are kept)."""
    if fmt == "pascal_voc" or not len(boxes):
        return boxes
    out = bbox_utils.convert_bboxes_to_albumentations(np.asarray(boxes, np.float64), "pascal_voc", shape)
    return out if fmt == "albumentations" else bbox_utils.convert_bboxes_from_albumentations(out, fmt, shape)


def _same_dtype(out: np.ndarray, like: np.ndarray) -> np.ndarray:
    out = np.asarray(out)
    return out if out.dtype == like.dtype else out.astype(like.dtype)
