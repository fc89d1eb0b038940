"""A JPEG's EXIF orientation applied to a sample: image, masks, boxes and keypoints turned together.

EXIF orientation ``o`` (1-8, TIFF tag 0x0112) says how the stored pixels are turned for display;
``ImageOps.exif_transpose`` (Pillow) is the reference: 2 mirrors left-right, 3 turns 180 degrees,
4 mirrors top-bottom, 5 transposes, 6 turns 90 degrees clockwise, 7 transverses, 8 turns 90
degrees counter-clockwise. Each is a transpose (or not) followed by a left-right and/or
top-bottom flip (``STEPS``), applied here the same way to every field with a geometric meaning:

    image     [H, W, C]       -> [H', W', C]  (H', W' = W, H for 5-8)
    mask      [H, W]          -> [H', W']
    masks     [N, H, W]       -> [N, H', W']
    boxes     [N, 4+] xyxy    box edges in pixels: a flip maps x to W' - x (columns after 4 kept)
    keypoints [N, K, 2+]      pixel indices, as albumentations moves them: a flip maps x to W' - 1 - x

Other fields pass through. The kinds with targets (coco, segmentation) call it with
``apply_exif_orientation: true`` (server/config/datasets.py); their annotations and PNG masks
are in the stored frame.
"""

from __future__ import annotations

import numpy as np

# orientation -> (transpose, flip left-right, flip top-bottom), in that order
STEPS = {1: (False, False, False), 2: (False, True, False), 3: (False, True, True), 4: (False, False, True),
         5: (True, False, False), 6: (True, True, False), 7: (True, True, True), 8: (True, False, True)}


def orient_pixels(array: np.ndarray, orientation: int, axes: tuple[int, int] = (0, 1)) -> np.ndarray:
    """``array`` with its (row, column) ``axes`` turned as EXIF ``orientation`` says (a contiguous copy)."""
    transpose, flip_x, flip_y = STEPS[orientation]
    rows, cols = axes
    if transpose:
        array = np.swapaxes(array, rows, cols)
    if flip_x:
        array = np.flip(array, cols)
    if flip_y:
        array = np.flip(array, rows)
    return np.ascontiguousarray(array)


def orient_boxes(boxes: np.ndarray, orientation: int, height: int, width: int) -> np.ndarray:
    """xyxy boxes [N, 4+] of an image ``height`` x ``width`` (stored frame) in the turned frame (same dtype)."""
    transpose, flip_x, flip_y = STEPS[orientation]
    out = boxes.copy()
    if transpose:
        out[:, [0, 1, 2, 3]] = boxes[:, [1, 0, 3, 2]]
        height, width = width, height
    if flip_x:
        out[:, [0, 2]] = width - out[:, [2, 0]]
    if flip_y:
        out[:, [1, 3]] = height - out[:, [3, 1]]
    return out


def orient_keypoints(keypoints: np.ndarray, orientation: int, height: int, width: int) -> np.ndarray:
    """Keypoints [..., 2+] (x, y first) of an image ``height`` x ``width`` in the turned frame."""
    transpose, flip_x, flip_y = STEPS[orientation]
    out = keypoints.copy()
    if transpose:
        out[..., 0], out[..., 1] = keypoints[..., 1], keypoints[..., 0]
        height, width = width, height
    if flip_x:
        out[..., 0] = width - 1 - out[..., 0]
    if flip_y:
        out[..., 1] = height - 1 - out[..., 1]
    return out


def orient_sample(sample: dict, orientation: int, shape: tuple[int, int] | None = None) -> dict:
    """A new sample dict with ``image``, ``mask``, ``masks``, ``boxes`` and ``keypoints`` (those
    present) turned as EXIF ``orientation`` (1-8) says; ``shape`` (height, width) is the stored
    frame's, the image's [H, W] by default (an image decoded at m/8 is turned as its targets,
    which stay in the full frame's pixels). Raises KeyError for an orientation outside 1-8."""
    if orientation == 1:
        return sample
    height, width = sample["image"].shape[:2] if shape is None else shape
    out = dict(sample)
    out["image"] = orient_pixels(sample["image"], orientation)
    if "mask" in sample:
        out["mask"] = orient_pixels(sample["mask"], orientation)
    if "masks" in sample:
        out["masks"] = orient_pixels(sample["masks"], orientation, axes=(1, 2))
    if "boxes" in sample:
        out["boxes"] = orient_boxes(sample["boxes"], orientation, height, width)
    if "keypoints" in sample:
        out["keypoints"] = orient_keypoints(sample["keypoints"], orientation, height, width)
    return out
