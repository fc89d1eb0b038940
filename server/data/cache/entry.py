"""One cached sample as bytes: a 40-byte header, a field table, then the fields' bytes (raw or lz4), checksummed.

A value is a sample dict of fields (numpy arrays of any fixed-size dtype and shape, numpy
scalars, Python int, float, bool, str, bytes: every field of the prefix output, targets
included) or one numpy array; ``decode`` gives back the same types.

Header (little-endian): magic ``BDC2``, the 16-byte key, codec (0 raw, 1 lz4 block), three pad
bytes, the field table's length (uint32), the payload's length (uint64), then a CRC-32 of header,
table and payload. The table is JSON: ``{"fields": [[name, kind, dtype, shape, nbytes], ...],
"bare": true|false}`` (kind "array", "scalar", "str", "bytes" with their bytes in the payload; "int",
"float", "bool" with the value itself in place of dtype); the payload is each field's bytes, C
order, each padded to 16 bytes, so the decoded arrays are aligned. An entry whose magic, key,
lengths, table or CRC do not match is refused (``CorruptEntry``), so a torn write, a flipped bit
on disk, a truncated file or an entry of the older image-only format (magic ``BDC1``) is
recomputed, never served (misread as a sample it is not).
"""

from __future__ import annotations

import json
import struct
import zlib
from typing import Any

import lz4.block
import numpy as np

MAGIC = b"BDC2"
_HEAD = struct.Struct("<4s16sB3xIQ")
_CRC = struct.Struct("<I")
HEADER_BYTES = _HEAD.size + _CRC.size  # 40
RAW, LZ4 = 0, 1
# lz4 is kept only when it saves at least this fraction (decompressing costs time on every hit)
MIN_SAVING = 0.10
_PAD = 16
_SCALARS = {bool: "bool", int: "int", float: "float"}


class CorruptEntry(ValueError):
    """An entry's bytes fail a check (magic, key, table, length or checksum)."""


def _padded(n: int) -> int:
    return -(-n // _PAD) * _PAD


def encode(key: bytes, value: dict[str, Any] | np.ndarray, compress: bool) -> tuple[bytes, memoryview]:
    """The entry of ``value`` (a sample dict, or one numpy array) under ``key`` (16 bytes), as
    (header + table, payload): write them one after the other. compress: try lz4, kept if it
    saves at least MIN_SAVING of the bytes.

    Raises ValueError for a key that is not 16 bytes, TypeError for a field of another type.
    """
    if len(key) != 16:
        raise ValueError(f"cache key must be 16 bytes, got {len(key)}")
    bare = isinstance(value, np.ndarray)
    fields = {"": value} if bare else value
    table, parts, size = [], [], 0
    for name, v in fields.items():
        kind = _SCALARS.get(type(v))
        if kind is not None:
            table.append([name, kind, v, [], 0])
            continue
        if isinstance(v, str):
            kind, data = "str", v.encode("utf-8")
        elif isinstance(v, bytes):
            kind, data = "bytes", v
        elif isinstance(v, (np.ndarray, np.generic)) and v.dtype.kind not in "OUSVMm":
            kind = "array" if isinstance(v, np.ndarray) else "scalar"
            data = memoryview(np.ascontiguousarray(v)).cast("B") if v.nbytes else b""
        else:
            raise TypeError(f"cannot cache field {name!r} of type {type(v).__name__}")
        table.append([name, kind, v.dtype.str if kind in ("array", "scalar") else "", list(getattr(v, "shape", ())), len(data)])
        parts.append(data)
        size += _padded(len(data))
    raw = bytearray(size)
    at = 0
    for data in parts:
        raw[at:at + len(data)] = data
        at += _padded(len(data))
    codec, payload = RAW, memoryview(raw)
    if compress and size:
        packed = lz4.block.compress(raw, store_size=False)
        if len(packed) <= (1 - MIN_SAVING) * size:
            codec, payload = LZ4, memoryview(packed)
    meta = json.dumps({"fields": table, "bare": bare, "size": size}, separators=(",", ":")).encode()
    head = _HEAD.pack(MAGIC, key, codec, len(meta), len(payload)) + meta
    return head[:_HEAD.size] + _CRC.pack(zlib.crc32(payload, zlib.crc32(head))) + meta, payload


def entry_size(buf) -> int:
    """Total bytes of the entry starting at ``buf`` (header read only). Raises CorruptEntry."""
    if len(buf) < HEADER_BYTES:
        raise CorruptEntry("truncated header")
    magic, _, _, meta_len, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC:
        raise CorruptEntry("bad magic (or an entry of another format)")
    return HEADER_BYTES + meta_len + n


def decode(buf, key: bytes) -> dict[str, Any] | np.ndarray:
    """The value stored in entry ``buf`` (bytes-like, may be longer than the entry): its arrays new
    and writable. Raises CorruptEntry if any check fails, including a key other than ``key``."""
    if len(buf) < HEADER_BYTES:
        raise CorruptEntry("truncated header")
    magic, k, codec, meta_len, n = _HEAD.unpack_from(buf, 0)
    if magic != MAGIC or k != key:
        raise CorruptEntry("bad magic (or an entry of another format) or another key")
    start = HEADER_BYTES + meta_len
    if codec not in (RAW, LZ4) or len(buf) < start + n:
        raise CorruptEntry("bad header or truncated payload")
    (crc,) = _CRC.unpack_from(buf, _HEAD.size)
    # views released before any raise: a memory-mapped file under them can then be closed
    with memoryview(buf) as mv, mv[:_HEAD.size] as head, mv[HEADER_BYTES:start] as meta, mv[start:start + n] as payload:
        ok = zlib.crc32(payload, zlib.crc32(meta, zlib.crc32(head))) == crc
        meta = bytes(meta) if ok else b""
        try:
            table = json.loads(meta) if ok else None
            size = int(table["size"])
        except (ValueError, TypeError, KeyError):
            ok, size = False, 0
        data = b""
        if ok and codec == LZ4:
            try:
                data = lz4.block.decompress(payload, uncompressed_size=size, return_bytearray=True)
            except lz4.block.LZ4BlockError:
                ok = False
        elif ok:
            data = bytearray(payload)
    if not ok:
        raise CorruptEntry("checksum mismatch, bad field table or bad lz4 data")
    if len(data) != size:
        raise CorruptEntry("payload length does not match the field table")
    try:
        return _fields(table, data)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise CorruptEntry(f"bad field table: {e}") from None


def _fields(table: dict, data: bytearray) -> dict[str, Any] | np.ndarray:
    out: dict[str, Any] = {}
    at = 0
    for name, kind, dtype, shape, nbytes in table["fields"]:
        if kind in ("int", "float", "bool"):
            out[name] = {"int": int, "float": float, "bool": bool}[kind](dtype)
            continue
        if at + nbytes > len(data):
            raise ValueError("a field runs past the payload")
        chunk = memoryview(data)[at:at + nbytes]
        at += _padded(nbytes)
        if kind == "str":
            out[name] = str(chunk, "utf-8")
        elif kind == "bytes":
            out[name] = bytes(chunk)
        elif kind in ("array", "scalar"):
            dt = np.dtype(dtype)
            if int(np.prod(shape, dtype=np.int64)) * dt.itemsize != nbytes:
                raise ValueError(f"field {name!r}: {nbytes} bytes for {dt}{shape}")
            array = np.frombuffer(data, dt, nbytes // dt.itemsize, at - _padded(nbytes)).reshape(shape) if nbytes \
                else np.zeros(shape, dt)
            out[name] = array if kind == "array" else array[()]
        else:
            raise ValueError(f"unknown kind {kind!r}")
    return out[""] if table["bare"] else out
