"""Targets through albumentations: boxes, masks and keypoints move with the image; per-object fields stay aligned.

A sample's fields meet a pipeline's ``Compose`` as albumentations targets:

* ``image`` -> ``image=``; ``mask`` (semantic segmentation, [H, W]) -> ``mask=``; ``masks``
  ([N, H, W], one per object) -> ``masks=``;
* ``boxes`` (float32 [N, 4], xyxy in pixels) -> ``bboxes=`` in the pipeline's ``BboxParams`` format;
* ``keypoints`` ([N, K, D], D >= 2: x, y, then e.g. visibility) -> ``keypoints=`` as N*K points
  under ``KeypointParams(format="xy", remove_invisible=False)``; columns after x, y travel along.

So a flip, crop, resize or rotation moves every target with the image, drawn from the sample's one
random stream (the Compose's transforms draw from it, ``pipeline.SampleRandom``).

**One Compose, in two stages.** A pipeline is ONE albumentations ``Compose`` (per kind of sample:
with or without boxes, keypoints), run as ``Compose.__call__`` runs it: the boxes are converted
into the pipeline's format once, at its edge (albumentations' own converters), ``preprocess``
takes them into albumentations' internal format, each transform is followed by
``check_data_post_transform`` (the filters, when ``check_each_transform``), and ``postprocess``
filters and converts back into the pipeline's format at the other edge. ``begin`` runs
``preprocess`` and the deterministic prefix (``prefix.py``: sealed copies of the first
``prefix`` transforms, which raise ``prefix.RandomDrawn`` if drawn from); its output, the
*state*, is what the cache stores (image, masks and the internal boxes and keypoints). ``end``
draws the Compose's own ``random() < p`` (a prefix exists only at p = 1, and it drew nothing, so
the stream is consumed exactly as by one call), runs the remaining transforms with their checks,
and ``postprocess``. Nothing is converted, clipped or filtered between the two stages that one
Compose would not, so prefix or not, cache or not, ``check_each_transform`` true or false, the
targets are those of one Compose (tests/compute/test_targets_oracle.py, every allowlisted dual
transform and bbox format).

**What differs from one plain Compose** (docs/targets.md): ``min_width`` / ``min_height`` are at
least ``MIN_SIDE`` (albumentations keeps boxes cropped to zero width, and a later rotation widens
them again over none of their object's pixels), and masks and every other per-object field drop
with their boxes (albumentations never drops masks itself).

**Objects stay aligned.** Every box and every keypoint carries its object number in a last
column of its own (the user's ``label_fields`` are not needed: each name given must be a
per-object field of the sample, and every per-object field follows the boxes anyway); when
albumentations drops a box (cropped away, under ``min_area`` or ``min_visibility``), every
per-object field of the sample (``labels``, ``masks``, ``keypoints``, ``iscrowd``, ``area``, the
dataset's own; ``FieldSpec.per_object``) is indexed with the surviving numbers. Keypoints are
never dropped on their own (``remove_invisible`` must be false; a transform that drops points
anyway, such as ElasticTransform for points it moves out of the image, is an error naming it):
an object keeps its K points, in or out of the image. Other fields (Python ints, floats, str,
bytes, other arrays) pass through untouched; ``area`` is not recomputed. Boxes and keypoints
go in and come out as float32, whatever dtype the sample gave (int64 boxes are neither truncated
nor, in the normalised formats, turned into zeros); masks keep their dtype (albumentations may
widen them).

**A guide box.** ``RandomCropNearBBox`` crops near the box of the data key it names
(``cropping_bbox_key``, "cropping_bbox" by default, [x_min, y_min, x_max, y_max] in whole pixels,
as albumentations takes it): the sample's field of that name is handed to the Compose under that
key, and passes through as it is.

**Params.** A Compose's own ``bbox_params`` / ``keypoint_params`` are used (a client's are
allowlisted, ``allowlist_fields.bbox_params``). Without them, a sample with boxes gets
``BboxParams(format="pascal_voc")`` and one with keypoints ``KeypointParams(format="xy",
remove_invisible=False)``. The boxes come out in the params' format (pascal_voc, coco, yolo,
albumentations).
"""

from __future__ import annotations

import json
from typing import Any, Callable

import albumentations as A
import numpy as np
from albumentations.core import bbox_utils

from batchd.server.compute import prefix as prefixes

GEOMETRIC = ("boxes", "keypoints")  # fields that need a processor (bbox_params / keypoint_params)
_BOX_FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")
MIN_SIDE = 0.01  # pixels: a box thinner than this after a transform was cut away (its object is dropped)
# the state's fields (``TargetPipeline.begin``): boxes and keypoints in albumentations' internal
# format, each with its object number in the last column, and the targets' dtypes
STATE_BOXES, STATE_KEYPOINTS, STATE_DTYPES = "batchd_state_bboxes", "batchd_state_keypoints", "batchd_state_dtypes"
_TARGETS = ("image", "mask", "masks")


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
    """An albumentations Compose applied to sample dicts, whole or in two stages (module docstring).

    ``spec``: the Compose as ``A.to_dict`` returns it; ``compose``: that Compose itself, used as
    it is for samples without boxes or keypoints when it has no bbox/keypoint params (so those
    samples are augmented exactly as an image-only pipeline augments them). ``attach(compose)`` is
    called on every Compose built here (``SampleRandom.attach``: they draw from the sample's
    stream). ``prefix``: how many leading transforms ``begin`` runs (the deterministic prefix,
    ``prefix.split``; 0: ``begin`` returns the sample as it is).
    """

    def __init__(self, spec: dict[str, Any], compose: A.Compose | None = None,
                 attach: Callable[[A.Compose], None] | None = None, prefix: int = 0):
        self.spec = spec
        top = spec["transform"]
        self.bbox_params = top.get("bbox_params") or None
        self.keypoint_params = top.get("keypoint_params") or None
        self.prefix = prefix
        self.guides = _guide_keys(top)  # RandomCropNearBBox's cropping_bbox_key(s): sample fields handed over
        self._attach = attach
        self._variants: dict[tuple[bool, bool], tuple[A.Compose, tuple[Any, ...]]] = {}
        if compose is not None and self.bbox_params is None and self.keypoint_params is None:
            self._variants[(False, False)] = (compose, self._sealed(compose))

    @classmethod
    def of(cls, compose: A.Compose, attach: Callable[[A.Compose], None] | None = None,
           prefix: int = 0) -> "TargetPipeline":
        return cls(A.to_dict(compose), compose, attach, prefix)

    def __call__(self, sample: dict, per_object: Callable[[str], bool]) -> dict:
        """The sample after the whole Compose (one ``Compose.__call__``)."""
        return self.end(sample, per_object, prefixed=False)

    def begin(self, sample: dict, per_object: Callable[[str], bool]) -> dict:
        """The state of ``sample`` after ``preprocess`` and the prefix transforms (sealed: raises
        ``prefix.RandomDrawn`` if one would draw for this sample): the sample's fields, with
        image, mask and masks transformed and boxes and keypoints in albumentations' internal
        format (``STATE_BOXES``, ``STATE_KEYPOINTS``; arrays, so the cache can store it). The
        sample itself when there is no prefix. Raises ValueError for targets that do not fit."""
        if not self.prefix:
            return sample
        compose, sealed = self._variant(sample, per_object)
        data = _targets_in(sample, per_object, self._format(), self.guides)
        compose.preprocess(data)
        for t in sealed:
            data = compose.check_data_post_transform(t(**data))
        state = dict(sample)
        for name in _TARGETS:
            if name in data:
                state[name] = data[name]
        if "bboxes" in data:
            state[STATE_BOXES] = np.asarray(data["bboxes"])
        if "keypoints" in data:
            state[STATE_KEYPOINTS] = np.asarray(data["keypoints"])
        dtypes = [f"{name}={sample[name].dtype.str}" for name in ("mask", "masks") if name in sample]
        if dtypes:  # "mask=|u1,masks=|u1": what end() casts them back to (albumentations may widen them)
            state[STATE_DTYPES] = ",".join(dtypes)
        return state

    def end(self, state: dict, per_object: Callable[[str], bool], prefixed: bool) -> dict:
        """The sample after the pipeline: from ``begin``'s state (``prefixed``: the Compose's
        p draw, the transforms after the prefix, ``postprocess``), or from the decoded sample
        (the whole Compose). Raises ValueError for targets that do not fit."""
        if not (prefixed and self.prefix):
            compose, _ = self._variant(state, per_object)
            return _targets_out(compose(**_targets_in(state, per_object, self._format(), self.guides)), state, per_object)
        compose, _ = self._variant(state, per_object)
        dtypes = dict(part.split("=") for part in str(state[STATE_DTYPES]).split(",")) if STATE_DTYPES in state else {}
        data = {name: state[name] for name in _TARGETS if name in state}
        data.update(_guide_values(state, self.guides))
        if "masks" in data and not len(data["masks"]):
            del data["masks"]  # albumentations cannot stack 0 masks (_targets_in)
        if STATE_BOXES in state:
            data["bboxes"] = state[STATE_BOXES]
        if STATE_KEYPOINTS in state:
            data["keypoints"] = state[STATE_KEYPOINTS]
        compose.py_random.random()  # Compose.__call__'s `random() < p` (p is 1: a prefix exists only then)
        for t in compose.transforms[self.prefix:]:
            data = compose.check_data_post_transform(t(**data))
        out = compose.postprocess(data)
        sample = {k: v for k, v in state.items() if k not in (STATE_BOXES, STATE_KEYPOINTS, STATE_DTYPES)}
        return _targets_out(out, sample, per_object, {name: np.dtype(d) for name, d in dtypes.items()})

    @property
    def boxes_inside(self) -> bool:
        """Whether a sample's boxes must lie inside its image: albumentations refuses others
        unless the bbox params ``clip`` them (``sample_checks.check_targets``)."""
        return not (self.bbox_params or {}).get("clip", False)

    def end_first(self, sample: dict, per_object: Callable[[str], bool], first: Any, drawn: Any) -> dict:
        """The sample after the pipeline, its first transform drawn ahead of decoding
        (server/compute/region.py: ``first`` a ``FirstStep``, ``drawn`` its ``Drawn`` for this
        sample; the stream stands after those draws). ``sample``'s image is decoded at
        ``drawn.eighths``/8 of the full frame ``drawn.shape``; every other field is the full
        decode's. As ``Compose.__call__`` runs it: ``preprocess`` on the full frame (a stand-in
        image of its shape: boxes are converted with it), the first transform (its image from
        ``first.image``, its other targets from its own ``apply_with_params``), each later
        transform with its checks, ``postprocess``. Raises ValueError for targets that do not fit."""
        compose, _ = self._variant(sample, per_object)
        image = sample["image"]
        stand_in = np.broadcast_to(np.zeros((1, 1, 1), image.dtype), (*drawn.shape, image.shape[2]))
        data = _targets_in({**sample, "image": stand_in}, per_object, self._format(), self.guides)
        compose.preprocess(data)
        if drawn.params is None:  # the first transform's own p skipped it: the image is a full decode
            data["image"] = image
        else:
            others = {k: v for k, v in data.items() if k != "image"}
            data = compose.transforms[0].apply_with_params(drawn.params, **others)
            data["image"] = first.image(image, drawn)
        data = compose.check_data_post_transform(data)
        for t in compose.transforms[1:]:
            data = compose.check_data_post_transform(t(**data))
        return _targets_out(compose.postprocess(data), sample, per_object)

    def params_name(self) -> str:
        """The bbox and keypoint params ``begin``'s state depends on, as canonical text: part of
        a cache entry's name, since a crop under ``min_visibility`` keeps other boxes than one
        without, and each format converts into the internal one with its own rounding."""
        if not self.prefix or (self.bbox_params is None and self.keypoint_params is None):
            return ""  # no prefix: the state is the decoded sample; no params: the defaults, always the same
        return "|targets:" + json.dumps([self.bbox_params, self.keypoint_params], sort_keys=True, default=str)

    def _format(self) -> str:
        return (self.bbox_params or {}).get("format", "pascal_voc")

    def _sealed(self, compose: A.Compose) -> tuple[Any, ...]:
        return tuple(prefixes.sealed(t) for t in compose.transforms[:self.prefix])

    def _variant(self, sample: dict, per_object: Callable[[str], bool]) -> tuple[A.Compose, tuple[Any, ...]]:
        """(the Compose for a sample with (or without) boxes and keypoints, sealed copies of its
        prefix transforms), built once each."""
        boxes = "boxes" in sample or STATE_BOXES in sample
        keypoints = "keypoints" in sample or STATE_KEYPOINTS in sample
        key = (boxes, keypoints)
        built = self._variants.get(key)
        if built is not None:
            return built
        for params in (self.bbox_params if boxes else None, self.keypoint_params if keypoints else None):
            for name in (params or {}).get("label_fields") or ():
                if name not in sample or not per_object(name):
                    raise ValueError(f"label_fields names {name!r}, which is not a per-object field of the sample "
                                     f"(per-object fields: {sorted(f for f in sample if per_object(f))}); every "
                                     "per-object field follows the boxes anyway")
        top = dict(self.spec["transform"])
        top["bbox_params"] = _bbox_params(self.bbox_params) if boxes else None
        top["keypoint_params"] = _keypoint_params(self.keypoint_params) if keypoints else None
        try:
            compose = A.from_dict({**self.spec, "transform": top})
        except Exception as e:  # albumentations raises ValueError, KeyError, pydantic errors...
            raise ValueError(f"albumentations cannot build the pipeline with targets: {type(e).__name__}: {e}") from None
        if self._attach is not None:
            self._attach(compose)
        built = self._variants[key] = (compose, self._sealed(compose))
        return built


def _targets_in(sample: dict, per_object: Callable[[str], bool], bbox_format: str,
                guides: tuple[str, ...] = ()) -> dict[str, Any]:
    """The sample's targets as a Compose takes them: image, mask, masks (unless there are none:
    albumentations cannot stack 0 masks), bboxes in ``bbox_format`` and keypoints [N*K, D] (both
    float32), each box and point with its object number as a last column, and the ``guides``
    fields the sample has (RandomCropNearBBox's box: 4 whole pixels). Raises ValueError for targets
    that do not fit (per-object fields of different N, keypoints not [N, K, >= 2], boxes not [N, >= 4])."""
    if "image" not in sample:
        raise ValueError(f"the pipeline needs an 'image' field; the sample has {sorted(sample)}")
    check_objects(sample, per_object)
    data: dict[str, Any] = {"image": sample["image"]}
    if "mask" in sample:
        data["mask"] = sample["mask"]
    masks = sample.get("masks")
    if masks is not None and len(masks):
        data["masks"] = masks
    data.update(_guide_values(sample, guides))
    boxes, keypoints = _float32(sample.get("boxes")), _float32(sample.get("keypoints"))
    if boxes is not None:
        if boxes.ndim != 2 or boxes.shape[1] < 4:
            raise ValueError(f"boxes must be [N, 4] (xyxy pixels), got {list(boxes.shape)}")
        converted = _to_format(boxes, bbox_format, sample["image"].shape[:2])
        data["bboxes"] = np.column_stack([converted, np.arange(len(boxes), dtype=converted.dtype)])
    if keypoints is not None:
        if keypoints.ndim != 3 or keypoints.shape[2] < 2:
            raise ValueError(f"keypoints must be [N, K, 2 or more] (x, y, ...), got {list(keypoints.shape)}")
        n, k, d = keypoints.shape
        objects = np.repeat(np.arange(n, dtype=keypoints.dtype), k)
        data["keypoints"] = np.column_stack([keypoints.reshape(-1, d), objects])
    return data


def _targets_out(out: dict, sample: dict, per_object: Callable[[str], bool],
                 dtypes: dict[str, np.dtype] | None = None) -> dict:
    """The sample after a Compose gave ``out`` for ``_targets_in(sample)``: a new dict (fields not
    handed to albumentations are the same objects, per-object ones indexed by the surviving boxes).
    ``dtypes``: of mask and masks, when not those of ``sample``'s (a state's may be widened).
    Raises ValueError if the pipeline dropped keypoints."""
    dtypes = dtypes or {}
    result = dict(sample)
    result["image"] = out["image"]
    if "mask" in sample:
        result["mask"] = _same_dtype(out["mask"], dtypes.get("mask", sample["mask"].dtype))
    boxes, keypoints, masks = sample.get("boxes"), sample.get("keypoints"), sample.get("masks")
    kept = None
    if boxes is not None:
        moved = np.asarray(out["bboxes"]).reshape(-1, boxes.shape[1] + 1)
        kept = moved[:, -1].astype(np.int64)
        result["boxes"] = moved[:, :-1].astype(np.float32, copy=False)
    if keypoints is not None:
        n, k, d = keypoints.shape
        moved = np.asarray(out["keypoints"]).reshape(-1, d + 1)
        if not np.array_equal(moved[:, -1].astype(np.int64), np.repeat(np.arange(n), k)):
            raise ValueError("the pipeline dropped keypoints; batchd keeps each object's K keypoints "
                             "(keypoint_params remove_invisible must be false, and transforms that drop the points "
                             "they move out of the image, such as ElasticTransform, GridDistortion and "
                             "OpticalDistortion, cannot run on samples with keypoints)")
        result["keypoints"] = moved[:, :-1].reshape(keypoints.shape).astype(np.float32, copy=False)
    if masks is not None:
        dtype = dtypes.get("masks", masks.dtype)
        if len(masks):
            result["masks"] = _same_dtype(np.asarray(out["masks"]), dtype)
        else:
            result["masks"] = np.zeros((0, *out["image"].shape[:2], *masks.shape[3:]), dtype)
    if kept is not None and len(boxes):
        for name in sample:
            if name != "boxes" and per_object(name):
                result[name] = result[name][kept]
    return result


def _guide_values(sample: dict, guides: tuple[str, ...]) -> dict[str, list[int]]:
    """The sample's ``guides`` fields as RandomCropNearBBox reads them: lists of whole pixels.
    Raises ValueError naming the field for one that is not 4 whole numbers."""
    out = {}
    for name in guides:
        if name in sample:
            values = np.asarray(sample[name], np.float64).reshape(-1)
            if values.shape != (4,) or not np.all(np.isfinite(values) & (values == np.round(values))):
                raise ValueError(f"RandomCropNearBBox reads field {name!r} as a box in whole pixels [x_min, y_min, "
                                 f"x_max, y_max]; the sample's is {np.asarray(sample[name]).tolist()}")
            out[name] = [int(v) for v in values]
    return out


def _guide_keys(node: Any) -> tuple[str, ...]:
    """The ``cropping_bbox_key`` of every RandomCropNearBBox in a Compose's ``A.to_dict`` node."""
    if not isinstance(node, dict):
        return ()
    keys: tuple[str, ...] = ()
    if node.get("__class_fullname__") == "RandomCropNearBBox":
        keys = (str(node.get("cropping_bbox_key") or "cropping_bbox"),)
    for child in node.get("transforms") or ():
        keys += tuple(k for k in _guide_keys(child) if k not in keys)
    return keys


def _bbox_params(given: dict | None) -> dict:
    params = dict(given or {"format": "pascal_voc"})
    if params.get("format") not in _BOX_FORMATS:
        raise ValueError(f"bbox_params format must be one of {list(_BOX_FORMATS)}, got {params.get('format')!r}")
    params["label_fields"] = None  # each box's object number is a column of its own (_targets_in)
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
    params["label_fields"] = None  # each point's object number is a column of its own (_targets_in)
    return params


def _to_format(boxes: np.ndarray, fmt: str, shape: tuple[int, int]) -> np.ndarray:
    """xyxy pixel boxes [N, 4+] in albumentations' ``fmt`` (columns after 4 are kept)."""
    if fmt == "pascal_voc" or not len(boxes):
        return boxes
    out = bbox_utils.convert_bboxes_to_albumentations(boxes, "pascal_voc", shape)
    return out if fmt == "albumentations" else bbox_utils.convert_bboxes_from_albumentations(out, fmt, shape)


def _float32(values: Any) -> np.ndarray | None:
    """Boxes or keypoints as float32 (None stays None): what the pipeline works in and returns."""
    return None if values is None else np.asarray(values, np.float32)


def _same_dtype(out: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = np.asarray(out)
    return out if out.dtype == dtype else out.astype(dtype)
