"""COCO segmentations: checked, packed into flat arrays of the coco index, and turned back into
the RLE that pycocotools decodes.

A segmentation is polygons (a list of parts, each [x1, y1, x2, y2, ...]), a compressed RLE
(``{"size": [h, w], "counts": "string"}``) or an uncompressed one (``"counts": [runs...]``, the
form COCO gives crowds). Packed, without a Python object per annotation:

* ``ann_seg_kind`` uint8 [M]: ``POLYGONS``, ``COMPRESSED`` or ``UNCOMPRESSED``;
* ``ann_seg_range`` int64 [M, 2]: the annotation's [start, end) in the pool of its kind;
* polygons: ``seg_part_offsets`` int64 [P + 1] (part p is ``seg_coords[offsets[p]:offsets[p+1]]``)
  and ``seg_coords`` float64 [C] (a range counts parts); compressed: ``seg_chars`` uint8 (the
  counts string's ASCII); uncompressed: ``seg_runs`` uint32.

The values are kept exactly (float64 coordinates, the string itself), so a mask decoded from
the index is bit for bit pycocotools' ``annToMask`` of the JSON.
"""

from __future__ import annotations

import json
import math

import numpy as np

POLYGONS, COMPRESSED, UNCOMPRESSED = 1, 2, 3
_NUMBERS = frozenset((int, float))
_CHUNK = 1 << 20  # values gathered in Python lists before they become numpy arrays
_MAX_COUNT_CHARS = 7  # 35 bits: every count below 2**32 fits


def short_json(v) -> str:
    """``v`` as JSON for an error message, cut to 80 characters."""
    text = json.dumps(v, default=repr)
    return text if len(text) <= 80 else text[:77] + "..."


def finite_numbers(values: list) -> bool:
    """True if every value is an int or float (not a bool) and finite."""
    if not set(map(type, values)) <= _NUMBERS:
        return False
    try:
        return math.isfinite(sum(values))  # nan and inf propagate through the sum
    except OverflowError:  # an int too large for a float
        return False


def rle_string_counts(s: str) -> np.ndarray:
    """The run lengths (int64) of a compressed COCO RLE ``counts`` string, as pycocotools'
    ``rleFrString`` (maskApi.c) reads it: 5-bit groups offset by 48, a continuation bit (0x20),
    sign extension (0x10 in the last group), and each count from the fourth on stored as the
    difference to the count two before it.

    Raises ValueError (the reason, without the annotation) for a character outside '0'..'o', a
    string that ends inside a count, a count of more than 7 characters, or a count that is
    negative or does not fit 32 bits (where pycocotools would silently wrap it and then write
    outside its mask).
    """
    c = np.frombuffer(s.encode("ascii", "replace"), dtype=np.uint8).astype(np.int64) - 48
    bad = np.flatnonzero((c < 0) | (c > 63))
    if len(bad):
        raise ValueError(f"character {s[bad[0]]!r} at position {bad[0]} is not in '0'..'o'")
    more = (c & 0x20) != 0
    if len(c) and more[-1]:
        raise ValueError("the string ends inside a count")
    ends = np.flatnonzero(~more)
    starts = np.r_[0, ends[:-1] + 1].astype(np.int64)
    lengths = ends - starts + 1
    if len(lengths) and lengths.max() > _MAX_COUNT_CHARS:
        raise ValueError(f"a count of {lengths.max()} characters at position {starts[np.argmax(lengths)]}")
    if not len(c):
        return np.zeros(0, dtype=np.int64)
    shift = 5 * (np.arange(len(c)) - np.repeat(starts, lengths))
    x = np.add.reduceat((c & 0x1F) << shift, starts)
    negative = (c[ends] & 0x10) != 0
    x[negative] -= np.left_shift(1, 5 * lengths[negative])  # x |= -1 << 5k, for x < 2**5k
    counts = x.copy()
    counts[1::2] = np.cumsum(x[1::2])  # count i > 2 is x[i] + count[i - 2]: running sums of
    counts[2::2] = np.cumsum(x[2::2])  # the odd ones from 1 and the even ones from 2
    wrong = np.flatnonzero((counts < 0) | (counts >= 1 << 32))
    if len(wrong):
        raise ValueError(f"run {wrong[0]} has length {counts[wrong[0]]}")
    return counts


class _Pool:
    """A growing 1-D array gathered in Python lists, kept as numpy chunks of ``dtype``."""

    def __init__(self, dtype):
        self.dtype = np.dtype(dtype)
        self.chunks: list[np.ndarray] = []
        self.pending: list = []
        self.size = 0

    def extend(self, values) -> tuple[int, int]:
        """Append ``values``; their [start, end) in the pool."""
        start = self.size
        self.pending.extend(values)
        self.size += len(values)
        if len(self.pending) >= _CHUNK:
            self.flush()
        return start, self.size

    def flush(self) -> None:
        if self.pending:
            self.chunks.append(np.array(self.pending, dtype=self.dtype))
            self.pending = []


class SegmentationPacker:
    """Checks segmentations (``add``) and writes them packed (``write``; layout in the module docstring)."""

    def __init__(self):
        self.kinds: list[int] = []
        self.ranges: list[tuple[int, int]] = []
        self.part_ends = _Pool(np.int64)
        self.coords = _Pool(np.float64)
        self.chars = _Pool(np.uint8)
        self.runs = _Pool(np.uint32)

    def add(self, where: str, seg, height: int, width: int) -> None:
        """Check ``seg`` and pack it. Raises ValueError naming ``where`` (file and annotation) and
        the field unless pycocotools' ``annToMask`` reads it correctly for a ``height`` x
        ``width`` image: polygons (a non-empty list of parts, each an even count >= 6 of finite
        numbers: ``frPyObjects`` would take a part of 4 for a box), or RLE ``{"size": [height,
        width], "counts": ...}`` whose runs (non-negative ints, or a compressed string) add up
        to height x width (more would make pycocotools write past the end of its mask)."""
        if type(seg) is list:
            if not seg:
                raise ValueError(f"{where}: field 'segmentation': an empty list (no polygon)")
            first = self.part_ends.size
            for j, part in enumerate(seg):
                if type(part) is not list or len(part) < 6 or len(part) % 2 or not finite_numbers(part):
                    raise ValueError(f"{where}: field 'segmentation[{j}]': expected a polygon [x1, y1, x2, y2, x3, y3, "
                                     f"...] (an even count >= 6 of finite numbers), got {short_json(part)}")
                self.part_ends.extend((self.coords.extend(part)[1],))
            self.kinds.append(POLYGONS)
            self.ranges.append((first, self.part_ends.size))
            return
        if type(seg) is not dict:
            raise ValueError(f"{where}: field 'segmentation': expected polygons (a list) or RLE (an object), got {short_json(seg)}")
        size, counts = seg.get("size"), seg.get("counts")
        if type(size) is not list or [type(v) for v in size] != [int, int] or size != [height, width]:
            raise ValueError(f"{where}: field 'segmentation.size': {short_json(size)}, but the image is "
                             f"[height, width] = [{height}, {width}]")
        if type(counts) is list:
            if counts and not (set(map(type, counts)) <= {int} and min(counts) >= 0 and max(counts) < 1 << 32):
                bad = next(v for v in counts if type(v) is not int or not 0 <= v < 1 << 32)
                raise ValueError(f"{where}: field 'segmentation.counts': run length {short_json(bad)} is not an integer in [0, 2**32)")
            total = sum(counts)
        elif type(counts) is str:
            try:
                total = int(rle_string_counts(counts).sum())
            except ValueError as e:
                raise ValueError(f"{where}: field 'segmentation.counts': not a valid compressed RLE string: {e}") from None
        else:
            raise ValueError(f"{where}: field 'segmentation.counts': expected a list of run lengths or a compressed "
                             f"string, got {short_json(counts)}")
        if total != height * width:
            raise ValueError(f"{where}: field 'segmentation.counts': the runs cover {total} pixels, "
                             f"the image {height} x {width} = {height * width}")
        if type(counts) is str:
            self.kinds.append(COMPRESSED)
            self.ranges.append(self.chars.extend(counts.encode("ascii")))
        else:
            self.kinds.append(UNCOMPRESSED)
            self.ranges.append(self.runs.extend(counts))

    def write(self, w, order: np.ndarray) -> None:
        """Add the packed arrays to ``w`` (an ArrayFileWriter), annotations in ``order``."""
        w.add("ann_seg_kind", np.asarray(self.kinds, dtype=np.uint8)[order])
        w.add("ann_seg_range", np.asarray(self.ranges, dtype=np.int64).reshape(-1, 2)[order])
        for name, pool, first in (("seg_part_offsets", self.part_ends, [np.zeros(1, np.int64)]),
                                  ("seg_coords", self.coords, []), ("seg_chars", self.chars, []),
                                  ("seg_runs", self.runs, [])):
            pool.flush()
            w.add_chunks(name, pool.dtype, (pool.size + len(first),), first + pool.chunks)


class Segmentations:
    """The packed segmentations of a coco index (an ``_cache.ArrayFile``), read back per annotation."""

    def __init__(self, index):
        self.kinds, self.ranges = index["ann_seg_kind"], index["ann_seg_range"]
        self.part_offsets, self.coords = index["seg_part_offsets"], index["seg_coords"]
        self.chars, self.runs = index["seg_chars"], index["seg_runs"]

    def rle(self, row: int, height: int, width: int, mask_utils):
        """Annotation ``row``'s segmentation as the RLE pycocotools' ``annToRLE`` makes of it
        (``mask_utils``: ``pycocotools.mask``): polygon parts merged into one."""
        kind = int(self.kinds[row])
        start, end = (int(v) for v in self.ranges[row])
        if kind == POLYGONS:
            parts = [self.coords[self.part_offsets[p]:self.part_offsets[p + 1]] for p in range(start, end)]
            return mask_utils.merge(mask_utils.frPyObjects(parts, height, width))
        if kind == COMPRESSED:
            return {"size": [height, width], "counts": self.chars[start:end].tobytes()}
        return mask_utils.frPyObjects({"size": [height, width], "counts": self.runs[start:end]}, height, width)
