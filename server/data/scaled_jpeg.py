"""JPEG decoding at M/8 of the stored size, in libjpeg-turbo's DCT domain, straight to RGB.

libjpeg-turbo can decode a JPEG at M/8 of its size (M = 1..8, and 9..16 to enlarge): each 8 x 8
block's inverse DCT then outputs M x M pixels (an area-like reduction, most of the work skipped).
``decode_eighths(buf, m)`` decodes at exactly m/8: uint8 [ceil(H * m / 8), ceil(W * m / 8), 3] RGB
of the stored frame (EXIF orientation is the caller's).

Binding: PyTurboJPEG 1.x, ctypes over the TurboJPEG 2.x API of Debian's ``libturbojpeg0``
(bookworm ships libjpeg-turbo 2.1.5; PyTurboJPEG 2.x needs TurboJPEG 3.0's ``tj3*`` functions,
and so does a decode of a cropping region, ``tj3SetCroppingRegion``). ``make install`` installs
``libturbojpeg0`` with apt; without it (or without PyTurboJPEG) ``available()`` is False and
OpenCV decodes instead: ``IMREAD_REDUCED_COLOR_2/4/8`` (1/2, 1/4, 1/8) and a BGR -> RGB copy.
Decoded pixels are the same either way (OpenCV's wheel bundles libjpeg-turbo too: full and 1/2
decodes of the photo set compare equal byte for byte).

**Which factors** (``EIGHTHS``, cheapest first for a given need): decode time per factor,
relative to a full decode, of 1,000-1,600 px photos (4:2:0, quality 90), libjpeg-turbo 2.1.5,
one core, median of 7 alternated rounds (``python -m bench.probes.scaled_decode``, 48 photos,
a full decode 2.90 ms): 1/8 0.48, 2/8 0.58, 3/8 0.85, 4/8 0.70, 5/8 1.52, 6/8 1.83, 7/8 2.32;
OpenCV's full decode and BGR -> RGB copy 1.15 (what ``reduced_decode: false`` costs). The factors that are not
powers of two have no SIMD inverse DCT or upsampling in libjpeg-turbo: 3/8 costs more than 1/2,
and 5/8-7/8 cost more than a full decode. So a need of at most m/8 is met by the cheapest factor
>= m/8 (``cheapest``), which on this library is always 1/8, 1/4, 1/2 or 1/1; ``EIGHTHS`` keeps
the measured order so that a library with faster M/8 kernels needs only a new row.

**Regions** (``decode_region``): only the MCUs that cover a rectangle of the scaled image, with
libjpeg-turbo's libjpeg API (``jpeg_skip_scanlines`` over the rows above it, ``jpeg_crop_scanline``
to its iMCU columns, and no row below it), in ``_jpeg_region.c``, a small C extension built
against Debian's ``libjpeg62-turbo-dev`` (optional: without it ``region_available()`` is False
and callers decode the whole image at m/8). The TurboJPEG API of libjpeg-turbo 2.1 has no such
call (3.0's ``tj3SetCroppingRegion``), and its lossless crop (``tjTransform``) reads every
coefficient and writes the crop again before a decode of it, more work than a whole scaled
decode. Measured as the ``COST`` figures, on one RandomResizedCrop(224) window per photo
(albumentations' defaults), each at the cheapest m/8 that keeps 224 px: the window's region 0.50
of a full decode's time, the whole image at the same m/8 0.72, OpenCV's full decode and BGR -> RGB
copy 1.20 (a second run, the machine busier: a full decode 5.2 ms). A region's pixels may differ
from the same pixels of a whole decode at its edges (libjpeg's upsampling of chroma there has no neighbour block; at most a few levels).

**Indexed JPEGs** (``index_jpeg``, ``decode_indexed``): a baseline JPEG has no way into the
middle of its entropy-coded data (Huffman codes and DC predictions chain every MCU to the one
before it), so a region decode still reads the Huffman data of every row above the region and of
its rows' whole width (``bench.probes.region_cpu`` C: 1.16 of 1.60 ms per RandomResizedCrop(224)
image, 0.25 of it above the region). ``index_jpeg`` rewrites a JPEG once, losslessly (its DCT
coefficients as they are, as ``jpegtran -restart 1B`` does; about 7 ms for a 1,500 px photo, 1.15x
its bytes), with a restart marker before every MCU, and notes where each MCU's data begins. From
it ``decode_indexed`` cuts, without decoding, a JPEG of the MCUs under the rectangle and one MCU
more on each side (``_jpeg_region.extract``; restarts reset every predictor, so each MCU
decodes alone) and decodes that with ``decode_region``: only the rectangle's Huffman data is read,
and the pixels are the same bytes as ``decode_region`` of the original file (the same
coefficients, cropped to the same iMCU columns; the extra MCUs give the upsampling its neighbours:
tests/data/test_jpeg_index.py). Measured on Table 20's photos, one window each: 1.64 ms
(``decode_region``) against 1.24 ms. The server keeps such indexes in its cache
(server/compute/samples.py ``_indexed``); a sample decodes to the same bytes with or without one.

Errors: anything the binding raises (a CMYK or 12-bit JPEG it cannot turn into RGB, corrupt
data) falls back to OpenCV, whose errors the caller (``decode.decode_rgb``) reports as today.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import cv2
import numpy as np

# m (eighths) by the measured cost of a decode at m/8 (module docstring), cheapest first
COST = {1: 0.48, 2: 0.58, 4: 0.70, 3: 0.85, 8: 1.00, 5: 1.52, 6: 1.83, 7: 2.32}
EIGHTHS = tuple(sorted(COST, key=COST.get))
_CV2_REDUCED = {1: cv2.IMREAD_REDUCED_COLOR_8, 2: cv2.IMREAD_REDUCED_COLOR_4, 4: cv2.IMREAD_REDUCED_COLOR_2,
                8: cv2.IMREAD_COLOR}


@functools.cache
def _turbo():
    """PyTurboJPEG's ``TurboJPEG`` over the system's libturbojpeg, or None (not installed, or a
    library it cannot load)."""
    try:
        import turbojpeg

        return turbojpeg.TurboJPEG()
    except Exception:  # ImportError, OSError (no library), RuntimeError (PyTurboJPEG 2.x on TurboJPEG 2.x)
        return None


def available() -> bool:
    """Whether libjpeg-turbo's TurboJPEG API is loaded (every M/8; else OpenCV: 1/8, 1/4, 1/2, 1)."""
    return _turbo() is not None


def backend() -> str:
    """What decodes: ``"turbojpeg <PyTurboJPEG version>"`` or ``"opencv"`` (part of the build fingerprint)."""
    if not available():
        return "opencv"
    from importlib.metadata import PackageNotFoundError, version

    try:
        return f"turbojpeg {version('PyTurboJPEG')}"
    except PackageNotFoundError:
        return "turbojpeg"


def factors() -> tuple[int, ...]:
    """The m of the m/8 factors this backend decodes at, cheapest first."""
    return EIGHTHS if available() else tuple(m for m in EIGHTHS if m in _CV2_REDUCED)


def cheapest(need: float) -> int:
    """The m (1..8) of the cheapest factor m/8 >= ``need`` (a fraction of the stored size; 8 when
    ``need`` > 1/2 on this library, see the module docstring)."""
    for m in factors():
        if m >= 8 * need - 1e-9:
            return m
    return 8


def scaled_size(height: int, width: int, m: int) -> tuple[int, int]:
    """(height, width) of an image ``height`` x ``width`` decoded at m/8 (libjpeg rounds up)."""
    return -(-height * m // 8), -(-width * m // 8)


def decode_eighths(buf: np.ndarray, m: int) -> np.ndarray | None:
    """``buf`` (a JPEG, uint8 [n]) decoded at m/8: uint8 [ceil(H*m/8), ceil(W*m/8), 3] RGB, stored
    frame (no EXIF orientation). None if neither libjpeg-turbo nor OpenCV can decode it at m/8.
    Raises ValueError for an m this backend does not offer (``factors``)."""
    if m not in factors():
        raise ValueError(f"cannot decode at {m}/8 with {backend()} (factors: {sorted(factors())})")
    turbo = _turbo()
    if turbo is not None:
        import turbojpeg

        try:
            return turbo.decode(buf, pixel_format=turbojpeg.TJPF_RGB, scaling_factor=None if m == 8 else _fraction(m))
        except Exception:
            pass  # decoded by OpenCV below (its errors are the caller's to report)
    if m not in _CV2_REDUCED:
        return None
    try:
        bgr = cv2.imdecode(buf, _CV2_REDUCED[m] | cv2.IMREAD_IGNORE_ORIENTATION)
    except cv2.error:
        return None
    return None if bgr is None else cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)


@functools.cache
def _region():
    """The C extension (``_jpeg_region.c``), or None when it was not built."""
    try:
        from batchd.server.data import _jpeg_region

        return _jpeg_region
    except ImportError:
        return None


def region_available() -> bool:
    """Whether regions are decoded alone (``decode_region``); else callers decode whole images."""
    return _region() is not None


def extension():
    """The C extension (``_jpeg_region.c``: ``decode``, ``resample``, ``entropy``), or None when
    it was not built."""
    return _region()


def scaled_window(window: tuple[int, int, int, int], m: int, height: int, width: int,
                  margin: int = 2) -> tuple[int, int, int, int]:
    """The rectangle ``(x, y, w, h)`` of an image ``height`` x ``width`` decoded at m/8 that
    covers ``window`` ``(x1, y1, x2, y2)`` (full-size pixels) with ``margin`` scaled pixels more
    on each side (an interpolation reads its neighbours), clipped to the scaled image."""
    sh, sw = scaled_size(height, width, m)
    x1, y1, x2, y2 = window
    x, y = max(0, x1 * m // 8 - margin), max(0, y1 * m // 8 - margin)
    ex, ey = min(sw, -(-x2 * m // 8) + margin), min(sh, -(-y2 * m // 8) + margin)
    return x, y, max(1, ex - x), max(1, ey - y)


def decode_region(buf: np.ndarray, m: int, rect: tuple[int, int, int, int]) -> np.ndarray | None:
    """The rectangle ``rect`` = (x, y, w, h) of the JPEG ``buf`` decoded at m/8 (stored frame):
    uint8 [h, w, 3] RGB (a view), only its MCUs decoded; None without the extension or if libjpeg
    cannot decode it so (the caller decodes the whole image)."""
    ext = _region()
    if ext is None:
        return None
    x, y, w, h = rect
    try:
        pixels, x0, width = ext.decode(buf, m, x, y, w, h)
    except (RuntimeError, ValueError):
        return None
    image = np.frombuffer(pixels, np.uint8).reshape(h, width, 3)
    return image[:, x - x0:x - x0 + w]


def _fraction(m: int) -> tuple[int, int]:
    """m/8 in lowest terms, as TurboJPEG lists its scaling factors."""
    import math

    g = math.gcd(m, 8)
    return m // g, 8 // g


@dataclass(frozen=True, slots=True)
class JpegIndex:
    """A JPEG rewritten with a restart marker before every MCU (``index_jpeg``).

    jpeg: uint8 [n bytes], the rewritten file; offsets: int32 [mcus_x * mcus_y + 1], where each
    MCU's entropy-coded data begins in it, then the end of its end-of-image marker; geometry:
    int64 [6], (mcu_w, mcu_h, mcus_x, mcus_y, width, height): an MCU's size and the image's, in pixels.
    """

    jpeg: np.ndarray
    offsets: np.ndarray
    geometry: np.ndarray

    def as_sample(self) -> dict:
        """The fields as a cache entry stores them (``from_sample`` turns them back)."""
        return {"jpeg": self.jpeg, "offsets": self.offsets, "geometry": self.geometry}

    @classmethod
    def from_sample(cls, sample: dict) -> "JpegIndex":
        return cls(sample["jpeg"], sample["offsets"], sample["geometry"])

    @property
    def nbytes(self) -> int:
        return self.jpeg.nbytes + self.offsets.nbytes + self.geometry.nbytes


def index_jpeg(buf) -> JpegIndex | None:
    """``buf`` (a JPEG's bytes) rewritten losslessly with a restart marker before every MCU
    (module docstring), or None without the extension or for a JPEG libjpeg cannot rewrite so
    (corrupt, arithmetic-coded, 12-bit). Markers other than the frame's, tables and the scan's
    are not kept (EXIF, ICC): index only JPEGs that need no EXIF orientation."""
    ext = _region()
    if ext is None:
        return None
    try:
        jpeg, offsets, *geometry = ext.index(buf)
    except (RuntimeError, ValueError):
        return None
    return JpegIndex(np.frombuffer(jpeg, np.uint8), np.frombuffer(offsets, np.int32), np.array(geometry, np.int64))


def decode_indexed(index: JpegIndex, m: int, rect: tuple[int, int, int, int]) -> np.ndarray | None:
    """``decode_region(original, m, rect)`` from the original's ``index_jpeg``: the same uint8
    [h, w, 3] RGB, of which only the MCUs under ``rect`` (and a row above and below) are read.
    None if the extension cannot cut or decode it (the caller decodes the original)."""
    ext = _region()
    if ext is None:
        return None
    mw, mh, mx, my, width, height = (int(v) for v in index.geometry)
    x, y, w, h = rect
    sw, sh = mw * m // 8, mh * m // 8  # an MCU at m/8 (whole pixels: an MCU is 8, 16 or 32 pixels wide)
    # the MCUs under the rectangle and one more on each side: the neighbours libjpeg's upsampling
    # reads there when it decodes the original (decode_region then crops as on the original)
    c0, c1 = max(0, x // sw - 1), min(mx - 1, (x + w - 1) // sw + 1)
    r0, r1 = max(0, y // sh - 1), min(my - 1, (y + h - 1) // sh + 1)
    try:
        cut = ext.extract(index.jpeg, index.offsets, mx, my, mw, mh, width, height, c0, c1, r0, r1)
    except (ValueError, OverflowError):
        return None
    return decode_region(np.frombuffer(cut, np.uint8), m, (x - c0 * sw, y - r0 * sh, w, h))
