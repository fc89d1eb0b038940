"""Batches of sample dicts (server/compute/collate.py, through a real worker and real slots):
stacked where shapes agree (as torch's default_collate), lists where they do not or the field
is per-object; dtype errors name the field and both samples."""

from __future__ import annotations

import pathlib

import albumentations as A
import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import batchd
from batchd.server.compute.protocol import TensorLayout
from helpers import write_png
from inworker import InWorker

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"


@pytest.fixture(scope="module")
def pydata_path():
    import sys

    sys.path.insert(0, str(PYDATA))  # the worker runs in this process: import as the server would
    yield PYDATA
    sys.path.remove(str(PYDATA))


def mixed(**args) -> dict:
    return {"kind": "python", "factory": "batchd_testdata:Mixed", "args": args}


def layouts(done) -> dict[str, TensorLayout]:
    return {t.name: t for t in done.tensors}


def test_a_classification_batch_is_stacked_as_default_collate_stacks_it(fmnist_root, tmp_path):
    with InWorker({"f": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}, tmp_path) as w:
        indices = [5, 0, 77, 9999, 3]
        done, got = w.batch("f", indices, A.Compose([A.HorizontalFlip(p=1)]))
        ds = w.worker.dataset("f")
        want = default_collate([{"image": torch.from_numpy(ds.load_image(i)[:, ::-1].copy()),
                                 "label": ds.label(i)} for i in indices])
    assert [t.name for t in done.tensors] == ["index", "position", "image", "label"]
    assert all(t.sample_shapes is None for t in done.tensors), "a classification batch is stacked"
    assert done.tensors[0].shape == (5,)  # tensors[0]: the batch size, whatever the fields
    for name in ("image", "label"):
        assert got[name].dtype == want[name].numpy().dtype and np.array_equal(got[name], want[name].numpy()), name
    assert got["index"].tolist() == indices and got["position"].tolist() == list(range(5))


def test_images_of_two_sizes_come_as_a_list_nothing_padded(tmp_path):
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (8, 8, 3), np.uint8), rng.integers(0, 256, (10, 12, 3), np.uint8)]
    for i, image in enumerate(images):
        write_png(tmp_path / "folder" / "a" / f"{i}.png", image)
    with InWorker({"mixed": {"kind": "imagefolder", "root": str(tmp_path / "folder")}}, tmp_path) as w:
        done, got = w.batch("mixed", [1, 0, 1])
    image = layouts(done)["image"]
    assert image.sample_shapes == ((10, 12, 3), (8, 8, 3), (10, 12, 3)) and image.shape == (360 + 192 + 360,)
    for value, i in zip(got["image"], [1, 0, 1]):
        assert np.array_equal(value, images[i])
    assert got["label"].tolist() == [0, 0, 0] and layouts(done)["label"].sample_shapes is None


def test_every_kind_of_field_is_stacked_or_listed_as_documented(pydata_path, tmp_path):
    import batchd_testdata

    ref = batchd_testdata.Mixed()
    with InWorker({"m": mixed()}, tmp_path) as w:
        indices = [3, 4, 7, 6, 0]
        done, got = w.batch("m", indices)
    lay = layouts(done)
    samples = [ref[i] for i in indices]
    # stacked exactly as default_collate stacks them (numbers, bools, equal-shape arrays, torch tensors)
    want = default_collate([{k: samples[j][k] for k in ("image", "label", "weight", "flag", "vec", "t")}
                            for j in range(len(samples))])
    for name, value in want.items():
        assert lay[name].sample_shapes is None, f"{name} should be stacked"
        assert got[name].dtype == value.numpy().dtype, (name, got[name].dtype, value.dtype)
        assert np.array_equal(got[name], value.numpy()), name
    assert lay["label"].dtype == "int64" and lay["weight"].dtype == "float64" and lay["flag"].dtype == "bool"
    # str and bytes: always lists; per-object boxes: a list even where N agrees
    assert got["name"] == [s["name"] for s in samples] and lay["name"].dtype == "str"
    assert got["raw"] == [s["raw"] for s in samples] and lay["raw"].dtype == "bytes"
    assert lay["boxes"].sample_shapes == tuple(s["boxes"].shape for s in samples)
    assert [b.shape[0] for b in got["boxes"]] == [0, 1, 1, 0, 0]  # N = 0 included
    for b, s in zip(got["boxes"], samples):
        assert b.dtype == np.float32 and np.array_equal(b, s["boxes"])
    with InWorker({"m": mixed()}, tmp_path) as w:
        same_n, _ = w.batch("m", [1, 4, 7])  # N = 1 in each
    assert layouts(same_n)["boxes"].sample_shapes == ((1, 4),) * 3, "per-object fields are lists even when N agrees"


def test_a_field_that_turns_ragged_mid_batch_keeps_the_samples_before(pydata_path, tmp_path):
    """The fast path writes image into the slot per sample; sample 3 disagrees and the field becomes a list."""
    import batchd_testdata

    ref = batchd_testdata.Mixed(ragged_images=True)
    with InWorker({"m": mixed(ragged_images=True)}, tmp_path) as w:
        indices = [0, 3, 6, 1, 4, 2]  # heights 8, 8, 8, 9, 9, 10
        done, got = w.batch("m", indices)
    assert layouts(done)["image"].sample_shapes == ((8, 8, 3),) * 3 + ((9, 8, 3),) * 2 + ((10, 8, 3),)
    for value, i in zip(got["image"], indices):
        assert np.array_equal(value, ref[i]["image"]), i
    assert np.array_equal(got["vec"], np.stack([ref[i]["vec"] for i in indices]))  # its neighbours stay stacked


def test_a_ragged_batch_larger_than_its_slot_moves_to_a_grown_segment(pydata_path, tmp_path):
    import batchd_testdata

    ref = batchd_testdata.Mixed(n=64, ragged_images=True)
    with InWorker({"m": mixed(n=64, ragged_images=True)}, tmp_path, slot_capacity=4096) as w:
        indices = list(range(64))
        done, got = w.batch("m", indices)
    assert done.grown and done.slot_capacity >= max(t.offset + t.nbytes for t in done.tensors)
    assert all(np.array_equal(v, ref[i]["image"]) for v, i in zip(got["image"], indices))
    assert got["name"] == [ref[i]["name"] for i in indices]


@pytest.mark.parametrize("drift, field, got, want", [
    ("label", "label", "str []", "int64 []"), ("image", "image", "float64 [8, 8, 3]", "uint8 [8, 8, 3]"),
    ("rank", "vec", "float32 [1, 3]", "float32 [3]"),
])
def test_a_field_of_another_type_is_a_sample_error_naming_it_with_batch_size_1_too(pydata_path, tmp_path, drift, field,
                                                                                   got, want):
    """A kind: python sample whose field's dtype or rank is not the dataset's (as sample 0 has it) is
    that sample's SampleError, naming index, field, expected and got; ``on_error: skip`` leaves out
    that sample alone; a batch of that sample alone is refused too. (Before: a ShapeMismatchError
    failing the stream, whatever on_error said, that could name the good sample as the culprit,
    and nothing at all with batch_size 1.)"""
    with InWorker({"m": {**mixed(drift_at=5, drift=drift), "on_error": "skip"}}, tmp_path) as w:
        for indices in ([5], [2, 5, 4], [5, 2]):
            with pytest.raises(batchd.SampleError) as e:
                w.batch("m", indices)
            assert e.value.index == 5 and e.value.dataset == "m", str(e.value)
            assert f"field {field!r} is {got}: expected {want}" in e.value.reason, e.value.reason
        done, got_batch = w.batch("m", [2, 5, 4], skip=True)
    assert [s[0] for s in done.skipped] == [5] and got_batch["index"].tolist() == [2, 4]


def test_a_field_of_one_dtype_in_some_samples_and_another_in_others_names_the_sample(pydata_path, tmp_path):
    with InWorker({"m": mixed(mixed_dtype=True)}, tmp_path) as w:
        w.batch("m", [0, 2, 4])  # int in each: fine
        with pytest.raises(batchd.SampleError) as e:
            w.batch("m", [2, 4, 5])
    assert e.value.index == 5 and "field 'odd' is float64 []: expected int64 []" in str(e.value), str(e.value)


def test_a_batch_whose_every_sample_was_skipped_has_the_dataset_fields(pydata_path, tmp_path):
    with InWorker({"m": {**mixed(fail_at=3), "on_error": "skip"}}, tmp_path) as w:
        done, got = w.batch("m", [3, 3], skip=True)
        spec = {f.name: f for f in w.worker.dataset("m").fields}
    lay = layouts(done)
    assert [s[0] for s in done.skipped] == [3, 3]
    assert set(lay) == {"index", "position", *spec}
    assert lay["image"].shape == (0, 8, 8, 3) and lay["label"].shape == (0,) and lay["vec"].shape == (0, 3)
    assert lay["boxes"].sample_shapes == () and lay["name"].sample_shapes == ()  # lists of 0 samples
    assert all(t.nbytes == 0 for t in done.tensors)


def test_per_object_fields_of_one_sample_must_agree_on_n(pydata_path, tmp_path):
    """Without a pipeline too: a sample whose boxes are [1, 4] and whose vec (declared per-object) has 3 entries."""
    cfg = {"kind": "python", "factory": "batchd_testdata:Mixed", "args": {}, "per_object_fields": ["boxes", "vec"]}
    with InWorker({"m": cfg}, tmp_path) as w:
        with pytest.raises(batchd.SampleError, match=r"sample 4 \(#4\): per-object fields disagree on the number of "
                                                     r"objects: 'vec' has 3 \(\[3\]\), 'boxes' has 1"):
            w.batch("m", [4])
