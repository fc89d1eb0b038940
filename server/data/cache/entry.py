"""One cached image as bytes: a 48-byte header, then the pixels (raw or lz4), checksummed.

Header (little-endian): magic ``BDC1``, the 16-byte key, codec (0 raw, 1 lz4 block), numpy
dtype character, ndim, one pad byte, shape as three uint32 (H, W, C; C is 1 for 2-D images and
restored as such), the payload's length (uint64) and a CRC-32 of header and payload. An entry
whose magic, key, lengths or CRC do not match is refused (``CorruptEntry``), so a torn write, a
flipped bit on disk or a truncated file is recomputed, never served.
"""

from __future__ import annotations

import struct
import zlib

import lz4.block
import numpy as np

MAGIC = b"BDC1"
_HEAD = struct.Struct("<4s16sBcBxIIIQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size  # 48
RAW, LZ4 = 0, 1
# lz4 is kept only when it saves at least this fraction (decompressing costs time on every hit)
MIN_SAVING = 0.10


class CorruptEntry(ValueError):
    """An entry's bytes fail a check (magic, key, shape, length or checksum)."""


def encode(key: bytes, image: np.ndarray, compress: bool) -> tuple[bytes, memoryview]:
    """The entry of ``image`` (numpy [H, W] or [H, W, C], any fixed-size dtype) under ``key``
    (16 bytes), as (header, payload): write them one after the other (no joined copy).
    compress: try lz4, kept if it saves at least MIN_SAVING of the bytes.

    Raises ValueError for a key that is not 16 bytes or an image that is not 2-D or 3-D.
    """
    if len(key) != 16:
        raise ValueError(f"cache key must be 16 bytes, got {len(key)}")
    if image.ndim not in (2, 3):
        raise ValueError(f"cached images are [H, W] or [H, W, C], got shape {image.shape}")
    raw = memoryview(np.ascontiguousarray(image)).cast("B")
    codec, payload = RAW, raw
    if compress:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) <= (1 - MIN_SAVING) * len(raw):
            codec, payload = LZ4, memoryview(packed)
    h, w = image.shape[:2]
    c = image.shape[2] if image.ndim == 3 else 1
    head = _HEAD.pack(MAGIC, key, codec, image.dtype.char.encode(), image.ndim, h, w, c, len(payload))
    return head + _CRC.pack(zlib.crc32(payload, zlib.crc32(head))), payload


def entry_size(buf) -> int:
    """Total bytes of the entry starting at ``buf`` (header read only). Raises CorruptEntry."""
    if len(buf) < HEADER_BYTES:
        raise CorruptEntry("truncated header")
    magic, _, _, _, _, _, _, _, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad magic")
    return HEADER_BYTES + n


def decode(buf, key: bytes) -> np.ndarray:
    """The image stored in entry ``buf`` (bytes-like, may be longer than the entry), as a new
    writable array. Raises CorruptEntry if any check fails, including a key other than ``key``."""
    if len(buf) < HEADER_BYTES:
        raise CorruptEntry("truncated header")
    magic, k, codec, char, ndim, h, w, c, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC or k != key:
        raise CorruptEntry("bad magic or another key")
    if ndim not in (2, 3) or codec not in (RAW, LZ4) or len(buf) < HEADER_BYTES + n:
        raise CorruptEntry("bad header or truncated payload")
    try:
        dtype = np.dtype(char.decode())
    except TypeError:
        raise CorruptEntry(f"unknown dtype {char!r}") from None
    shape = (h, w, c) if ndim == 3 else (h, w)
    nbytes = h * w * c * dtype.itemsize
    (crc,) = _CRC.unpack_from(buf, _HEAD.size)
    # views released before any raise: a memory-mapped file under them can then be closed
    with memoryview(buf) as mv, mv[:_HEAD.size] as head, mv[HEADER_BYTES:HEADER_BYTES + n] as payload:
        ok = zlib.crc32(payload, zlib.crc32(head)) == crc
        if ok and codec == LZ4:
            try:
                data = lz4.block.decompress(payload, uncompressed_size=nbytes, return_bytearray=True)
            except lz4.block.LZ4BlockError:
                ok, data = False, b""
        elif ok:
            data = bytearray(payload)
    if not ok:
        raise CorruptEntry("checksum mismatch or bad lz4 data")
    if len(data) != nbytes:
        raise CorruptEntry("payload length does not match the shape")
    return np.frombuffer(data, dtype).reshape(shape)
