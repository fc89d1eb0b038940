"""Indexed JPEGs (server/data/scaled_jpeg.py ``index_jpeg``, ``decode_indexed``): a JPEG rewritten
losslessly with a restart marker before every MCU, from which a region is cut without decoding.

Oracles: OpenCV's own libjpeg-turbo (a full decode of the rewritten file against one of the
original: the rewrite is lossless) and, for regions, ``decode_region`` of the original file (the
path every sample without an index takes: the two must give the same bytes, or a batch would
depend on the cache) and OpenCV's reduced decode inside the region (away from its edges, where a
region's upsampling has no neighbour).
"""

from __future__ import annotations

import pathlib
import random
import sys

import cv2
import numpy as np
import pytest

from batchd.server.data import scaled_jpeg

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "compute"))
from test_region import photo_jpegs  # noqa: E402

pytestmark = pytest.mark.skipif(not scaled_jpeg.region_available(), reason="the _jpeg_region extension is not built")

_REDUCED = {1: cv2.IMREAD_REDUCED_COLOR_8, 2: cv2.IMREAD_REDUCED_COLOR_4, 4: cv2.IMREAD_REDUCED_COLOR_2,
            8: cv2.IMREAD_COLOR}


def _variants() -> dict[str, bytes]:
    """JPEGs of every layout the index must handle: chroma subsamplings, grey, progressive, an
    image smaller than one MCU, odd sizes, one that has restart markers already."""
    photo = cv2.imdecode(np.frombuffer(photo_jpegs(1, seed=3)[0], np.uint8), cv2.IMREAD_COLOR)
    odd = cv2.resize(photo, (333, 217), interpolation=cv2.INTER_AREA)
    out = {"photo 4:2:0": cv2.imencode(".jpg", photo, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes()}
    for name, factor in (("4:4:4", 0x111111), ("4:2:2", 0x211111), ("4:1:1", 0x411111), ("4:2:0", 0x221111)):
        out[f"odd {name}"] = cv2.imencode(".jpg", odd, [cv2.IMWRITE_JPEG_SAMPLING_FACTOR, factor])[1].tobytes()
    out["grey"] = cv2.imencode(".jpg", cv2.cvtColor(odd, cv2.COLOR_BGR2GRAY))[1].tobytes()
    out["progressive"] = cv2.imencode(".jpg", odd, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes()
    out["restarts already"] = cv2.imencode(".jpg", odd, [cv2.IMWRITE_JPEG_RST_INTERVAL, 3])[1].tobytes()
    out["tiny"] = cv2.imencode(".jpg", odd[:9, :13])[1].tobytes()
    return out


@pytest.fixture(scope="module")
def variants() -> dict[str, bytes]:
    return _variants()


def _rects(rng: random.Random, height: int, width: int, n: int) -> list[tuple[int, int, int, int]]:
    """The whole image, its last pixel, its first row, then random rectangles (x, y, w, h)."""
    rects = [(0, 0, width, height), (width - 1, height - 1, 1, 1), (0, 0, width, 1)]
    for _ in range(n):
        x, y = rng.randrange(width), rng.randrange(height)
        rects.append((x, y, rng.randint(1, width - x), rng.randint(1, height - y)))
    return rects


def test_the_rewrite_is_lossless(variants):
    """OpenCV decodes the rewritten JPEG to the bytes it decodes the original to; every MCU has
    its offset, in order, and the file has a restart marker before each MCU but the first."""
    for name, jpeg in variants.items():
        index = scaled_jpeg.index_jpeg(jpeg)
        assert index is not None, name
        mw, mh, mx, my, width, height = index.geometry.tolist()
        original = cv2.imdecode(np.frombuffer(jpeg, np.uint8), cv2.IMREAD_UNCHANGED)
        assert original.shape[:2] == (height, width), name
        assert np.array_equal(cv2.imdecode(index.jpeg, cv2.IMREAD_UNCHANGED), original), name
        assert len(index.offsets) == mx * my + 1 and mx == -(-width // mw) and my == -(-height // mh), name
        assert np.all(np.diff(index.offsets) >= 2), name  # each MCU's data, then its marker
        before = index.jpeg[index.offsets[1:-1] - 2], index.jpeg[index.offsets[1:-1] - 1]
        assert np.all(before[0] == 0xFF) and np.all((before[1] & 0xF8) == 0xD0), name
        assert bytes(index.jpeg[-2:]) == b"\xff\xd9" and index.offsets[-1] == index.jpeg.size, name


@pytest.mark.parametrize("m", range(1, 9))
def test_a_region_decodes_to_the_bytes_of_the_original_files_region(variants, m):
    """For every layout and scale, whole images, corners, single pixels and random rectangles:
    ``decode_indexed`` gives the bytes ``decode_region`` gives from the original file."""
    rng = random.Random(m)
    for name, jpeg in variants.items():
        index = scaled_jpeg.index_jpeg(jpeg)
        height, width = scaled_jpeg.scaled_size(int(index.geometry[5]), int(index.geometry[4]), m)
        for rect in _rects(rng, height, width, 12):
            want = scaled_jpeg.decode_region(np.frombuffer(jpeg, np.uint8), m, rect)
            got = scaled_jpeg.decode_indexed(index, m, rect)
            assert want is not None and got is not None, (name, rect)
            assert got.shape == (rect[3], rect[2], 3), (name, rect, got.shape)
            assert np.array_equal(got, want), (name, m, rect, int(np.abs(got.astype(int) - want).max()))


@pytest.mark.parametrize("m", sorted(_REDUCED))
def test_a_regions_inside_equals_opencvs_decode(variants, m):
    """Away from its edges (one MCU), a region cut from the index is OpenCV's decode of the
    original file at m/8 (``IMREAD_REDUCED_COLOR_*``: 1/8, 1/4, 1/2, 1), pixel for pixel, for every
    layout: an oracle that shares no code with batchd's decoder."""
    rng = random.Random(m)
    for name, jpeg in variants.items():
        index = scaled_jpeg.index_jpeg(jpeg)
        whole = cv2.cvtColor(cv2.imdecode(np.frombuffer(jpeg, np.uint8), _REDUCED[m]), cv2.COLOR_BGR2RGB)
        height, width = whole.shape[:2]
        edge = int(max(index.geometry[:2])) * m // 8 + 1
        if min(height, width) <= 4 * edge:
            continue  # no inside to compare ("tiny" at small scales)
        for _ in range(6):
            w, h = rng.randint(2 * edge + 1, width), rng.randint(2 * edge + 1, height)
            x, y = rng.randint(0, width - w), rng.randint(0, height - h)
            got = scaled_jpeg.decode_indexed(index, m, (x, y, w, h))
            assert np.array_equal(got[edge:-edge, edge:-edge], whole[y + edge:y + h - edge, x + edge:x + w - edge]), \
                (name, m, (x, y, w, h))


def test_an_index_reads_only_the_regions_data():
    """The JPEG cut for a region holds the MCUs under it and a row above and below, not the rows
    above it or the columns beside it: for a quarter of a photo, well under half its bytes."""
    jpeg = photo_jpegs(1, seed=7)[0]
    index = scaled_jpeg.index_jpeg(jpeg)
    mw, mh, mx, my, width, height = index.geometry.tolist()
    c0, c1, r0, r1 = mx // 2, mx - 1, my // 2, my - 1
    ext = scaled_jpeg.extension()
    cut = ext.extract(index.jpeg, index.offsets, mx, my, mw, mh, width, height, c0, c1, r0, r1)
    assert len(cut) < 0.4 * index.jpeg.size, (len(cut), index.jpeg.size)
    decoded = cv2.imdecode(np.frombuffer(cut, np.uint8), cv2.IMREAD_COLOR)
    full = cv2.imdecode(index.jpeg, cv2.IMREAD_COLOR)
    assert decoded.shape[:2] == (height - r0 * mh, width - c0 * mw)
    inner = decoded[mh:-mh, mw:-mw]  # away from the cut's edges (upsampling there has no neighbour)
    assert np.array_equal(inner, full[r0 * mh + mh:height - mh, c0 * mw + mw:width - mw])


def test_bad_input_is_refused_not_read_out_of_bounds():
    """Not a JPEG: no index. Offsets that do not fit the JPEG or the grid, MCUs outside it:
    ValueError, nothing read outside the buffers; an index whose JPEG was cut short: no region
    from it (the caller decodes the original)."""
    jpeg = photo_jpegs(1, seed=8)[0]
    assert scaled_jpeg.index_jpeg(b"not a jpeg") is None
    index = scaled_jpeg.index_jpeg(jpeg)
    ext = scaled_jpeg.extension()
    mw, mh, mx, my, width, height = index.geometry.tolist()
    good = (mx, my, mw, mh, width, height, 0, 1, 0, 1)
    assert ext.extract(index.jpeg, index.offsets, *good)[:2] == b"\xff\xd8"
    wild = index.offsets.copy()
    wild[1] = 1 << 30
    for jpeg_bytes, offsets, args in (
        (index.jpeg, index.offsets[:-1], good),  # offsets of another grid
        (index.jpeg, index.offsets, (mx, my, mw, mh, width, height, 0, mx, 0, 1)),  # a column past the last
        (index.jpeg, index.offsets, (mx, my, mw, mh, width, height, 2, 1, 0, 1)),  # c0 > c1
        (index.jpeg, index.offsets, (mx, my, mw, mh, width, height, 0, 1, -1, 1)),
        (index.jpeg, wild, good),  # an offset past the JPEG's end
        (index.jpeg[:100], index.offsets, good),  # the JPEG cut short
    ):
        with pytest.raises(ValueError):
            ext.extract(jpeg_bytes, offsets, *args)
    assert scaled_jpeg.decode_indexed(scaled_jpeg.JpegIndex(index.jpeg[:100], index.offsets, index.geometry), 8,
                                      (0, 0, 8, 8)) is None
