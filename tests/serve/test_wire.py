"""batchd.wire against the generated protobuf code: same bytes in, same fields out.

Strategies are derived from the ``Batch``/``Tensor`` descriptors, so every field that both the
proto and the dataclasses ``WireBatch``/``WireTensor`` have is exercised (fields added to both
later are covered without editing this file).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from google.protobuf.descriptor import FieldDescriptor as FD
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import batches
from batchd import wire
from batchd.v1 import loader_pb2 as pb

pytestmark = pytest.mark.timeout(120)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=12)
NONEMPTY_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=12)
U64 = st.integers(0, (1 << 64) - 1)
I64 = st.integers(-(1 << 63), (1 << 63) - 1)
SMALL_DIMS = st.lists(st.integers(-3, 1 << 40) | st.sampled_from([0, -1, 1, 28]), max_size=5)
DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64", "float16", "float32", "float64", "bool"]


def common_fields(dc, message) -> list[str]:
    """Field names that the dataclass ``dc`` and the protobuf message class both have."""
    names = {f.name for f in message.DESCRIPTOR.fields}
    return [f.name for f in dataclasses.fields(dc) if f.name in names]


BATCH_FIELDS = common_fields(wire.WireBatch, pb.Batch)
TENSOR_FIELDS = common_fields(wire.WireTensor, pb.Tensor)


def test_the_core_fields_are_shared():
    assert {"batch_index", "epoch", "num_batches", "tensors", "timings"} <= set(BATCH_FIELDS)
    assert {"name", "dtype", "shape", "data"} <= set(TENSOR_FIELDS)
    # WireTimings mirrors BatchTimings field for field, in field-number order
    assert [f.name for f in dataclasses.fields(wire.WireTimings)] == [
        fd.name for fd in sorted(pb.BatchTimings.DESCRIPTOR.fields, key=lambda fd: fd.number)]


def scalar_strategy(fd):
    if fd.type in (FD.TYPE_UINT64, FD.TYPE_FIXED64):
        return U64
    if fd.type in (FD.TYPE_UINT32, FD.TYPE_FIXED32):
        return st.integers(0, (1 << 32) - 1)
    if fd.type in (FD.TYPE_INT64, FD.TYPE_SINT64, FD.TYPE_SFIXED64):
        return I64
    if fd.type in (FD.TYPE_INT32, FD.TYPE_SINT32, FD.TYPE_SFIXED32):
        return st.integers(-(1 << 31), (1 << 31) - 1)
    if fd.type == FD.TYPE_ENUM:
        return st.sampled_from(sorted(fd.enum_type.values_by_number))
    if fd.type == FD.TYPE_STRING:
        return TEXT
    if fd.type == FD.TYPE_BYTES:
        return st.binary(max_size=48)
    if fd.type == FD.TYPE_BOOL:
        return st.booleans()
    if fd.type == FD.TYPE_DOUBLE:
        return st.floats(allow_nan=False) | st.sampled_from([0.0, -0.0, 1e-6, 3600.0])
    raise NotImplementedError(f"no strategy for field {fd.full_name}")


@st.composite
def tensor_dicts(draw, nonempty_strings: bool = False):
    out = {}
    for name in TENSOR_FIELDS:
        fd = pb.Tensor.DESCRIPTOR.fields_by_name[name]
        if name == "shape":
            out[name] = draw(SMALL_DIMS | st.lists(I64, max_size=4))
        elif name == "dtype":
            out[name] = draw(st.sampled_from(DTYPES) | (NONEMPTY_TEXT if nonempty_strings else TEXT))
        elif fd.type == FD.TYPE_STRING and nonempty_strings:
            out[name] = draw(NONEMPTY_TEXT)
        elif fd.is_repeated:
            out[name] = draw(st.lists(scalar_strategy(fd), max_size=3))
        else:
            out[name] = draw(scalar_strategy(fd))
    return out


@st.composite
def message_dicts(draw, message):
    """A dict of a message's scalar fields (e.g. BatchTimings), zero often."""
    return {fd.name: draw(st.just(fd.default_value) | scalar_strategy(fd)) for fd in message.DESCRIPTOR.fields}


@st.composite
def batch_dicts(draw, nonempty_strings: bool = False):
    out = {}
    for name in BATCH_FIELDS:
        fd = pb.Batch.DESCRIPTOR.fields_by_name[name]
        if name == "tensors":
            out[name] = draw(st.lists(tensor_dicts(nonempty_strings), max_size=4))
        elif fd.message_type is not None:  # a message field (timings): absent, or its fields
            out[name] = draw(st.none() | message_dicts(getattr(pb, fd.message_type.name)))
        else:
            # zero often, so that omitted fields are exercised
            out[name] = draw(st.just(fd.default_value) | scalar_strategy(fd))
    return out


def to_proto(d: dict) -> pb.Batch:
    return pb.Batch(**{k: v for k, v in d.items() if k != "tensors" and v is not None},
                    tensors=[pb.Tensor(**t) for t in d["tensors"]])


def to_wire_args(d: dict):
    """(positional args, keyword args) of ``encode_batch`` for the batch dict ``d``."""
    tensors = [wire.WireTensor(**t) for t in d["tensors"]]
    core = (d["batch_index"], d["epoch"], d["num_batches"], tensors)
    extra = {k: v for k, v in d.items() if k not in ("batch_index", "epoch", "num_batches", "tensors")}
    if extra.get("timings") is not None:
        extra["timings"] = wire.WireTimings(**extra["timings"])
    return core, extra


def assert_same_message(w, m) -> None:
    """A wire dataclass (e.g. WireTimings) and a protobuf message: absent alike, or equal fields (bit for bit)."""
    if w is None:
        assert m is None
        return
    for fd in m.DESCRIPTOR.fields:
        got, want = getattr(w, fd.name), getattr(m, fd.name)
        assert got == want and str(got) == str(want), fd.name  # str: -0.0 is not 0.0


def assert_same(w: wire.WireBatch, m: pb.Batch) -> None:
    for name in BATCH_FIELDS:
        fd = pb.Batch.DESCRIPTOR.fields_by_name[name]
        if fd.message_type is not None and name != "tensors":
            assert_same_message(getattr(w, name), getattr(m, name) if m.HasField(name) else None)
        elif name != "tensors":
            assert getattr(w, name) == getattr(m, name), name
    assert len(w.tensors) == len(m.tensors)
    for wt, mt in zip(w.tensors, m.tensors):
        for name in TENSOR_FIELDS:
            got, want = getattr(wt, name), getattr(mt, name)
            if pb.Tensor.DESCRIPTOR.fields_by_name[name].is_repeated:  # shape, sample_shapes, sample_offsets
                assert tuple(got) == tuple(want), name
            elif name == "data":
                assert bytes(got) == bytes(want)
            else:
                assert got == want, name


# --- encode -----------------------------------------------------------------------------------


@SETTINGS
@given(batch_dicts())
def test_encode_parses_with_protobuf(d):
    args, extra = to_wire_args(d)
    data = wire.encode_batch(*args, **extra)
    assert isinstance(data, bytes)
    m = pb.Batch.FromString(data)
    assert m == to_proto(d)
    assert_same(wire.decode_batch(data), m)


@SETTINGS
@given(
    U64 | st.just(0), U64 | st.just(0), U64 | st.just(0),
    st.lists(st.tuples(NONEMPTY_TEXT, st.sampled_from(DTYPES), SMALL_DIMS, st.binary(max_size=48)), max_size=4),
)
def test_encode_is_byte_identical_to_protobuf(batch_index, epoch, num_batches, tensors):
    # for the fields of every inline batch, protobuf writes them in number order and omits
    # zero/empty ones; so does encode_batch (for tensors with a name and a dtype, as real ones have)
    got = wire.encode_batch(batch_index, epoch, num_batches, [wire.WireTensor(*t) for t in tensors])
    want = pb.Batch(
        batch_index=batch_index, epoch=epoch, num_batches=num_batches,
        tensors=[pb.Tensor(name=n, dtype=dt, shape=s, data=b) for n, dt, s, b in tensors],
    ).SerializeToString(deterministic=True)
    assert got == want


@SETTINGS
@given(
    st.sampled_from(DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=4),
    st.integers(0, 2**32 - 1),
)
def test_encode_numpy_buffers(dtype, shape, seed):
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    arr = arr.view(dtype).reshape(shape)
    t = wire.WireTensor("image", arr.dtype.name, arr.shape, memoryview(arr))
    data = wire.encode_batch(3, 1, 9, [t])
    m = pb.Batch.FromString(data)
    assert (m.batch_index, m.epoch, m.num_batches) == (3, 1, 9)
    (mt,) = m.tensors
    assert (mt.name, mt.dtype, tuple(mt.shape)) == ("image", arr.dtype.name, tuple(shape))
    assert mt.data == arr.tobytes()
    (wt,) = wire.decode_batch(data).tensors
    back = np.frombuffer(wt.data, dtype=wt.dtype).reshape(wt.shape)
    np.testing.assert_array_equal(back, arr)


@SETTINGS
@given(message_dicts(pb.BatchTimings))
def test_timings_are_byte_identical_to_protobuf(d):
    # the timings field goes last (field 8, after the tensors): as protobuf writes it
    tensor = wire.WireTensor("image", "uint8", (2,), b"ab")
    got = wire.encode_batch(5, 1, 9, [tensor], timings=wire.WireTimings(**d))
    want = pb.Batch(batch_index=5, epoch=1, num_batches=9, tensors=[pb.Tensor(name="image", dtype="uint8", shape=[2],
                                                                              data=b"ab")],
                    timings=pb.BatchTimings(**d)).SerializeToString(deterministic=True)
    assert got == want
    assert_same_message(wire.decode_batch(got).timings, pb.Batch.FromString(got).timings)


# --- decode -----------------------------------------------------------------------------------


@SETTINGS
@given(batch_dicts())
def test_decode_parses_protobuf_output(d):
    m = to_proto(d)
    w = wire.decode_batch(m.SerializeToString())
    assert_same(w, m)


def test_decode_special_cases():
    m = pb.Batch(
        num_batches=40,  # batch_index and epoch are 0: omitted
        tensors=[
            pb.Tensor(name="empty", dtype="float32", shape=[0, 3]),  # no data field on the wire
            pb.Tensor(name="neg", dtype="int64", shape=[-1, -(1 << 63), (1 << 63) - 1], data=b"\x00" * 8),
            pb.Tensor(),  # everything default
        ],
    )
    data = m.SerializeToString()
    w = wire.decode_batch(data)
    assert (w.batch_index, w.epoch, w.num_batches) == (0, 0, 40)
    assert [t.name for t in w.tensors] == ["empty", "neg", ""]
    assert w.tensors[0].shape == (0, 3) and bytes(w.tensors[0].data) == b""
    assert w.tensors[1].shape == (-1, -(1 << 63), (1 << 63) - 1)
    assert bytes(w.tensors[1].data) == b"\x00" * 8
    assert w.tensors[2].shape == () and w.tensors[2].dtype == ""
    assert isinstance(w.tensors[1].data, memoryview)  # a view of the message, not a copy
    assert wire.decode_batch(b"") == wire.decode_batch(pb.Batch().SerializeToString())
    assert wire.decode_batch(b"").tensors == ()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@st.composite
def unknown_fields(draw) -> bytes:
    """Encoded fields with numbers the schema does not use, of every wire type but groups."""
    out = b""
    for _ in range(draw(st.integers(1, 4))):
        number = draw(st.integers(100, (1 << 29) - 1))
        wt = draw(st.sampled_from([0, 1, 2, 5]))
        out += _varint(number << 3 | wt)
        if wt == 0:
            out += _varint(draw(U64))
        elif wt == 1:
            out += draw(st.binary(min_size=8, max_size=8))
        elif wt == 2:
            payload = draw(st.binary(max_size=20))
            out += _varint(len(payload)) + payload
        else:
            out += draw(st.binary(min_size=4, max_size=4))
    return out


@SETTINGS
@given(batch_dicts(), unknown_fields(), unknown_fields(), st.data())
def test_decode_skips_unknown_fields(d, before, after, data):
    m = to_proto(d)
    # unknown fields inside each tensor, and around the known fields of the batch
    head = pb.Batch(**{k: v for k, v in d.items() if k != "tensors"}).SerializeToString()
    body = b""
    for t in m.tensors:
        inner = data.draw(unknown_fields()) + t.SerializeToString() + data.draw(unknown_fields())
        body += _varint(4 << 3 | 2) + _varint(len(inner)) + inner
    raw = before + head + body + after
    parsed = pb.Batch.FromString(raw)
    assert parsed != m or not (before or after), "no unknown fields were added"
    parsed.DiscardUnknownFields()
    assert parsed == m  # the bytes are valid protobuf with the same known fields
    assert_same(wire.decode_batch(raw), m)


@SETTINGS
@given(batch_dicts())
def test_truncated_input_raises_value_error(d):
    full = to_proto(d).SerializeToString()
    assume(full)
    for cut in range(len(full)):
        part = full[:cut]
        try:
            m = pb.Batch.FromString(part)
        except DecodeError:
            with pytest.raises(ValueError):
                wire.decode_batch(part)
        else:  # a cut between two fields is a valid, shorter message
            assert_same(wire.decode_batch(part), m)


def test_truncated_in_the_middle_of_data():
    m = pb.Batch(batch_index=1, tensors=[pb.Tensor(name="image", dtype="uint8", shape=[2, 2], data=b"abcd")])
    full = m.SerializeToString()
    for cut in (len(full) - 1, len(full) - 3):
        with pytest.raises(ValueError, match="truncated"):
            wire.decode_batch(full[:cut])
    with pytest.raises(ValueError):
        wire.decode_batch(b"\x08\x80")  # field 1, a varint that never ends
    with pytest.raises(ValueError):
        wire.decode_batch(b"\x08" + b"\xff" * 11)  # a varint longer than 64 bits


# --- ragged fields (values + per-sample shapes + element offsets) ----------------------------------


def _ragged_fields(seed: int, b: int, fixed_size: bool = False):
    return batches.pack(batches.detection_samples(range(seed, seed + b), seed, fixed_size=fixed_size))


def _wire_tensor(f: batches.Field) -> wire.WireTensor:
    return wire.WireTensor(f.name, f.dtype, f.shape, f.values, sample_ndim=f.sample_ndim,
                           sample_shapes=tuple(f.flat_shapes), sample_offsets=tuple(f.offsets))


@SETTINGS
@given(st.integers(0, 2**32 - 1), st.integers(1, 9), st.booleans())
def test_ragged_batches_are_byte_identical_to_protobuf_and_decode_to_the_samples(seed, b, fixed_size):
    samples = batches.detection_samples(range(seed % 1000, seed % 1000 + b), seed, fixed_size=fixed_size)
    fields = batches.pack(samples)
    got = wire.encode_batch(7, 2, 30, [_wire_tensor(f) for f in fields], skipped=[5, 9])
    want = pb.Batch(batch_index=7, epoch=2, num_batches=30, skipped_indices=[5, 9],
                    tensors=[f.proto() for f in fields]).SerializeToString(deterministic=True)
    assert got == want
    m = pb.Batch.FromString(got)
    assert_same(wire.decode_batch(got), m)
    for mt in m.tensors:  # what the proto's comment says a client does gives back every sample's value
        values = batches.unpack(mt, mt.data)
        assert len(values) == b, mt.name
        for i, (value, sample) in enumerate(zip(values, samples)):
            want_value = sample[mt.name]
            if isinstance(want_value, str | bytes):
                assert value == want_value
            else:
                np.testing.assert_array_equal(value, want_value, err_msg=f"{mt.name}[{i}]")
                assert value.dtype == np.asarray(want_value).dtype and value.shape == np.shape(want_value)


def test_ragged_special_cases_round_trip():
    # N = 0 objects ([0, 4]), every sample empty, str and bytes (empty ones too), and a batch of none
    fields = [
        batches.Field("boxes", "float32", (4,), np.arange(4, dtype=np.float32).tobytes(), ((0, 4), (1, 4), (0, 4))),
        batches.Field("none", "float32", (0,), b"", ((0, 4), (0, 4))),
        batches.Field("name", "str", (3,), "aé".encode(), ((0,), (3,))),
        batches.Field("blob", "bytes", (2,), b"\x00\xff", ((2,), (0,))),
        batches.Field("empty_batch", "int64", (0,), b"", ()),
    ]
    got = wire.encode_batch(1, 0, 2, [_wire_tensor(f) for f in fields])
    m = pb.Batch.FromString(got)
    assert got == pb.Batch(batch_index=1, num_batches=2, tensors=[f.proto() for f in fields]).SerializeToString(
        deterministic=True)
    w = wire.decode_batch(got)
    assert_same(w, m)
    boxes, none, name, blob, empty = w.tensors
    assert (boxes.sample_ndim, boxes.sample_shapes, boxes.sample_offsets) == (2, (0, 4, 1, 4, 0, 4), (0, 0, 4, 4))
    assert (none.shape, none.sample_offsets, bytes(none.data)) == ((0,), (0, 0, 0), b"")
    assert batches.unpack(m.tensors[2], m.tensors[2].data) == ["", "aé"]
    assert batches.unpack(m.tensors[3], m.tensors[3].data) == [b"\x00\xff", b""]
    assert (empty.sample_ndim, empty.sample_shapes, empty.sample_offsets) == (1, (), (0,))  # B = 0: still ragged
    assert [a.shape for a in batches.unpack(m.tensors[0], m.tensors[0].data)] == [(0, 4), (1, 4), (0, 4)]


def test_a_shared_memory_ragged_field_carries_its_layout_without_data():
    t = wire.WireTensor("boxes", "float32", (8,), offset=4096, sample_ndim=2, sample_shapes=(2, 4, 0, 4),
                        sample_offsets=(0, 8, 8))
    data = wire.encode_batch(0, 0, 1, [t], segment="batchd-1-ab-3", lease=12)
    m = pb.Batch.FromString(data)
    assert data == m.SerializeToString(deterministic=True)
    (mt,) = m.tensors
    assert (mt.offset, mt.data, list(mt.sample_shapes), list(mt.sample_offsets)) == (4096, b"", [2, 4, 0, 4], [0, 8, 8])
    (decoded,) = wire.decode_batch(data).tensors
    assert not decoded.data and dataclasses.replace(decoded, data=b"") == t


def test_unpacked_repeated_ragged_fields_decode_too():
    # proto3 parsers must accept repeated scalars unpacked (one varint per element) as well
    def unpacked(field, values):
        return b"".join(_varint(field << 3) + _varint(v) for v in values)

    inner = (pb.Tensor(name="x", dtype="int64", shape=[2], sample_ndim=1).SerializeToString()
             + unpacked(8, [1, 1]) + unpacked(9, [0, 1, 2]))
    raw = _varint(4 << 3 | 2) + _varint(len(inner)) + inner
    m = pb.Batch.FromString(raw)
    (t,) = wire.decode_batch(raw).tensors
    (mt,) = m.tensors
    assert (t.sample_shapes, t.sample_offsets) == (tuple(mt.sample_shapes), tuple(mt.sample_offsets))
    assert t.sample_offsets == (0, 1, 2)
