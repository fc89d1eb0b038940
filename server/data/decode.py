"""Decoding: an image file's bytes to RGB pixels, and what can be read from its header first.

* ``decode_rgb`` (``read_rgb`` for a local file): ``cv2.imdecode`` to uint8 [H, W, 3] RGB, with
  the checks that make a bad file a ``SampleError`` reason instead of a crash or a wrong image
  (``ImageReadError``: empty, truncated JPEG, not decodable, over ``max_pixels``);
* reduced decoding: a JPEG larger than the pipeline needs is decoded at the cheapest M/8 of its
  size that still gives those pixels (``min_size``), or at the m/8 the caller chose (``eighths``;
  the region decoding of random crops, server/compute/region.py), in libjpeg-turbo's DCT domain
  (``scaled_jpeg.py``), most of the work skipped; ``decode_flag`` is the 1/2-1/4-1/8 rule that
  JPEG batches sent undecoded follow (a client's decoder offers only these);
* EXIF orientation: read from a JPEG's APP1 segment (``jpeg_orientation``, ``exif_orientation``),
  applied by OpenCV unless the stored frame is wanted (``upright`` False); turning targets with
  the image is the datasets' (``datasets/_orientation.py``);
* headers without decoding: an image's size (``image_size``), a JPEG's frame header
  (``jpeg_frame``) and whether its scans end (``jpeg_truncated``), also for JPEG batches sent
  undecoded (server/compute/encoded.py).
"""

from __future__ import annotations

import struct

import cv2
import numpy as np

from batchd.server.data import scaled_jpeg

DEFAULT_MAX_PIXELS = 1 << 28


class ImageReadError(Exception):
    """A file could not be turned into an image; ``reason`` says why (for SampleError)."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def image_size(buf: np.ndarray) -> tuple[int, int] | None:
    """``(width, height)`` read from the header of an encoded PNG, JPEG, GIF, BMP or WebP image,
    or None if the format is not one of these or the header is not where expected. Never decodes.
    """
    mv = memoryview(buf).cast("B")
    head = bytes(mv[:32])
    try:
        if head.startswith(b"\x89PNG\r\n\x1a\n") and head[12:16] == b"IHDR":
            return struct.unpack_from(">II", mv, 16)
        if head[:6] in (b"GIF87a", b"GIF89a"):
            return struct.unpack_from("<HH", mv, 6)
        if head[:2] == b"BM":
            (dib,) = struct.unpack_from("<I", mv, 14)
            if dib == 12:
                return struct.unpack_from("<HH", mv, 18)
            w, h = struct.unpack_from("<ii", mv, 18)
            return abs(w), abs(h)
        if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
            chunk = head[12:16]
            if chunk == b"VP8 " and head[23:26] == b"\x9d\x01\x2a":
                w, h = struct.unpack_from("<HH", mv, 26)
                return w & 0x3FFF, h & 0x3FFF
            if chunk == b"VP8L" and head[20] == 0x2F:
                (bits,) = struct.unpack_from("<I", mv, 21)
                return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
            if chunk == b"VP8X":
                w = int.from_bytes(head[24:27], "little") + 1
                h = int.from_bytes(head[27:30], "little") + 1
                return w, h
            return None
        if head[:2] == b"\xff\xd8":
            frame = jpeg_frame(mv)
            if frame is None:
                return None
            h, w = struct.unpack_from(">HH", mv, frame[1] + 5)
            return (w, h) if w and h else None
    except (struct.error, IndexError):
        return None
    return None


def jpeg_frame(mv: memoryview) -> tuple[int, int] | None:
    """``(marker, offset)`` of a JPEG's frame header (its SOFn segment: 0xC0-0xCF but DHT, JPG
    and DAC), found by walking the marker segments that follow the SOI marker (the caller has
    checked ``mv[:2]``); ``mv`` is the file's bytes. The segment's fields (precision, height,
    width, components) start at ``offset + 4``. None when the walk meets a byte that is not a
    marker, the end of image or a scan first, or the end of ``mv``. Never raises.
    """
    n, pos = len(mv), 2
    while pos + 4 <= n:
        if mv[pos] != 0xFF:
            return None
        marker = mv[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image / start of scan before any frame header
            return None
        if 0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC):  # SOFn
            return marker, pos
        (length,) = struct.unpack_from(">H", mv, pos + 2)
        pos += 2 + length
    return None


def jpeg_orientation(mv: memoryview) -> int:
    """The EXIF orientation (1-8) of a JPEG, from the IFD0 of its APP1 "Exif" segment; 1 (upright)
    when there is none or it cannot be read. 5-8 turn the image a quarter: the decoded image is
    the stored one with height and width swapped (OpenCV applies the orientation). ``mv`` is the
    file's bytes (the caller has checked ``mv[:2]``). Never raises."""
    n, pos = len(mv), 2
    try:
        while pos + 4 <= n and mv[pos] == 0xFF:
            marker = mv[pos + 1]
            if marker == 0xFF:  # fill byte
                pos += 1
                continue
            if marker in (0xD9, 0xDA) or (0xC0 <= marker <= 0xCF and marker not in (0xC4, 0xC8, 0xCC)):
                return 1  # the image data starts: EXIF comes before
            (length,) = struct.unpack_from(">H", mv, pos + 2)
            if marker == 0xE1 and bytes(mv[pos + 4:pos + 10]) == b"Exif\0\0":
                return _tiff_orientation(bytes(mv[pos + 10:pos + 2 + length]))
            pos += 2 + length
    except (struct.error, IndexError, ValueError):
        pass
    return 1


def exif_orientation(data) -> int:
    """The EXIF orientation (1-8) of an encoded image's bytes (bytes-like or uint8 array): a
    JPEG's (``jpeg_orientation``), 1 for any other format or none. Never raises."""
    mv = memoryview(data).cast("B")
    return jpeg_orientation(mv) if bytes(mv[:2]) == b"\xff\xd8" else 1


def _tiff_orientation(tiff: bytes) -> int:
    """Tag 0x0112 (Orientation, SHORT) of the first IFD of a TIFF header block, or 1."""
    order = {b"II": "<", b"MM": ">"}.get(tiff[:2])
    if order is None or struct.unpack_from(order + "H", tiff, 2)[0] != 42:
        return 1
    (ifd,) = struct.unpack_from(order + "I", tiff, 4)
    (count,) = struct.unpack_from(order + "H", tiff, ifd)
    for i in range(count):
        tag, kind, _, value = struct.unpack_from(order + "HHI4s", tiff, ifd + 2 + 12 * i)
        if tag == 0x0112 and kind == 3:  # SHORT: in the first two bytes of the value field
            (orientation,) = struct.unpack_from(order + "H", value)
            return orientation if 1 <= orientation <= 8 else 1
    return 1


def jpeg_truncated(buf: np.ndarray) -> bool:
    """True if a JPEG has no end-of-image marker after its last start-of-scan marker.

    Neither marker can occur inside entropy-coded data (0xFF is stuffed as 0xFF00), so a file
    cut anywhere in its scans fails this; trailing bytes after a complete image do not.
    """
    tail = buf[-64:].tobytes().rstrip(b"\0")
    if tail.endswith(b"\xff\xd9"):
        return False  # the common case, without copying the file
    data = buf.tobytes()
    sos = data.rfind(b"\xff\xda")
    return sos < 0 or data.find(b"\xff\xd9", sos) < 0


_REDUCED = ((8, cv2.IMREAD_REDUCED_COLOR_8), (4, cv2.IMREAD_REDUCED_COLOR_4), (2, cv2.IMREAD_REDUCED_COLOR_2))


def decode_flag(buf: np.ndarray, size: tuple[int, int] | None, min_size: tuple[int, int] | None,
                 upright: bool = True) -> int:
    """IMREAD_COLOR, or the largest JPEG DCT-domain reduction (1/2, 1/4, 1/8) whose output is
    still at least ``min_size`` (height, width, or ``(side,)``: ``min_dims``) once turned
    upright (EXIF orientation 5-8 swap the stored width and height): libjpeg then skips most of
    the work. ``upright`` False: with IMREAD_IGNORE_ORIENTATION (the stored pixels, not turned)."""
    keep = 0 if upright else cv2.IMREAD_IGNORE_ORIENTATION
    if min_size is None or size is None or buf[:2].tobytes() != b"\xff\xd8":
        return cv2.IMREAD_COLOR | keep
    w, h = size
    if upright and jpeg_orientation(memoryview(buf).cast("B")) >= 5:
        w, h = h, w
    min_size = min_dims(min_size, h, w)
    for factor, flag in _REDUCED:
        if -(-h // factor) >= min_size[0] and -(-w // factor) >= min_size[1]:  # libjpeg rounds up
            return flag | keep
    return cv2.IMREAD_COLOR | keep


def upright_size(data, upright: bool = True) -> tuple[int, int] | None:
    """``(height, width)`` of a JPEG as ``decode_rgb`` returns it at full size (EXIF orientation
    5-8 swap them when ``upright``), read from its headers; None for any other format, or a
    header that cannot be read. Never raises, never decodes."""
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if buf[:2].tobytes() != b"\xff\xd8":
        return None
    size = image_size(buf)
    if size is None:
        return None
    w, h = size
    if upright and jpeg_orientation(memoryview(buf).cast("B")) >= 5:
        w, h = h, w
    return h, w


def min_dims(min_size: tuple[int, ...], height: int, width: int) -> tuple[int, int]:
    """``min_size`` as (height, width) for an image ``height`` x ``width`` (upright): a 2-tuple
    as it is; a 1-tuple ``(side,)`` (``LongestMaxSize(side)`` first) the size that resize gives,
    its longest side ``side`` and the other in proportion."""
    if len(min_size) == 2:
        return min_size[0], min_size[1]
    scale = min_size[0] / max(height, width, 1)
    return max(1, round(height * scale)), max(1, round(width * scale))


def _eighths_for(buf: np.ndarray, size: tuple[int, int], min_size: tuple[int, ...], upright: bool) -> int:
    """The m of the cheapest factor m/8 (``scaled_jpeg.EIGHTHS``) whose output is at least
    ``min_size`` (height, width) once upright; 8 if none is smaller. libjpeg rounds up, so with
    1/2, 1/4 and 1/8 this is ``decode_flag``'s choice."""
    w, h = size
    if upright and jpeg_orientation(memoryview(buf).cast("B")) >= 5:
        w, h = h, w
    min_size = min_dims(min_size, h, w)
    for m in scaled_jpeg.factors():
        if m == 8:
            return 8
        sh, sw = scaled_jpeg.scaled_size(h, w, m)
        if sh >= min_size[0] and sw >= min_size[1]:
            return m
    return 8


def _decode_scaled(buf: np.ndarray, m: int, upright: bool) -> np.ndarray | None:
    """A JPEG decoded at m/8 (``scaled_jpeg.decode_eighths``), turned by its EXIF orientation when
    ``upright`` (as OpenCV turns it); None if it cannot be decoded that way."""
    image = scaled_jpeg.decode_eighths(buf, m)
    if image is None or not upright:
        return image
    orientation = jpeg_orientation(memoryview(buf).cast("B"))
    if orientation == 1:
        return image
    from batchd.server.data.datasets._orientation import orient_pixels  # (datasets import this module)

    return orient_pixels(image, orientation)


def _decode_window(buf: np.ndarray, m: int, window: tuple[int, int, int, int], upright: bool,
                   jpeg_index: "scaled_jpeg.JpegIndex | None" = None) -> np.ndarray | None:
    """The rectangle of a JPEG at m/8 that covers ``window`` (``decode_rgb``), its MCUs alone
    decoded (from ``jpeg_index`` when it is this JPEG's, the same pixels); None when the JPEG is
    turned (EXIF orientation 2-8 and ``upright``), its header cannot be read, or the region
    decoder cannot decode it."""
    if upright and jpeg_orientation(memoryview(buf).cast("B")) != 1:
        return None
    size = upright_size(buf, upright=False)
    if size is None:
        return None
    rect = scaled_jpeg.scaled_window(window, m, *size)
    if jpeg_index is not None and (int(jpeg_index.geometry[5]), int(jpeg_index.geometry[4])) == size:
        image = scaled_jpeg.decode_indexed(jpeg_index, m, rect)
        if image is not None:
            return image
    return scaled_jpeg.decode_region(buf, m, rect)


def read_rgb(path: str, max_pixels: int = DEFAULT_MAX_PIXELS, min_size: tuple[int, int] | None = None) -> np.ndarray:
    """Read and decode an image file: uint8 [H, W, 3], RGB (``decode_rgb`` of its bytes).

    Raises ImageReadError: ``cannot read file: [Errno N] ...`` (missing, unreadable, a folder),
    or one of ``decode_rgb``'s reasons.
    """
    try:
        buf = np.fromfile(path, dtype=np.uint8)
    except OSError as e:
        raise ImageReadError(f"cannot read file: [Errno {e.errno}] {e.strerror}") from None
    return decode_rgb(buf, max_pixels, min_size)


def decode_rgb(data, max_pixels: int = DEFAULT_MAX_PIXELS, min_size: tuple[int, int] | None = None,
               upright: bool = True, eighths: int | None = None,
               window: tuple[int, int, int, int] | None = None, jpeg_index=None) -> np.ndarray:
    """Decode an encoded image (bytes-like or uint8 array): uint8 [H, W, 3], RGB.

    Decodes with ``cv2.imdecode(..., cv2.IMREAD_COLOR)``: grey images get three equal channels,
    alpha is dropped, 16-bit images are scaled to 8 bits, and EXIF orientation is applied
    (``upright`` False: not applied, ``IMREAD_IGNORE_ORIENTATION``: the stored pixels, the frame
    Pillow's ``Image.open`` and pycocotools' annotations use; tests/data/test_exif_frame.py).
    With ``min_size`` (height, width), a JPEG is decoded by libjpeg-turbo straight to RGB at the
    cheapest factor m/8 whose output is still at least that size once upright (``scaled_jpeg``:
    1/8, 1/4, 1/2 or 1/1 on libjpeg-turbo 2.1; the pipeline downsizes it anyway; a 1000x750 JPEG
    decodes about 2x faster at 1/2). ``eighths`` (1-8): a JPEG decoded at exactly that m/8 of its
    size (an m ``scaled_jpeg.factors()`` offers), [ceil(H*m/8), ceil(W*m/8), 3] once upright;
    with ``window`` (x1, y1, x2, y2; full-size pixels once upright) only the rectangle
    ``scaled_jpeg.scaled_window(window, m, H, W)`` of that image, [h, w, 3] (a view): its MCUs
    alone decoded (``scaled_jpeg.decode_region``) when the JPEG is not turned (EXIF orientation
    1, or ``upright`` False), else cut from the whole image at m/8; ``jpeg_index``
    (``scaled_jpeg.index_jpeg`` of ``data``): that rectangle cut from it, the same bytes.
    Neither: OpenCV at full size, as always (``reduced_decode: false``). Pixels are the same
    whichever library decodes a given size.

    Raises ImageReadError whose reason is one of: ``empty file (0 bytes)``, ``truncated JPEG:
    ...``, ``not a decodable image (N bytes)``, ``image too large: WxH = P pixels > max_pixels M``.
    """
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, dtype=np.uint8)
    if buf.size == 0:
        raise ImageReadError("empty file (0 bytes)")
    size = image_size(buf)
    if size is not None and size[0] * size[1] > max_pixels:
        raise ImageReadError(f"image too large: {size[0]}x{size[1]} = {size[0] * size[1]} pixels > max_pixels {max_pixels}")
    if buf[:2].tobytes() == b"\xff\xd8" and jpeg_truncated(buf):
        # OpenCV >= 5 rejects these; 4.x returns the decoded part with grey below it.
        raise ImageReadError(f"truncated JPEG: no end-of-image marker after the last scan ({buf.size} bytes)")
    if (eighths is not None or (min_size is not None and size is not None)) and buf[:2].tobytes() == b"\xff\xd8":
        m = eighths if eighths is not None else _eighths_for(buf, size, min_size, upright)
        image = None if window is None else _decode_window(buf, m, window, upright, jpeg_index)
        if image is None:
            image = _decode_scaled(buf, m, upright)
            if image is not None and window is not None:
                h, w = image.shape[:2]
                full = (h, w) if m == 8 else upright_size(buf, upright)
                x, y, rw, rh = scaled_jpeg.scaled_window(window, m, *full)
                image = image[y:y + rh, x:x + rw]
        if image is not None:
            h, w = image.shape[:2]
            if h * w > max_pixels:
                raise ImageReadError(f"image too large: {w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
            return image
    try:
        bgr = cv2.imdecode(buf, decode_flag(buf, size, min_size, upright))
    except cv2.error:
        bgr = None
    if bgr is None:
        raise ImageReadError(f"not a decodable image ({buf.size} bytes)")
    h, w = bgr.shape[:2]
    if h * w > max_pixels:
        raise ImageReadError(f"image too large: {w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
    return cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)
