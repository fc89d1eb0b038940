"""Ragged batches on the client, against a real gRPC server sending hand-built samples through
batchd's real Transport (tests/batch_server.py): stacked fields stay tensors [B, ...], ragged ones
arrive as lists of B views of one buffer (zero-copy over shared memory), str / bytes as lists, over
every transport and several servers; malformed layouts raise a clear error naming the field.

To run the same checks end to end against a real dataset kind, build the expected samples with
that kind's reader and call ``batches.assert_batch_holds`` on the loader's batches. End to end on
``kind: coco`` and ``kind: segmentation``: tests/client/test_coco_served.py, test_segmentation_served.py.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import batchd
import batches
from batch_server import BatchServer
from batchd import wire
from batchd.client.transport import fields
from batchd.client.transport.receiver import to_tensors
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until

pytestmark = pytest.mark.timeout(60)

N, B = 10, 4  # batches of 4, 4 and 2 samples
TRANSPORTS = {"inline": {"transport": "inline"}, "lz4": {"transport": "inline", "compression": "lz4"},
              "shm": {"transport": "shm"}}


@pytest.fixture(scope="module")
def server():
    with BatchServer(batches.detection_samples, N) as s:
        yield s


def _loader(address, **kw) -> batchd.RemoteDataLoader:
    return batchd.RemoteDataLoader(address, "handmade", batch_size=B, **kw)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_ragged_fields_are_lists_of_views_aligned_across_fields(server, transport):
    lent_before = server.lent
    with _loader(server.address, **TRANSPORTS[transport]) as loader:
        got = list(loader)
    assert len(got) == 3
    for b, batch in enumerate(got):
        indices = list(range(b * B, min(N, (b + 1) * B)))
        assert batch["index"].tolist() == indices and batch["position"].tolist() == indices
        samples = batches.detection_samples(indices)
        assert {n for n, v in batch.items() if isinstance(v, list)} == {"image", "boxes", "labels", "masks", "name",
                                                                        "blob"}
        batches.assert_batch_holds(batch, samples)  # sample i of every list is sample index[i]
        assert [tuple(t.shape) for t in batch["boxes"]][:2] == [(0, 4), (1, 4)]  # N = 0 objects included
    assert server.lent - lent_before == (3 if transport == "shm" else 0)


def test_shared_memory_batches_are_views_of_the_slot(server):
    """Over shared memory nothing is copied: every field, each sample of a ragged one included,
    lies in the mapped slot at the offset the server laid it out at."""
    with _loader(server.address, transport="shm") as loader:
        for b, batch in enumerate(loader):
            layouts = {t.name: t for t in server.layouts[b]}
            base = batch["index"].data_ptr() - layouts["index"].offset  # the slot's first byte, mapped here
            for name, value in batch.items():
                t = layouts[name]
                if isinstance(value, torch.Tensor):
                    assert value.data_ptr() == base + t.offset, name
                elif name not in ("name", "blob"):  # str / bytes are Python objects (copies)
                    itemsize = value[0].element_size()
                    offsets = np.cumsum([0] + [v.numel() for v in value])
                    for i, v in enumerate(value):
                        if v.numel():  # (an empty tensor's data_ptr is 0)
                            assert v.data_ptr() == base + t.offset + offsets[i] * itemsize, f"{name}[{i}] was copied"


def test_one_sample_view_keeps_the_slot_lent(server):
    with _loader(server.address, transport="shm") as loader:
        batch = next(iter(loader))
        session = loader._shm.session
        mask, expected = batch["masks"][3], batch["masks"][3].clone()
        del batch
        gc.collect()
        # the pass was let go of: the batches sent behind the first go back (asynchronously, on the
        # call, which the loader keeps for its next pass): only the first stays lent
        assert wait_until(lambda: server.leases.held(session) == 1), server.leases.held(session)
        assert not wait_until(lambda: server.leases.held(session) == 0, timeout=1.0), \
            "the slot went back while a sample's tensor still lies on it"
        assert torch.equal(mask, expected)
        del mask
        gc.collect()
        assert wait_until(lambda: server.leases.held(session) == 0), "the lease did not come back"


def test_samples_with_no_objects_only():
    """Every sample without objects: masks [0, H_i, W_i] are ragged with no values at all (an empty
    buffer), boxes [0, 4] agree and are stacked [B, 0, 4]."""
    with BatchServer(lambda idx: batches.detection_samples(idx, objects=0), 6) as s:
        for transport in TRANSPORTS.values():
            with batchd.RemoteDataLoader(s.address, "handmade", batch_size=3, **transport) as loader:
                for b, batch in enumerate(loader):
                    batches.assert_batch_holds(batch, batches.detection_samples(range(3 * b, 3 * b + 3), objects=0))
                    assert tuple(batch["boxes"].shape) == (3, 0, 4) and isinstance(batch["masks"], list)


def test_a_field_is_stacked_in_a_batch_where_shapes_agree():
    # one object per sample and images of one size: every field stacks, as default_collate would
    with BatchServer(lambda idx: batches.detection_samples(idx, fixed_size=True, objects=1), 4) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=4, transport="shm") as loader:
            (batch,) = list(loader)
    assert tuple(batch["image"].shape) == (4, 6, 8, 3) and tuple(batch["boxes"].shape) == (4, 1, 4)
    batches.assert_batch_holds(batch, batches.detection_samples(range(4), fixed_size=True, objects=1))


def test_several_servers_send_the_same_lists(server):
    with BatchServer(batches.detection_samples, N) as other:
        # both unmeasured as the pass begins: each is granted its home batches (b mod 2, by
        # address), so a batch of each server is compared
        with _loader([server.address, other.address]) as both, _loader(server.address) as one:
            pairs = list(zip(both, one, strict=True))
        assert other.layouts, "the second server sent nothing"
    for b, (x, y) in enumerate(pairs):
        batches.assert_batch_holds(x, batches.detection_samples(y["index"].tolist()))
        assert x["index"].tolist() == y["index"].tolist()


def test_skipped_samples_leave_the_lists_aligned():
    with BatchServer(batches.detection_samples, N, skip={1, 9}) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=B) as loader:
            got = list(loader)
    assert [b["skipped"].tolist() for b in got if "skipped" in b] == [[1], [9]]
    for batch in got:
        batches.assert_batch_holds(batch, batches.detection_samples(batch["index"].tolist()))
    assert [len(b["boxes"]) for b in got] == [3, 4, 1]


def test_gpu_transform_refuses_images_of_different_sizes(server):
    with _loader(server.address, gpu_transform=batchd.GpuTransform()) as loader:
        with pytest.raises(ValueError, match="images of different sizes.*resize"):
            next(iter(loader))


def test_gpu_transform_finishes_stacked_images_and_leaves_the_targets():
    with BatchServer(lambda idx: batches.detection_samples(idx, fixed_size=True), 8) as s:
        finish = batchd.GpuTransform(hflip=0.5)
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=4, gpu_transform=finish) as loader:
            for b, batch in enumerate(loader):
                samples = batches.detection_samples(range(4 * b, 4 * b + 4), fixed_size=True)
                images = torch.from_numpy(np.stack([x["image"] for x in samples]))
                want = finish(images, batch["position"], seed=0, epoch=0)
                assert torch.equal(batch["image"], want)
                del samples[0]["image"]
                batches.assert_batch_holds(batch, [{k: v for k, v in x.items() if k != "image"} for x in samples])


# --- malformed batches: a clear error naming the field ------------------------------------------------


def _ragged(name="boxes", dtype="float32", shape=(4,), data=None, ndim=2, shapes=(0, 4, 1, 4), offsets=(0, 0, 4)):
    data = bytes(int(np.prod(shape)) * np.dtype(dtype).itemsize) if data is None else data
    return pb.Tensor(name=name, dtype=dtype, shape=list(shape), data=data, sample_ndim=ndim,
                     sample_shapes=list(shapes), sample_offsets=list(offsets))


MALFORMED = {
    "offsets end short": (_ragged(offsets=(0, 0, 3)), "'boxes' with offsets \\[0, 0, 3\\]"),
    "offsets decrease": (_ragged(shape=(8,), shapes=(1, 4, 0, 4, 1, 4), offsets=(0, 4, 2, 8)),
                         "'boxes' whose sample 1 has shape \\[0, 4\\] but -2 elements"),
    "offsets start late": (_ragged(offsets=(1, 1, 4)), "'boxes' with offsets"),
    "no offsets": (_ragged(shapes=(), offsets=()), "'boxes' with offsets"),
    "size differs": (_ragged(shapes=(0, 4, 2, 4)), "'boxes' whose sample 1 has shape \\[2, 4\\] but 4 elements"),
    "negative dim": (_ragged(shapes=(0, -4, 1, 4)), "'boxes' whose sample 0 has shape \\[0, -4\\]"),
    "shape count": (_ragged(shapes=(0, 4, 1)), "'boxes' with 3 shape dimensions for 2 samples"),
    "values not 1-D": (_ragged(shape=(1, 4)), "ragged field 'boxes' with values of shape \\[1, 4\\]"),
    "short data": (_ragged(data=bytes(12)), "12 bytes for field 'boxes'"),
    "stacked short data": (pb.Tensor(name="label", dtype="int64", shape=[2], data=bytes(8)),
                           "8 bytes for field 'label'"),
    "stacked str": (pb.Tensor(name="name", dtype="str", shape=[2], data=b"ab"), "str field 'name' stacked"),
    "str of 2 dims": (_ragged("name", "str", (2,), b"ab", 2, (1, 1, 1, 1), (0, 1, 2)), "'name' with 2 dimensions"),
    "not UTF-8": (_ragged("name", "str", (3,), b"a\xff\xfe", 1, (1, 2), (0, 1, 3)), "'name': sample 1 is not UTF-8"),
    "unknown dtype": (_ragged(dtype="complex7", data=b""), "dtype 'complex7'"),
    "negative shape": (pb.Tensor(name="label", dtype="int64", shape=[-2]), "field 'label' with shape \\[-2\\]"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_a_malformed_field_raises_naming_it(case):
    tensor, message = MALFORMED[case]
    index = pb.Tensor(name="index", dtype="int64", shape=[2], data=np.arange(2, dtype=np.int64).tobytes())
    batch = pb.Batch(batch_index=0, num_batches=1, tensors=[tensor, index]).SerializeToString()
    with BatchServer(batches.detection_samples, 2, messages=lambda request: [batch]) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=2, transport="inline") as loader:
            with pytest.raises(ValueError, match=message):
                next(iter(loader))


def test_fields_that_disagree_on_the_batch_size_raise_with_collate_fn():
    tensors = [_ragged(shape=(4,), shapes=(0, 4, 1, 4), offsets=(0, 0, 4)),  # 2 samples
               pb.Tensor(name="index", dtype="int64", shape=[3], data=bytes(24))]  # 3 samples
    batch = pb.Batch(batch_index=0, num_batches=1, tensors=tensors).SerializeToString()
    with BatchServer(batches.detection_samples, 3, messages=lambda request: [batch]) as s:
        with batchd.RemoteDataLoader(s.address, "handmade", batch_size=3, collate_fn=list) as loader:
            with pytest.raises(ValueError, match="disagree on its number of samples: boxes 2, index 3"):
                next(iter(loader))


# --- the device copy, on the CPU: one copy per field, then views -----------------------------------


def test_a_ragged_field_is_copied_as_one_tensor_then_split():
    """What ``CudaTransfer.to_device`` does per field (``fields.map_values``), with a counting copy:
    one copy per field, whatever B, and every sample a view of its field's copy."""
    samples = batches.detection_samples(range(5))
    message = pb.Batch(tensors=[f.proto() for f in batches.pack(samples)]).SerializeToString()
    received = to_tensors(wire.decode_batch(message))
    copies = []

    def copy(t: torch.Tensor) -> torch.Tensor:
        copies.append(t.clone())
        return copies[-1]

    moved = {name: fields.map_values(value, copy) for name, value in received.items()}
    ragged = [n for n, v in received.items() if isinstance(v, fields.Ragged)]
    assert ragged == ["image", "boxes", "labels", "masks"]
    assert len(copies) == len(ragged) + 2  # + label and index (stacked); name and blob (str, bytes) not copied
    batch = fields.unpack(moved)
    batches.assert_batch_holds(batch, samples)
    flat = fields.tensors(moved)
    for name in ragged:
        assert all(v.untyped_storage().data_ptr() == flat[name].untyped_storage().data_ptr() for v in batch[name])
    assert batch["name"] is received["name"]  # str stay where they are
