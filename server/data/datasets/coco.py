"""COCO detection and instance segmentation: images plus a COCO "instances" JSON (``kind: coco``)."""

from __future__ import annotations

import logging
import pathlib

import numpy as np

from ..decode import DEFAULT_MAX_PIXELS, exif_orientation, upright_size
from ..scaled_jpeg import scaled_size, scaled_window
from ..storage import Storage, StorageOptions, is_remote, local_copy, local_path, safe_url
from ._cache import ArrayFile, cache_path, file_fingerprint, open_cached, remove_stale
from ._files import FileDataset
from ._orientation import orient_pixels, orient_sample
from ._fingerprint import content_fingerprint, with_settings
from .base import FieldSpec
from .coco_index import build_index
from .coco_segments import Segmentations

log = logging.getLogger(__name__)


def _mask_utils(name: str):
    """pycocotools.mask, or ImportError saying how to install it."""
    try:
        from pycocotools import mask
    except ImportError as e:
        raise ImportError(f"dataset {name!r} (coco) has masks: true, which needs pycocotools ({e}): "
                          "pip install 'batchd[coco]' (or pycocotools), or set masks: false") from None
    return mask


class Coco(FileDataset):
    """Images listed in a COCO "instances" JSON, with their annotations (torchvision's
    ``CocoDetection`` with its detection targets).

    Sample i is the image with the i-th smallest id (images without annotations left out if
    ``skip_empty``). ``load_sample(i)``, N its annotations kept (in the JSON's order)::

        image     uint8 [H, W, 3]  RGB, decoded at full size
        boxes     float32 [N, 4]   x1, y1, x2, y2 in pixels (torchvision's XYXY): ``bbox``
                                   [x, y, w, h] -> [x, y, x + w, y + h], clipped to the image
        labels    int64 [N]        category ids, as in the JSON (``classes[id]`` is the name)
        iscrowd   int64 [N]        0 or 1 (int64 as in torchvision's detection references)
        area      float32 [N]      the annotation's ``area`` (segment area in pixels)
        image_id  int64 []         the image's id
        masks     uint8 [N, H, W]  0/1, pycocotools' ``annToMask`` (only with ``masks: true``)

    The frame is the stored pixels (EXIF orientation not applied), as pycocotools, torchvision's
    ``CocoDetection`` (Pillow's ``Image.open``) and COCO's annotation tools use it; with
    ``apply_exif_orientation`` a JPEG's EXIF orientation turns image, boxes and masks together
    (``_orientation``; H, W are then the turned image's). With ``annotations_frame: upright`` the
    annotation file is in the upright frame (made on the photo as viewers show it): the image is
    turned by its EXIF orientation and the targets are served as the file has them.
    tests/data/test_exif_frame.py.

    An image without annotations has N = 0 (``boxes`` [0, 4], ``masks`` [0, H, W]). Annotations
    of zero width or height, or wholly outside their image, are dropped at index build and
    counted (``info``, and a warning in the server's log). There is no ``label`` (one class per
    sample): ``label(i)`` raises TypeError. ``classes``: category names indexed by category id,
    "" for ids without a category (COCO's 1..90 with gaps gives 91 names).

    The constructor raises FileNotFoundError (no annotation file), ValueError naming the file,
    the annotation (or image, or category) id and the field for malformed JSON (see
    ``coco_index``), ImportError if ``masks`` is set without pycocotools, and
    ``_cache.IndexMissingError`` (``build=False``) if the server has not built the index.
    ``load_sample`` raises SampleError naming the image file: unreadable, undecodable, or of
    another size than the JSON says.
    """

    kind = "coco"
    upright = False  # decode the stored pixels; decode_sample turns image and targets together if asked

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        options = getattr(cfg, "storage_options", None) or StorageOptions()
        # reduced_decode: only the region decoding of a first crop or resize (server/compute/region.py),
        # whose targets move with the full frame's params; decode_sample never reduces for a min_size
        super().__init__(name, max_pixels=max_pixels, reduced_decode=bool(getattr(cfg, "reduced_decode", True)),
                         storage_options=options)
        self.apply_exif_orientation = bool(getattr(cfg, "apply_exif_orientation", False))
        self.annotations_frame = str(getattr(cfg, "annotations_frame", "stored"))
        self.masks = bool(cfg.masks)
        self._mask = _mask_utils(name) if self.masks else None
        skip_empty = bool(cfg.skip_empty)
        remote = is_remote(str(cfg.annotations))
        json_path = str(cfg.annotations) if remote else local_path(cfg.annotations)
        root = str(cfg.images).rstrip("/") if is_remote(str(cfg.images)) else local_path(cfg.images)
        shown = safe_url(json_path)
        storage = Storage(json_path, options)
        try:
            version = ({"url": shown, **storage.info(json_path)} if remote else file_fingerprint(json_path))
        except FileNotFoundError:
            raise FileNotFoundError(f"{shown}: COCO annotation file not found (dataset {name!r})") from None
        settings = {"masks": self.masks, "skip_empty": skip_empty}
        identity = {"images": safe_url(root), **settings}
        if remote or is_remote(root):
            identity["storage"] = options.fingerprint_part()
        out = cache_path(cache_dir, self.kind, shown, version, identity=identity)
        index = None
        if build:
            try:
                index = ArrayFile(out)
            except (FileNotFoundError, ValueError):
                with local_copy(storage, json_path, out) as path:
                    fingerprint = with_settings(content_fingerprint(self.kind, [path]), settings)
                    try:
                        build_index(path, shown, out, masks=self.masks, skip_empty=skip_empty,
                                    fingerprint=fingerprint, source=version)
                    except ValueError as e:  # name the annotation file, not our copy
                        raise ValueError(str(e).replace(path, shown)) from None
                remove_stale(out)
        if index is None:
            index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {shown})")
        self._attach(index, root)
        self._image_ids = index["image_ids"]
        self._heights, self._widths = index["heights"], index["widths"]
        self._ann_offsets = index["ann_offsets"]
        self._ann_ids = index["ann_ids"]
        self._ann_boxes, self._ann_labels = index["ann_boxes"], index["ann_labels"]
        self._ann_iscrowd, self._ann_area = index["ann_iscrowd"], index["ann_area"]
        self._segments = Segmentations(index) if self.masks else None
        self._counts = dict(index.meta["counts"])
        if build:
            self._warn_dropped(shown, index.meta["dropped_ids"])

    def _warn_dropped(self, shown: str, ids: list[int]) -> None:
        """Log (warning) the annotations the index left out, with the first ``ids``, if any."""
        zero, outside = self._counts["dropped_zero_size"], self._counts["dropped_outside_image"]
        if zero or outside:
            log.warning("dataset %r: dropped %d annotation(s) of zero width or height and %d wholly outside their "
                        "image (%s: annotation ids %s%s)", self.name, zero, outside, shown,
                        ", ".join(map(str, ids)), ", ..." if zero + outside > len(ids) else "")

    def label(self, index: int) -> int:
        raise TypeError(f"dataset {self.name!r} ({self.kind}) has no per-sample label: its samples carry "
                        "'labels' int64 [N], one category id per object")

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        fields = (FieldSpec("image", "uint8", (-1, -1, 3)), FieldSpec("boxes", "float32", (-1, 4)),
                  FieldSpec("labels", "int64", (-1,)), FieldSpec("iscrowd", "int64", (-1,)),
                  FieldSpec("area", "float32", (-1,)), FieldSpec("image_id", "int64", ()))
        return fields + ((FieldSpec("masks", "uint8", (-1, -1, -1)),) if self.masks else ())

    @property
    def info(self) -> dict[str, str]:
        """``annotations`` (kept), ``dropped_zero_size``, ``dropped_outside_image``,
        ``empty_images`` (images with no annotation kept) and ``skipped_empty_images`` (left
        out by ``skip_empty``), as decimal text."""
        return {k: str(v) for k, v in sorted(self._counts.items())}

    @property
    def decode_settings(self) -> dict[str, str]:
        applied = self.apply_exif_orientation or self.annotations_frame == "upright"
        return {**super().decode_settings, "exif_orientation": "applied" if applied else "stored",
                "annotations_frame": self.annotations_frame}

    def image_id(self, index: int) -> int:
        """The COCO id of sample ``index``'s image."""
        return int(self._image_ids[self._check(index)])

    def annotation_ids(self, index: int) -> list[int]:
        """The ids of sample ``index``'s annotations, in ``load_sample``'s order."""
        index = self._check(index)
        return self._ann_ids[self._ann_offsets[index]:self._ann_offsets[index + 1]].tolist()

    def decoded_size(self, index: int, data) -> tuple[int, int] | None:
        """The image's ``(height, width)`` from its JPEG headers, in the frame ``decode_sample``
        returns (turned by its EXIF orientation with ``apply_exif_orientation`` or
        ``annotations_frame: upright``); None with reduced_decode off, for another format, or
        when the headers disagree with the annotation file's size (the full decode then raises
        ``decode_sample``'s size mismatch, so a region decode is never drawn on another frame
        than the targets'). Never raises."""
        index = int(index)
        if not self.reduced_decode or not 0 <= index < len(self):
            return None  # (an index out of range: decode_sample raises IndexError)
        upright = self.annotations_frame == "upright"
        frame = upright_size(data, upright)  # the annotation file's frame
        if frame is None or frame != (int(self._heights[index]), int(self._widths[index])):
            return None
        return upright_size(data, True) if self.apply_exif_orientation and not upright else frame

    def decode_sample(self, index: int, data, min_size: tuple[int, int] | None = None,
                      eighths: int | None = None, window: tuple[int, int, int, int] | None = None,
                      jpeg_index=None) -> dict:
        """Sample ``index`` (fields in the class docstring) from its image file's bytes ``data``.
        ``min_size`` is ignored (boxes and masks are in the full image's pixels); ``eighths``,
        ``window``, ``jpeg_index``: the image decoded at m/8, or only a rectangle of it (``Dataset.decode_sample``;
        server/compute/region.py; ``window`` in the frame served, ``decoded_size``), boxes and
        masks still those of the full image.

        Raises SampleError naming the image file if it cannot be decoded or its size (stored, or
        upright with ``annotations_frame: upright``) is not the JSON's ``height`` x ``width``; the
        message names the image's EXIF orientation and the option that would fit.
        """
        index = self._check(index)
        reduced = eighths is not None and self.reduced_decode
        upright = self.annotations_frame == "upright"
        orientation = exif_orientation(data) if upright or self.apply_exif_orientation else 1
        # a window is in the frame served: a turned image is decoded whole (at m/8) and cut once turned
        cut_here = reduced and window is not None and orientation == 1
        image = self.decode(index, data, eighths=eighths, window=window if cut_here else None,
                            jpeg_index=jpeg_index) if reduced \
            else self.decode(index, data)
        if upright:
            image = orient_pixels(image, orientation)
        h, w = int(self._heights[index]), int(self._widths[index])
        expected = (h, w) if not reduced else scaled_size(h, w, eighths)
        if cut_here:
            _, _, rw, rh = scaled_window(window, eighths, h, w)
            expected = (rh, rw)
        if image.shape[:2] != expected:
            raise self.sample_error(index, self._size_mismatch(index, image.shape[:2], (h, w), data, upright,
                                                               None if expected == (h, w) else (expected, eighths)))
        start, end = int(self._ann_offsets[index]), int(self._ann_offsets[index + 1])
        sample = {
            "image": image,
            "boxes": self._ann_boxes[start:end].copy(),
            "labels": self._ann_labels[start:end].copy(),
            "iscrowd": self._ann_iscrowd[start:end].copy(),
            "area": self._ann_area[start:end].copy(),
            "image_id": int(self._image_ids[index]),
        }
        if self.masks:
            sample["masks"] = self._decode_masks(range(start, end), h, w)
        if self.apply_exif_orientation and not upright:
            sample = orient_sample(sample, orientation, (h, w))
        if orientation != 1 and reduced and window is not None:  # the window, cut from the whole image turned
            frame = (w, h) if orientation >= 5 and not upright else (h, w)  # the served frame (upright's is the JSON's)
            x, y, rw, rh = scaled_window(window, eighths, *frame)
            sample["image"] = sample["image"][y:y + rh, x:x + rw]
        return sample

    def _size_mismatch(self, index: int, got: tuple[int, int], want: tuple[int, int], data, upright: bool,
                       scaled: tuple[tuple[int, int], int] | None = None) -> str:
        """The reason of a size mismatch: both sizes, the EXIF orientation, and what to set.
        ``scaled``: ((height, width) expected, m) for an image decoded at m/8 (or a rectangle of it)."""
        (gh, gw), (h, w), orientation = got, want, exif_orientation(data)
        shown = "" if scaled is None else f" ({scaled[0][1]}x{scaled[0][0]} at {scaled[1]}/8)"
        text = (f"the image is {gw}x{gh} pixels{' once turned upright' if upright else ''}, but the annotation file "
                f"says {w}x{h}{shown}")
        turned = orientation in (5, 6, 7, 8)
        if turned and not upright:
            text += (f"; its EXIF orientation is {orientation} (viewers show it turned, {gh}x{gw}): if the annotations "
                     "were made on the photo as viewers show it, set annotations_frame: upright on the dataset")
        elif turned:
            text += (f"; annotations_frame: upright turned it by its EXIF orientation {orientation}: if the annotation "
                     "file is in the stored pixels, set annotations_frame: stored (the default)")
        else:
            text += f" (EXIF orientation {orientation}: the same size turned or not)"
        return f"{text} (image id {int(self._image_ids[index])})"

    def _decode_masks(self, rows: range, h: int, w: int) -> np.ndarray:
        """uint8 [len(rows), h, w]: pycocotools' ``annToRLE`` + ``decode`` of each annotation."""
        masks = np.empty((len(rows), h, w), dtype=np.uint8)
        for k, row in enumerate(rows):
            masks[k] = self._mask.decode(self._segments.rle(row, h, w, self._mask))
        return masks
