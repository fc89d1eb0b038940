"""Fast encoding of the ``batchd.v1.Batch`` message, byte-compatible with the generated code.

Pixels dominate a batch (a 256 x 224 x 224 x 3 uint8 batch is 38.5 MB). Going through the
protobuf objects costs three copies on each side (into the message, into the serialized
string, out of the parsed message). Here the server joins the tensors' buffers straight into
the serialized bytes (one copy, from shared memory) and the client slices tensors out of the
received bytes without copying (``memoryview``). Field numbers follow ``loader.proto``; a
test checks both functions against the generated ``loader_pb2`` classes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, fields
from typing import Sequence

# Batch: 1 batch_index, 2 epoch, 3 num_batches (varints), 4 tensors (messages), 5 segment, 6 lease,
#        7 skipped_indices (packed int64), 8 timings (message), 9 open_seq (varint)
# Tensor: 1 name, 2 dtype (strings), 3 shape (packed int64), 4 data (bytes), 5 offset, 6 compression,
#         7 sample_ndim (varint), 8 sample_shapes, 9 sample_offsets (packed int64)
# BatchTimings: doubles (fixed64) but 10 cache_hits, 11 worker and 13 workers (uint32 varints)
_WT_VARINT, _WT_FIXED64, _WT_LEN = 0, 1, 2
_PACKED_TENSOR_FIELDS = {3: "shape", 8: "sample_shapes", 9: "sample_offsets"}
_DOUBLE = struct.Struct("<d")
_ZERO = _DOUBLE.pack(0.0)
_pack_double, _unpack_double = _DOUBLE.pack, _DOUBLE.unpack_from


@dataclass(frozen=True, slots=True)
class WireTensor:
    """One field of a batch: numpy dtype name (or "str"/"bytes"), shape, and its raw little-endian
    C-order bytes.

    Stacked (``sample_ndim`` 0): ``shape`` is [B, ...]. Ragged (``sample_ndim`` > 0): ``shape`` is
    (total elements,), ``sample_shapes`` the B per-sample shapes flattened (B * sample_ndim ints,
    row-major) and ``sample_offsets`` the B + 1 element offsets (see ``Tensor`` in loader.proto).
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: memoryview | bytes = b""
    offset: int = 0  # into the batch's shared-memory segment, when it has one
    compression: int = 0  # loader.proto Compression
    sample_ndim: int = 0
    sample_shapes: tuple[int, ...] = ()
    sample_offsets: tuple[int, ...] = ()


@dataclass(slots=True)
class WireTimings:
    """``BatchTimings``: where a batch's time went on the server, in seconds (see loader.proto,
    which documents every field); ``cache_hits``, ``worker`` and ``workers`` are counts,
    ``workers_busy_ratio`` a ratio in [0, 1]. Field names and numbers are the proto's. (Not frozen: a frozen dataclass
    takes twice as long to build, and one is built for every batch on both sides.)"""

    queued_seconds: float = 0.0
    read_seconds: float = 0.0
    decode_seconds: float = 0.0
    pipeline_seconds: float = 0.0
    cache_seconds: float = 0.0
    write_seconds: float = 0.0
    reorder_seconds: float = 0.0
    send_seconds: float = 0.0
    read_io_seconds: float = 0.0
    cache_hits: int = 0
    worker: int = 0
    workers_busy_ratio: float = 0.0
    workers: int = 0


# field number -> name, in WireTimings' order (1..13); the ints are varints
_TIMING_FIELDS = {i: f.name for i, f in enumerate(fields(WireTimings), start=1)}
_TIMING_INTS = {10, 11, 13}
# (name, its key's bytes, a varint?) in field order: one pass, no key encoding per batch
_TIMING_LAYOUT = tuple((name, bytes([number << 3 | (_WT_VARINT if number in _TIMING_INTS else _WT_FIXED64)]),
                        number in _TIMING_INTS) for number, name in _TIMING_FIELDS.items())
_DOUBLE_KEYS = {key[0]: name for name, key, is_int in _TIMING_LAYOUT if not is_int}  # key byte -> field
_INT_KEYS = {key[0]: name for name, key, is_int in _TIMING_LAYOUT if is_int}


@dataclass(frozen=True, slots=True)
class WireBatch:
    batch_index: int
    epoch: int
    num_batches: int
    tensors: tuple[WireTensor, ...]
    segment: str = ""
    lease: int = 0
    skipped: tuple[int, ...] = ()  # samples left out of this batch (on_error: skip)
    timings: WireTimings | None = None  # None: the server sent none (an older server)
    open_seq: int = 0  # which ``open`` of its Batches call it belongs to (0: the first; StreamBatches: 0)
    # client only: the batch's fields as received on its call's data connection (TRANSPORT_SOCKET;
    # batchd.client.transport.dataplane), views of a pooled buffer; None for a batch whose bytes came otherwise
    payload: dict | None = None


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 negatives are ten-byte varints
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _key(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


def _len_field(field: int, payload_len: int) -> bytes:
    return _key(field, _WT_LEN) + _varint(payload_len)


_OPEN_SEQ_KEY = _key(9, _WT_VARINT)


def encode_timings(timings: WireTimings) -> bytes:
    """The serialized ``BatchTimings`` (zero fields omitted, in field order, as protobuf writes them)."""
    out = bytearray()
    for name, key, is_int in _TIMING_LAYOUT:
        value = getattr(timings, name)
        if is_int:
            if value:
                out += key
                out += _varint(value)
            continue
        packed = _pack_double(value)
        if packed != _ZERO:  # protobuf omits +0.0 only (it writes -0.0)
            out += key
            out += packed
    return bytes(out)


def _packed(field: int, values: Sequence[int]) -> bytes:
    """A packed repeated int64 field (nothing when empty, as protobuf writes it)."""
    if not values:
        return b""
    payload = b"".join(_varint(v) for v in values)
    return _len_field(field, len(payload)) + payload


def encode_batch(
    batch_index: int, epoch: int, num_batches: int, tensors: Sequence[WireTensor], *, segment: str = "", lease: int = 0,
    skipped: Sequence[int] = (), timings: WireTimings | None = None, open_seq: int = 0,
) -> bytes:
    """The serialized ``Batch``; each tensor's data is copied once, into the result.

    Fields are written in number order, zero/empty ones omitted, as protobuf's deterministic
    serialization writes them (the same bytes for tensors with a name and a dtype). ``timings``
    (field 8) comes after the tensors, so a caller may time the encoding of the rest; then
    ``open_seq`` (field 9).
    """
    parts: list[bytes | memoryview] = []
    for field, value in ((1, batch_index), (2, epoch), (3, num_batches)):
        if value:
            parts += [_key(field, _WT_VARINT), _varint(value)]
    for t in tensors:
        name, dtype = t.name.encode(), t.dtype.encode()
        data = t.data if isinstance(t.data, bytes) else memoryview(t.data)
        if not isinstance(data, bytes):  # cast refuses views with a 0 in their shape: send those as b""
            data = data.cast("B") if data.nbytes else b""
        head = _len_field(1, len(name)) + name + _len_field(2, len(dtype)) + dtype + _packed(3, t.shape)
        data_head = _len_field(4, len(data)) if len(data) else b""
        tail = b""
        if t.offset:
            tail += _key(5, _WT_VARINT) + _varint(t.offset)
        if t.compression:
            tail += _key(6, _WT_VARINT) + _varint(t.compression)
        if t.sample_ndim:
            tail += _key(7, _WT_VARINT) + _varint(t.sample_ndim)
        tail += _packed(8, t.sample_shapes) + _packed(9, t.sample_offsets)
        parts += [_len_field(4, len(head) + len(data_head) + len(data) + len(tail)), head, data_head, data, tail]
    if segment:
        seg = segment.encode()
        parts += [_len_field(5, len(seg)), seg]
    if lease:
        parts += [_key(6, _WT_VARINT), _varint(lease)]
    parts.append(_packed(7, skipped))
    if timings is not None:
        body = encode_timings(timings)
        parts += [_len_field(8, len(body)), body]
    if open_seq:
        parts += [_OPEN_SEQ_KEY, _varint(open_seq)]
    return b"".join(parts)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("malformed varint in Batch message")


def _skip(buf: memoryview, pos: int, wire_type: int) -> int:
    if wire_type == _WT_VARINT:
        return _read_varint(buf, pos)[1]
    if wire_type == _WT_LEN:
        n, pos = _read_varint(buf, pos)
        return pos + n
    if wire_type == 1:
        return pos + 8
    if wire_type == 5:
        return pos + 4
    raise ValueError(f"unsupported wire type {wire_type} in Batch message")


def _signed(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def _read_packed(chunk: memoryview, out: list[int]) -> None:
    p, n = 0, len(chunk)
    while p < n:
        v, p = _read_varint(chunk, p)
        out.append(_signed(v))


def _decode_tensor(buf: memoryview) -> WireTensor:
    name = dtype = ""
    repeated: dict[int, list[int]] = {field: [] for field in _PACKED_TENSOR_FIELDS}
    data: memoryview = buf[0:0]
    offset = compression = sample_ndim = 0
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wt = key >> 3, key & 7
        if wt == _WT_LEN and (field in (1, 2, 4) or field in repeated):
            n, pos = _read_varint(buf, pos)
            chunk = buf[pos : pos + n]
            if len(chunk) != n:
                raise ValueError("truncated Batch message")
            pos += n
            if field == 1:
                name = bytes(chunk).decode()
            elif field == 2:
                dtype = bytes(chunk).decode()
            elif field == 4:
                data = chunk
            else:
                _read_packed(chunk, repeated[field])
        elif wt == _WT_VARINT and field in repeated:  # unpacked repeated int64
            v, pos = _read_varint(buf, pos)
            repeated[field].append(_signed(v))
        elif wt == _WT_VARINT and field == 5:
            offset, pos = _read_varint(buf, pos)
        elif wt == _WT_VARINT and field == 6:
            compression, pos = _read_varint(buf, pos)
        elif wt == _WT_VARINT and field == 7:
            sample_ndim, pos = _read_varint(buf, pos)
            sample_ndim &= 0xFFFFFFFF  # uint32: protobuf keeps the low 32 bits of a longer varint
        else:
            pos = _skip(buf, pos, wt)
    return WireTensor(name, dtype, tuple(repeated[3]), data, offset, compression, sample_ndim,
                      tuple(repeated[8]), tuple(repeated[9]))


def decode_timings(buf: memoryview) -> WireTimings:
    """Parse a serialized ``BatchTimings`` (unknown fields skipped). Raises IndexError if truncated."""
    data = bytes(buf)  # (about 100 bytes: indexing bytes is faster than a memoryview)
    out = WireTimings()
    pos, end = 0, len(data)
    while pos < end:
        key = data[pos]
        if key < 0x80:  # every key of this message is one byte
            pos += 1
        else:
            key, pos = _read_varint(data, pos)
        name = _DOUBLE_KEYS.get(key)
        if name is not None:
            if pos + 8 > end:
                raise IndexError("truncated double")
            setattr(out, name, _unpack_double(data, pos)[0])
            pos += 8
            continue
        name = _INT_KEYS.get(key)
        if name is not None:
            v, pos = _read_varint(data, pos)
            setattr(out, name, v & 0xFFFFFFFF)  # uint32: protobuf keeps the low 32 bits
        else:
            pos = _skip(data, pos, key & 7)
    if pos != end:
        raise IndexError("truncated BatchTimings")
    return out


def decode_batch(data: bytes | memoryview) -> WireBatch:
    """Parse a serialized ``Batch``; tensor data are memoryviews into ``data`` (no copy).

    Raises ValueError on a malformed message.
    """
    buf = memoryview(data)
    header = {1: 0, 2: 0, 3: 0, 6: 0, 9: 0}
    segment = ""
    skipped: list[int] = []
    tensors: list[WireTensor] = []
    timings: WireTimings | None = None
    pos, end = 0, len(buf)
    try:
        while pos < end:
            key, pos = _read_varint(buf, pos)
            field, wt = key >> 3, key & 7
            if wt == _WT_VARINT and field in header:
                header[field], pos = _read_varint(buf, pos)
            elif wt == _WT_LEN and field == 4:
                n, pos = _read_varint(buf, pos)
                tensors.append(_decode_tensor(buf[pos : pos + n]))
                pos += n
            elif wt == _WT_LEN and field == 5:
                n, pos = _read_varint(buf, pos)
                segment = bytes(buf[pos : pos + n]).decode()
                pos += n
            elif wt == _WT_LEN and field == 7:
                n, pos = _read_varint(buf, pos)
                _read_packed(buf[pos : pos + n], skipped)
                pos += n
            elif wt == _WT_VARINT and field == 7:
                v, pos = _read_varint(buf, pos)
                skipped.append(_signed(v))
            elif wt == _WT_LEN and field == 8:  # (servers write it once)
                n, pos = _read_varint(buf, pos)
                if pos + n > end:
                    raise IndexError("truncated timings")
                timings = decode_timings(buf[pos : pos + n])
                pos += n
            else:
                pos = _skip(buf, pos, wt)
    except IndexError:
        raise ValueError("truncated Batch message") from None
    if pos != end:
        raise ValueError("truncated Batch message")
    return WireBatch(header[1], header[2], header[3], tuple(tensors), segment, header[6], tuple(skipped), timings,
                     header[9] & 0xFFFFFFFF)

