"""What each field of an allowed transform may hold (allowlist.py walks the pipeline and asks here).

- ``FIELDS[name]``: the fields transform ``name`` accepts (its ``__init__`` parameters plus what
  ``A.to_dict`` writes for it), each mapped to its value kind: a function ``kind(value, limits)``
  that raises ``BadValue`` unless the value is of that kind and within ``PipelineLimits``
  (numbers finite and bounded, strings short identifiers, sizes within ``max_side``, kernels
  within ``max_kernel``). A field means the same thing in every transform that has it.
- ``WHOLE[name]``: a check of the transform as a whole (output height x width within
  ``max_pixels``), run after its fields.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable

from batchd.server.config import PipelineLimits

_IDENT = re.compile(r"^[A-Za-z][A-Za-z0-9_]{0,31}$")  # enum-like strings: no '/', '.', '~', ':' or '\'
_MAX_NUMBER = 1e9  # any number (pixel values, angles, seeds are far below)
_MAX_LIST = 16  # elements of a list-valued field
_MAX_FLAG = 64  # cv2 interpolation / border flags are small integers
_MAX_COUNT = 1024  # holes, grid steps, ...


class BadValue(Exception):
    """A value failed its field's check (the message says why)."""


def short_repr(s: Any) -> str:
    """``repr(s)`` cut to 40 characters, for error messages (a request may send anything)."""
    text = repr(s)
    return text if len(text) <= 40 else text[:37] + "..."


# --- value kinds ------------------------------------------------------------------------------


def _numbers(value: Any, *, nested: int = 2) -> list[float]:
    """The numbers in a number, a list of numbers/nulls (nested ``nested`` deep) or an {x, y} dict."""
    if value is None:
        return []
    if isinstance(value, bool):
        return [int(value)]
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise BadValue(f"{value} is not a finite number")
        if abs(value) > _MAX_NUMBER:
            raise BadValue(f"{value} is out of range (|x| <= {_MAX_NUMBER:g})")
        return [value]
    if nested > 0 and isinstance(value, (list, tuple)):
        if len(value) > _MAX_LIST:
            raise BadValue(f"a list of {len(value)} values (at most {_MAX_LIST})")
        return [x for v in value for x in _numbers(v, nested=nested - 1)]
    if nested > 0 and isinstance(value, dict):
        if not set(value) <= {"x", "y"}:
            raise BadValue(f"a mapping may only have keys 'x' and 'y', got {sorted(map(str, value))[:4]}")
        return [x for v in value.values() for x in _numbers(v, nested=nested - 1)]
    raise BadValue(f"expected a number or a list of numbers, got {type(value).__name__}")


def number(value: Any, limits: PipelineLimits) -> None:
    _numbers(value)


def _bounded(bound: Callable[[PipelineLimits], int], what: str, *, positive: bool = False) -> Callable:
    def check_value(value: Any, limits: PipelineLimits) -> None:
        top = bound(limits)
        for x in _numbers(value):
            if x > top or (positive and x < 1) or x < -top:
                raise BadValue(f"{x:g} is over the server's limit of {top} ({what})" if x > top
                           else f"{x:g} is out of range")
    return check_value


side = _bounded(lambda lim: lim.max_side, "pipeline_limits.max_side", positive=True)
kernel = _bounded(lambda lim: lim.max_kernel, "pipeline_limits.max_kernel")
flag = _bounded(lambda lim: _MAX_FLAG, "a cv2 flag")
count = _bounded(lambda lim: _MAX_COUNT, "at most this many")
channels = _bounded(lambda lim: 4, "at most 4 channels")
transforms_count = _bounded(lambda lim: lim.max_transforms, "pipeline_limits.max_transforms")


def hole(value: Any, limits: PipelineLimits) -> None:
    """Hole sizes: fractions of the image, or pixels up to max_side."""
    for x in _numbers(value):
        if not 0 <= x <= limits.max_side:
            raise BadValue(f"{x:g} is outside [0, {limits.max_side}] (pipeline_limits.max_side)")


def probability(value: Any, limits: PipelineLimits) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise BadValue(f"expected a probability in [0, 1], got {short_repr(value)}")


def boolean(value: Any, limits: PipelineLimits) -> None:
    if not isinstance(value, bool):
        raise BadValue(f"expected true or false, got {short_repr(value)}")


def false_only(value: Any, limits: PipelineLimits) -> None:
    if value not in (False, None):
        raise BadValue("must be false for client pipelines (the output size would depend on the parameters)")


def enum(value: Any, limits: PipelineLimits) -> None:
    """A short identifier-like string (or a small number, or null); never anything path-like."""
    if value is None or (isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) <= _MAX_FLAG):
        return
    if not (isinstance(value, str) and _IDENT.match(value)):
        raise BadValue(f"expected a short name such as 'center', got {short_repr(value)}")


def null_only(value: Any, limits: PipelineLimits) -> None:
    if value not in (None, {}, []):
        raise BadValue("must be null for client pipelines (the server hands the sample's own fields to the "
                       "pipeline: image, mask, masks, boxes, keypoints)")


def seed(value: Any, limits: PipelineLimits) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 32):
        raise BadValue(f"expected null or an integer in [0, 2**32), got {short_repr(value)}")


def flag_pair(value: Any, limits: PipelineLimits) -> None:
    """Downscale's interpolation_pair: {"upscale": flag, "downscale": flag}."""
    if not isinstance(value, dict) or not set(value) <= {"upscale", "downscale"}:
        raise BadValue("expected {'upscale': flag, 'downscale': flag}")
    for v in value.values():
        flag(v, limits)


def fill(value: Any, limits: PipelineLimits) -> None:
    """A fill value (numbers) or a fill method such as CoarseDropout's 'random'."""
    if isinstance(value, str):
        enum(value, limits)
    else:
        _numbers(value)


def noise_params(value: Any, limits: PipelineLimits) -> None:
    """RGBShift's serialized noise settings (ignored when built): identifiers and numbers only."""
    if value is None:
        return
    if not isinstance(value, dict) or len(value) > 8:
        raise BadValue("expected a small mapping")
    for k, v in value.items():
        if not _IDENT.match(str(k)):
            raise BadValue(f"key {short_repr(k)} is not a short name")
        if isinstance(v, str):
            enum(v, limits)
        else:
            _numbers(v, nested=3)


def _params(value: Any, limits: PipelineLimits, keys: dict[str, Callable[[Any, PipelineLimits], None]]) -> None:
    """A Compose's bbox_params / keypoint_params: null, or a mapping of the ``keys`` it may have."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise BadValue(f"expected null or a mapping, got {type(value).__name__}")
    for key, v in value.items():
        check = keys.get(key)
        if check is None:
            raise BadValue(f"key {short_repr(key)} is not one this server accepts (it accepts {', '.join(sorted(keys))})")
        try:
            check(v, limits)
        except BadValue as e:
            raise BadValue(f"key {key!r}: {e}") from None


def _one_of(*names: str) -> Callable[[Any, PipelineLimits], None]:
    def check_value(value: Any, limits: PipelineLimits) -> None:
        if value not in names:
            raise BadValue(f"expected one of {', '.join(map(repr, names))}, got {short_repr(value)}")
    return check_value


def label_fields(value: Any, limits: PipelineLimits) -> None:
    """Names of the sample's per-object fields (null or a short list of identifiers)."""
    if value is None:
        return
    if not isinstance(value, (list, tuple)) or len(value) > _MAX_LIST:
        raise BadValue(f"expected a list of at most {_MAX_LIST} field names")
    for name in value:
        if not (isinstance(name, str) and _IDENT.match(name)):
            raise BadValue(f"expected field names such as 'labels', got {short_repr(name)}")


def _non_negative(value: Any, limits: PipelineLimits) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= _MAX_NUMBER:
        raise BadValue(f"expected a number >= 0, got {short_repr(value)}")


def _ratio(value: Any, limits: PipelineLimits) -> None:
    if value is not None:
        _non_negative(value, limits)


def _invisible(value: Any, limits: PipelineLimits) -> None:
    if value is not False:
        raise BadValue("must be false: batchd keeps each object's K keypoints (A.KeypointParams(format='xy', "
                       "remove_invisible=False))")


def bbox_params(value: Any, limits: PipelineLimits) -> None:
    """A Compose's BboxParams (server/compute/targets.py): the format of the boxes the pipeline works
    in and returns, and albumentations' filters. label_fields name per-object fields."""
    _params(value, limits, {
        "format": _one_of("pascal_voc", "coco", "yolo", "albumentations"), "label_fields": label_fields,
        "min_area": _non_negative, "min_visibility": probability, "min_width": _non_negative,
        "min_height": _non_negative, "check_each_transform": boolean, "clip": boolean,
        "filter_invalid_bboxes": boolean, "max_accept_ratio": _ratio,
    })


def keypoint_params(value: Any, limits: PipelineLimits) -> None:
    """A Compose's KeypointParams: format "xy" (keypoints are [N, K, D], x and y first) and
    remove_invisible false (each object keeps its K points)."""
    _params(value, limits, {
        "format": _one_of("xy"), "label_fields": label_fields, "remove_invisible": _invisible,
        "angle_in_degrees": boolean, "check_each_transform": boolean,
    })


def transforms(value: Any, limits: PipelineLimits) -> None:  # walked by allowlist._Walker.children
    raise AssertionError("unreachable")


# Field name -> kind. A field means the same thing in every transform that has it.
_KINDS: dict[str, Callable[[Any, PipelineLimits], None]] = {
    "transforms": transforms,
    "p": probability,
    # output sizes
    "height": side, "width": side, "size": side, "min_max_height": side, "max_size": side, "max_size_hw": side,
    "min_height": side, "min_width": side, "pad_height_divisor": side, "pad_width_divisor": side,
    "unit_size_range": side,
    # kernels and sigmas
    "blur_limit": kernel, "kernel_size": kernel, "tile_grid_size": kernel, "radius": kernel, "sigma": kernel,
    "sigma_limit": kernel,
    # counts
    "n": transforms_count, "num_holes_range": count, "holes_number_xy": count, "num_steps": count,
    "num_bits": count, "num_output_channels": channels, "channel_drop_range": count,
    "hole_height_range": hole, "hole_width_range": hole,
    # cv2 flags
    "interpolation": flag, "mask_interpolation": flag, "border_mode": flag, "interpolation_pair": flag_pair,
    # names
    "pad_position": enum, "position": enum, "rotate_method": enum, "method": enum, "mode": enum,
    "normalization": enum, "noise_distribution": enum, "keypoint_remapping_method": enum, "compression_type": enum,
    "dtype": enum, "noise_type": enum, "spatial_mode": enum, "area_for_downscale": enum,
    "cropping_bbox_key": enum,  # RandomCropNearBBox: the name of the sample's field with the box to crop near
    # booleans
    "replace": boolean, "pad_if_needed": boolean, "crop_border": boolean, "keep_ratio": boolean,
    "balanced_scale": boolean, "keep_size": boolean, "approximate": boolean, "same_dxdy": boolean,
    "normalized": boolean, "brightness_by_max": boolean, "ensure_safe_range": boolean, "by_channels": boolean,
    "allow_shifted": boolean, "per_channel": boolean, "elementwise": boolean, "random_offset": boolean,
    "is_check_shapes": boolean, "strict": boolean, "save_applied_params": boolean,
    "fit_output": false_only, "fill": fill, "fill_mask": fill,
    # plain numbers (bounded, finite)
    **{name: number for name in (
        "limit", "scale", "translate_percent", "translate_px", "rotate", "shear", "shift_limit", "shift_limit_x",
        "shift_limit_y", "scale_limit", "rotate_limit", "alpha", "distort_limit", "brightness_limit",
        "contrast_limit", "hue_shift_limit", "sat_shift_limit", "val_shift_limit", "brightness", "contrast",
        "saturation", "hue", "r_shift_limit", "g_shift_limit", "b_shift_limit", "approximation", "clip_limit",
        "threshold_range", "gamma_limit", "angle_range", "direction_range", "std_range", "mean_range",
        "noise_scale_factor", "color_shift", "intensity", "lightness", "strength", "mean", "std",
        "max_pixel_value", "max_value", "scale_range", "quality_range", "ratio", "w2h_ratio",
        "multiplier", "cutoff", "ignore", "alias_blur", "threshold", "dropout_prob", "drop_value",
        "mask_drop_value", "shift_xy", "padding", "erosion_rate", "erosion_factor", "max_part_shift",
    )},
    # Compose: targets (server/compute/targets.py); the sample's fields are its own, never renamed
    "bbox_params": bbox_params, "keypoint_params": keypoint_params, "additional_targets": null_only, "mask": null_only,
    "mask_params": null_only, "seed": seed, "noise_params": noise_params,
}


def _fields(cls_name: str) -> dict[str, Callable]:
    """The fields ``cls_name`` accepts: its __init__ parameters plus what A.to_dict writes for it."""
    import inspect

    import albumentations as A

    cls = getattr(A, cls_name)
    names = {p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "args", "kwargs")}
    names |= _EXTRA.get(cls_name, set())
    missing = names - set(_KINDS)
    if missing:  # a new albumentations version added a parameter: refuse it until classified here
        names -= missing
    return {n: _KINDS[n] for n in names}


# Fields A.to_dict writes that are not __init__ parameters (albumentations ignores them when building).
_EXTRA = {
    "PadIfNeeded": {"padding"},
    "RGBShift": {"approximation", "noise_params", "noise_type", "spatial_mode"},
}


class _LazyFields(dict):
    def __missing__(self, key: str) -> dict[str, Callable]:
        value = self[key] = _fields(key)
        return value


FIELDS: dict[str, dict[str, Callable]] = _LazyFields()


# --- whole-transform checks (output pixels) ---------------------------------------------------


def _pixels(h: Any, w: Any, what: str, limits: PipelineLimits) -> None:
    if isinstance(h, (int, float)) and isinstance(w, (int, float)) and h * w > limits.max_pixels:
        raise BadValue(f"{what}: {h:g} x {w:g} = {h * w:g} pixels is over the server's limit of {limits.max_pixels} "
                   "(pipeline_limits.max_pixels)")


def _pair(value: Any) -> tuple[Any, Any]:
    if isinstance(value, (list, tuple)) and len(value) == 2:
        return value[0], value[1]
    return value, value


def _height_width(node: dict, limits: PipelineLimits) -> None:
    _pixels(node.get("height"), node.get("width"), "fields 'height' x 'width'", limits)


def _size(node: dict, limits: PipelineLimits) -> None:
    _pixels(*_pair(node.get("size")), "field 'size'", limits)


def _min_size(node: dict, limits: PipelineLimits) -> None:
    _pixels(node.get("min_height"), node.get("min_width"), "fields 'min_height' x 'min_width'", limits)


def _longest(node: dict, limits: PipelineLimits) -> None:
    sizes = node.get("max_size")
    for s in sizes if isinstance(sizes, (list, tuple)) else [sizes]:
        _pixels(s, s, "field 'max_size'", limits)
    _pixels(*_pair(node.get("max_size_hw")), "field 'max_size_hw'", limits)


WHOLE: dict[str, Callable[[dict, PipelineLimits], None]] = {
    "Resize": _height_width, "RandomCrop": _height_width, "CenterCrop": _height_width,
    "RandomSizedBBoxSafeCrop": _height_width, "AtLeastOneBBoxRandomCrop": _height_width,
    "RandomResizedCrop": _size, "RandomSizedCrop": _size, "PadIfNeeded": _min_size, "LongestMaxSize": _longest,
}
