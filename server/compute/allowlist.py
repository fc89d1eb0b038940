"""Which albumentations pipelines a client may send: checked on the JSON, before ``A.from_dict``.

``A.from_dict`` builds whatever a dict names, and some transforms read files on the server
(HistogramMatching, FDA and PixelDistributionAdaptation open ``reference_images``; TextImage
opens ``font_path``), others take code (Lambda), and many accept parameters that cost unbounded
memory or time (``Resize(100000, 100000)``, a blur kernel of 100001). So a client's pipeline is
walked first and accepted only if

- every ``__class_fullname__`` is on ``ALLOWED`` (geometric, colour, blur, noise, crop, dropout
  and normalisation transforms that read no files and call no user code);
- every field of a transform is one ``FIELDS`` knows for it, with a value of that field's
  kind (see allowlist_fields.py): numbers finite and bounded, strings short identifiers
  (``"center"``, ``"standard"``), never anything that could be a path; output sizes within
  ``max_side`` / ``max_pixels``, kernels and sigmas within ``max_kernel``;
- the outermost Compose's ``bbox_params`` / ``keypoint_params`` (targets,
  server/compute/targets.py) are null or mappings of the keys albumentations writes, each checked (``format`` one of
  pascal_voc, coco, yolo, albumentations for boxes and xy for keypoints, ``label_fields``
  identifiers, ``min_area``, ``min_visibility``, ``clip``, ``filter_invalid_bboxes``...);
- it has at most ``max_transforms`` transforms, compositions nested at most ``max_depth`` deep
  (a Compose of plain transforms is 1),
  and its JSON is at most ``max_json_bytes``.

Anything else raises ValueError naming the transform, where it is, and the field. Presets from
the server's config are trusted and not checked here.
"""

from __future__ import annotations

import json
import re
from typing import Any

from batchd.server.compute.allowlist_fields import FIELDS, WHOLE, BadValue, short_repr
from batchd.server.config import PipelineLimits

COMPOSITIONS = frozenset({"Compose", "OneOf", "SomeOf", "Sequential"})

ALLOWED = COMPOSITIONS | frozenset({
    # geometry, crops, pads
    "Resize", "RandomCrop", "CenterCrop", "RandomResizedCrop", "RandomSizedCrop", "SmallestMaxSize",
    "LongestMaxSize", "PadIfNeeded", "HorizontalFlip", "VerticalFlip", "Transpose", "RandomRotate90", "D4",
    "SquareSymmetry", "Rotate", "Affine", "ShiftScaleRotate", "Perspective", "ElasticTransform", "GridDistortion",
    "OpticalDistortion",
    # crops that keep boxes (RandomCropNearBBox crops near the box in the sample's field ``cropping_bbox``)
    "RandomSizedBBoxSafeCrop", "BBoxSafeRandomCrop", "AtLeastOneBBoxRandomCrop", "RandomCropNearBBox",
    # colour and tone
    "RandomBrightnessContrast", "HueSaturationValue", "ColorJitter", "RGBShift", "ToGray", "ToSepia",
    "ChannelShuffle", "ChannelDropout", "CLAHE", "Equalize", "Posterize", "Solarize", "InvertImg", "RandomGamma",
    "RandomToneCurve", "FancyPCA", "AutoContrast",
    # blur, sharpen, noise, compression
    "GaussianBlur", "MedianBlur", "MotionBlur", "Blur", "Defocus", "UnsharpMask", "Sharpen", "Emboss", "GaussNoise",
    "ISONoise", "MultiplicativeNoise", "Downscale", "ImageCompression",
    # dropout
    "CoarseDropout", "GridDropout", "PixelDropout",
    # dtype and normalisation
    "Normalize", "ToFloat", "FromFloat",
})

# Refused with a reason: they read server files or run code named by the request.
DANGEROUS = {
    "HistogramMatching": ("reference_images", "reads the files it names on the server"),
    "FDA": ("reference_images", "reads the files it names on the server"),
    "PixelDistributionAdaptation": ("reference_images", "reads the files it names on the server"),
    "TextImage": ("font_path", "reads the font file it names on the server"),
    "Lambda": ("__name__", "runs code, which a request cannot carry"),
    "OneOrOther": ("first", "is not on the allowlist"),
}

_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+-]{0,31}$")


class PipelineRejected(ValueError):
    """A client pipeline is not allowed; the message names transform, place and field."""


def check_text(text: str, limits: PipelineLimits) -> dict[str, Any]:
    """Parse a client's pipeline JSON and check it; returns the dict. Raises PipelineRejected."""
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > limits.max_json_bytes:
        raise PipelineRejected(f"pipeline rejected: its JSON is {size} bytes, over the server's limit of "
                               f"{limits.max_json_bytes} (pipeline_limits.max_json_bytes)")
    try:
        spec = json.loads(text)
    except RecursionError:
        raise PipelineRejected("pipeline rejected: JSON nested too deeply") from None
    except ValueError as e:
        raise PipelineRejected(f"pipeline is not valid JSON: {e}") from None
    check(spec, limits)
    return spec


def check(spec: Any, limits: PipelineLimits) -> None:
    """Raise PipelineRejected unless ``spec`` (an ``A.to_dict`` dict) is an allowed client pipeline."""
    if not isinstance(spec, dict):
        raise PipelineRejected(f"pipeline must be a JSON object as A.to_dict returns, got {type(spec).__name__}")
    for key, value in spec.items():
        if key == "__version__":
            if not (isinstance(value, str) and _VERSION.match(value)):
                raise PipelineRejected("pipeline rejected: __version__ must be a version string such as '2.0.8'")
        elif key != "transform":
            raise PipelineRejected(f"pipeline rejected: unknown top-level field {short_repr(key)} "
                                   "(expected __version__ and transform, as A.to_dict returns)")
    if "transform" not in spec:
        raise PipelineRejected("pipeline dict has no 'transform' key; send what A.to_dict(compose) returns")
    _Walker(limits).transform(spec["transform"], "transform", depth=1)


class _Walker:
    def __init__(self, limits: PipelineLimits):
        self.limits = limits
        self.count = 0

    def transform(self, node: Any, where: str, depth: int) -> None:
        if not isinstance(node, dict):
            raise PipelineRejected(f"pipeline rejected: {where} must be a transform (a JSON object), "
                                   f"got {type(node).__name__}")
        self.count += 1
        if self.count > self.limits.max_transforms:
            raise PipelineRejected(f"pipeline rejected: more than {self.limits.max_transforms} transforms "
                                   "(pipeline_limits.max_transforms)")
        name = node.get("__class_fullname__")
        if not isinstance(name, str):
            raise PipelineRejected(f"pipeline rejected: {where} has no __class_fullname__ string (field __class_fullname__)")
        if name not in ALLOWED:
            field, why = DANGEROUS.get(name, ("__class_fullname__", "is not on the server's allowlist"))
            if name in DANGEROUS:
                raise PipelineRejected(
                    f"pipeline rejected: transform {name} (at {where}) is not allowed in client pipelines: it {why} "
                    f"(field {field}); ask the server's operator for a preset that uses it")
            raise PipelineRejected(
                f"pipeline rejected: transform {short_repr(name)} (at {where}, field __class_fullname__) {why} "
                "for client pipelines (only file-free image transforms are; see the README's Security section)")
        if name in COMPOSITIONS and depth > self.limits.max_depth:
            raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) field 'transforms': compositions "
                                   f"nested more than {self.limits.max_depth} deep (pipeline_limits.max_depth)")
        fields = FIELDS[name]
        for field in ("bbox_params", "keypoint_params"):
            if depth > 1 and node.get(field):
                raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) field {field!r}: only the "
                                       "outermost Compose may carry it (it says how the sample's targets are read)")
        for field, value in node.items():
            if field == "__class_fullname__":
                continue
            kind = fields.get(field)
            if kind is None:
                raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) field {short_repr(field)} "
                                       "is not a field this server accepts for it")
            if field == "transforms":
                self.children(name, value, where, depth)
                continue
            try:
                kind(value, self.limits)
            except BadValue as e:
                raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) field {field!r}: {e}") from None
        check_whole = WHOLE.get(name)
        if check_whole is not None:
            try:
                check_whole(node, self.limits)
            except BadValue as e:
                raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) {e}") from None

    def children(self, name: str, value: Any, where: str, depth: int) -> None:
        if not isinstance(value, (list, tuple)):
            raise PipelineRejected(f"pipeline rejected: transform {name} (at {where}) field 'transforms' must be a list")
        for i, child in enumerate(value):
            self.transform(child, f"{where}.transforms[{i}]", depth + 1)
