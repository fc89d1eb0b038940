"""Semantic segmentation: an image folder and a mask folder paired by file stem (``kind: segmentation``),
as Pascal VOC's ``JPEGImages`` and ``SegmentationClass``."""

from __future__ import annotations

import io
import os
import pathlib

import numpy as np

from batchd.errors import SampleError

from ..decode import DEFAULT_MAX_PIXELS, ImageReadError, exif_orientation
from ..storage import Storage, StorageOptions, is_remote, join, local_path, safe_url
from ._cache import ArrayFileWriter, cache_path, open_cached, remove_stale
from ._files import FileDataset, PackedStrings, pack_strings
from ._orientation import orient_pixels, orient_sample
from ._fingerprint import file_list_fingerprint, listing_fingerprint, with_settings
from .base import FieldSpec

MASK_MODES = ("P", "L", "1")  # PIL modes read as class indices: palette, 8-bit grey, 1-bit
_SHOWN_UNPAIRED = 5


def decode_mask(data, max_pixels: int = DEFAULT_MAX_PIXELS) -> np.ndarray:
    """A mask file's bytes as uint8 [H, W] class indices, read with Pillow.

    A palette ("P") image gives its palette indices, not their colours (OpenCV's IMREAD_UNCHANGED
    would expand them to BGR); an 8-bit greyscale one its values; a 1-bit one 0 and 1. Raises
    ImageReadError for another mode (RGB, 16-bit...: "expected class indices"), an image over
    ``max_pixels``, or bytes Pillow cannot decode.
    """
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data)) as im:
            w, h = im.size
            if w * h > max_pixels:
                raise ImageReadError(f"mask too large: {w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
            if im.mode not in MASK_MODES:
                raise ImageReadError(f"mask has mode {im.mode}; expected class indices: a palette (P), 8-bit "
                                     "greyscale (L) or 1-bit image")
            return np.asarray(im, dtype=np.uint8)
    except (OSError, ValueError, Image.DecompressionBombError) as e:  # UnidentifiedImageError is an OSError
        raise ImageReadError(f"not a decodable mask ({len(data)} bytes): {e}") from None


def list_stems(root: str, extensions: tuple[str, ...], storage: Storage, what: str) -> tuple[dict[str, str], dict[str, tuple]]:
    """(stem -> path relative to ``root``, path -> (size, version)) of the files under ``root``
    (recursively) whose lower-cased name ends with one of ``extensions``. A stem is the relative
    path without its extension, ``/``-separated.

    Raises FileNotFoundError if ``root`` is not a folder (or an empty prefix), ValueError if two
    files share a stem (naming both) or none is found. ``what``: "image" or "mask", for messages.
    """
    files: dict[str, tuple] = {}
    if is_remote(root):
        for rel, info in storage.list_files(root).items():
            files[rel] = (info.get("size", -1), info.get("ETag") or info.get("LastModified") or "")
    else:
        if not os.path.isdir(root):
            raise FileNotFoundError(f"{root}: {what} folder not found")
        for dirpath, dirnames, names in os.walk(root):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            for name in names:
                files[name if rel_dir == "." else f"{rel_dir}/{name}"] = (-1, "")
    stems: dict[str, str] = {}
    for rel in sorted(files):
        if not rel.lower().endswith(extensions):
            continue
        stem = rel[: rel.rfind(".")]
        if stem in stems:
            raise ValueError(f"{safe_url(root)}: {stems[stem]} and {rel} are two {what}s with the stem {stem!r}")
        stems[stem] = rel
    if not stems:
        raise ValueError(f"{safe_url(root)}: no {what} files ending in {', '.join(extensions)}")
    return stems, {rel: files[rel] for rel in stems.values()}


def read_split(location: str, storage: Storage) -> list[str]:
    """The stems of a split file (one a line, blank lines ignored). Raises FileNotFoundError, or
    ValueError naming the file and line of a stem listed twice."""
    try:
        text = storage.read(location).decode("utf-8")
    except FileNotFoundError:
        raise FileNotFoundError(f"{safe_url(location)}: split_file not found") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{safe_url(location)}: split_file is not UTF-8 text: {e}") from None
    stems, seen = [], {}
    for line_no, line in enumerate(text.splitlines(), 1):
        stem = line.strip()
        if not stem:
            continue
        if stem in seen:
            raise ValueError(f"{safe_url(location)}: line {line_no} lists {stem!r} again (first on line {seen[stem]})")
        seen[stem] = line_no
        stems.append(stem)
    if not stems:
        raise ValueError(f"{safe_url(location)}: split_file lists no stems")
    return stems


def pair(images: dict[str, str], masks: dict[str, str], split: list[str] | None, image_root: str,
         mask_root: str, split_name: str = "") -> list[str]:
    """The stems of the samples, in order: ``split``'s (each must have an image and a mask), or
    every stem sorted (each image must have a mask and each mask an image).

    Raises FileNotFoundError naming the unpaired files (the first five, and how many).
    """
    def refuse(missing: list[str], have: str, lacks: str, where: str, how: str) -> None:
        shown = ", ".join(missing[:_SHOWN_UNPAIRED]) + (", ..." if len(missing) > _SHOWN_UNPAIRED else "")
        raise FileNotFoundError(f"{len(missing)} {have} without {lacks} in {safe_url(where)}: {shown}{how}")

    if split is not None:
        for table, what, root in ((images, "an image", image_root), (masks, "a mask", mask_root)):
            missing = [s for s in split if s not in table]
            if missing:
                refuse(missing, f"stem(s) of {safe_url(split_name)}", what, root, "")
        return split
    hint = " (every image needs a mask and every mask an image; or give split_file: the stems to use)"
    missing = [images[s] for s in sorted(images) if s not in masks]
    if missing:
        refuse(missing, f"image(s) in {safe_url(image_root)}", "a mask", mask_root, hint)
    missing = [masks[s] for s in sorted(masks) if s not in images]
    if missing:
        refuse(missing, f"mask(s) in {safe_url(mask_root)}", "an image", image_root, hint)
    return sorted(images)


class Segmentation(FileDataset):
    """Images with one class-index mask each: ``images/<stem>.<ext>`` with ``masks/<stem>.png``.

    Sample i is the i-th stem (sorted, or the ``split_file``'s order). ``load_sample(i)``::

        image  uint8 [H, W, 3]  RGB, decoded at full size
        mask   uint8 [H, W]     class index per pixel, as stored: a palette PNG's indices (not its
                                colours), an 8-bit grey PNG's values; ``ignore_index`` (VOC: 255)
                                passes through unchanged

    The frame is the stored pixels (EXIF orientation not applied; a PNG mask has none); with
    ``apply_exif_orientation`` an image's EXIF orientation turns image and mask together
    (tests/data/test_exif_frame.py).

    ``info``: ``ignore_index`` ("none" if unset). ``classes``: the config's ``classes`` (mask
    value v is ``classes[v]``), or [] . There is no ``label``: ``label(i)`` raises TypeError.
    The folders are listed again every time the server opens the dataset (``build=True``).

    The constructor raises FileNotFoundError for a missing folder or split file, or an image
    without a mask or a mask without an image (naming them); ValueError if two files of a
    folder share a stem, or a folder has no files of the extensions. ``load_sample`` raises
    SampleError naming the file: unreadable or undecodable image or mask, a mask that is not
    class indices, or a mask whose size is not the image's.
    """

    kind = "segmentation"
    upright = False  # decode the stored pixels; decode_sample turns image and mask together if asked

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        options = getattr(cfg, "storage_options", None) or StorageOptions()
        super().__init__(name, max_pixels=max_pixels, reduced_decode=False, storage_options=options)
        self.apply_exif_orientation = bool(getattr(cfg, "apply_exif_orientation", False))
        image_root, mask_root = (str(r).rstrip("/") if is_remote(str(r)) else local_path(r) for r in (cfg.images, cfg.masks))
        split = cfg.split_file
        split = None if split is None else (str(split) if is_remote(str(split)) else local_path(split))
        self.ignore_index = cfg.ignore_index
        key = {"images": safe_url(image_root), "masks": safe_url(mask_root), "split_file": split and safe_url(split),
               "extensions": sorted(cfg.extensions), "mask_extensions": sorted(cfg.mask_extensions)}
        if any(is_remote(r) for r in (image_root, mask_root, split or "")):
            key["storage"] = options.fingerprint_part()
        out = cache_path(cache_dir, self.kind, safe_url(image_root), key, identity=key)
        if build:
            self._build(out, image_root, mask_root, split, cfg)
            remove_stale(out)
        index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {safe_url(image_root)})")
        self._attach(index, image_root)
        self.mask_root = mask_root
        self.mask_storage = Storage(mask_root, options)
        self._mask_paths = PackedStrings(index["mask_bytes"], index["mask_offsets"])

    def _build(self, out: pathlib.Path, image_root: str, mask_root: str, split: str | None, cfg) -> None:
        options = self.storage_options
        images, image_files = list_stems(image_root, tuple(cfg.extensions), Storage(image_root, options), "image")
        masks, mask_files = list_stems(mask_root, tuple(cfg.mask_extensions), Storage(mask_root, options), "mask")
        stems = pair(images, masks, None if split is None else read_split(split, Storage(split, options)),
                     image_root, mask_root, split or "")
        image_paths, mask_paths = [images[s] for s in stems], [masks[s] for s in stems]
        parts = {}
        for what, root, paths, files in (("images", image_root, image_paths, image_files),
                                         ("masks", mask_root, mask_paths, mask_files)):
            zeros = [0] * len(paths)
            parts[what] = (listing_fingerprint(self.kind, [], paths, zeros, [files[p] for p in paths]) if is_remote(root)
                           else file_list_fingerprint(self.kind, root, [], paths, zeros))
        fingerprint = with_settings(parts["images"], {"masks": parts["masks"]})
        image_bytes, image_offsets = pack_strings(image_paths)
        mask_bytes, mask_offsets = pack_strings(mask_paths)
        with ArrayFileWriter(out) as w:
            w.add("path_bytes", image_bytes)
            w.add("path_offsets", image_offsets)
            w.add("mask_bytes", mask_bytes)
            w.add("mask_offsets", mask_offsets)
            w.meta.update(kind=self.kind, classes=list(cfg.classes), fingerprint=fingerprint)

    def label(self, index: int) -> int:
        raise TypeError(f"dataset {self.name!r} ({self.kind}) has no per-sample label: its samples carry "
                        "'mask' uint8 [H, W], one class index per pixel")

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        return FieldSpec("image", "uint8", (-1, -1, 3)), FieldSpec("mask", "uint8", (-1, -1))

    @property
    def info(self) -> dict[str, str]:
        return {"ignore_index": "none" if self.ignore_index is None else str(self.ignore_index)}

    @property
    def decode_settings(self) -> dict[str, str]:
        return {**super().decode_settings, "exif_orientation": "applied" if self.apply_exif_orientation else "stored"}

    def mask_source(self, index: int) -> str:
        """The mask's path relative to the mask folder (a URL without credentials if absolute)."""
        return safe_url(self._mask_paths[self._check(index)])

    def read_bytes(self, index: int) -> tuple[bytes, bytes]:
        """(image bytes, mask bytes) of sample ``index`` (I/O only). Raises as ``FileDataset.read_bytes``,
        naming the mask's path when the mask cannot be read."""
        index = self._check(index)
        image = super().read_bytes(index)
        mask_location = join(self.mask_root, self._mask_paths[index])
        return image, self.read_file(index, self.mask_storage, mask_location, self.mask_source(index))

    def decode(self, index: int, data, min_size: tuple[int, int] | None = None) -> np.ndarray:
        """The image alone, uint8 [H, W, 3] RGB at full size (turned with apply_exif_orientation),
        from ``data`` = (image bytes, mask bytes) as ``read_bytes`` returns them (so ``load_image``
        works). Raises SampleError."""
        image = super().decode(index, data[0])
        return orient_pixels(image, exif_orientation(data[0])) if self.apply_exif_orientation else image

    def decode_sample(self, index: int, data, min_size: tuple[int, int] | None = None) -> dict:
        """``{"image", "mask"}`` from ``data`` = (image bytes, mask bytes); raises SampleError
        naming the image or the mask file (a mask of another size than the stored image)."""
        index = self._check(index)
        image = super().decode(index, data[0])
        mask_data = data[1]
        try:
            mask = decode_mask(mask_data, self.max_pixels)
        except ImageReadError as e:
            raise self.mask_error(index, e.reason) from None
        if mask.shape != image.shape[:2]:
            raise self.mask_error(index, f"the mask is {mask.shape[1]}x{mask.shape[0]} pixels, its image "
                                         f"{self.source(index)} {image.shape[1]}x{image.shape[0]}")
        sample = {"image": image, "mask": mask}
        return orient_sample(sample, exif_orientation(data[0])) if self.apply_exif_orientation else sample

    def mask_error(self, index: int, reason: str) -> SampleError:
        return SampleError(dataset=self.name, index=index, path=self.mask_source(index), reason=reason)
