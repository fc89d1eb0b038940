"""Targets through albumentations (server/compute/targets.py), through a real worker and real slots.

The data are filled rectangles of known colours at known boxes (tests/pydata/batchd_testdata.py,
served as ``kind: python``), so the pixels are the oracle: after random flips, crops, resizes and
rotations every returned box must still enclose its colour's pixels, every mask must be its
colour's pixels, and every per-object field must still describe the same object.
"""

from __future__ import annotations

import json
import pathlib
import sys

import albumentations as A
import cv2
import numpy as np
import pytest

from batchd.sampler import sample_key
from batchd.server.compute import allowlist
from batchd.server.compute.pipeline import SampleRandom
from batchd.server.config import PipelineLimits
from batchd.server.data.cache import SharedCache
from batchd.server.data.cache import entry
from inworker import InWorker

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
PER_OBJECT = ["boxes", "labels", "masks", "keypoints", "iscrowd", "area", "ids"]
CONSTANT = {"border_mode": cv2.BORDER_CONSTANT, "fill": 0, "fill_mask": 0}
EXACT = {"interpolation": cv2.INTER_NEAREST_EXACT, "mask_interpolation": cv2.INTER_NEAREST_EXACT}

# Crops and flips are exact on pixels; the resize is by 2 (nearest, centre-aligned: exact); the
# rotation comes last on a canvas padded so that no object leaves it (a rotated box cut by the
# image edge is no longer the bounding box of what is left).
GEOMETRY = A.Compose([
    A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5), A.RandomRotate90(p=0.5),
    A.RandomCrop(32, 32), A.Resize(64, 64, **EXACT), A.PadIfNeeded(96, 96, **CONSTANT),
    A.Rotate(limit=30, interpolation=cv2.INTER_NEAREST, mask_interpolation=cv2.INTER_NEAREST, p=0.8, **CONSTANT),
])


@pytest.fixture(scope="module")
def testdata():
    sys.path.insert(0, str(PYDATA))  # the worker runs in this process: it imports as the server would
    import batchd_testdata

    yield batchd_testdata
    sys.path.remove(str(PYDATA))


def rectangles(n: int, size: int = 48, **args) -> dict:
    return {"kind": "python", "factory": "batchd_testdata:Rectangles", "args": {"n": n, "size": size, **args},
            "per_object_fields": PER_OBJECT}


def samples(batches):
    """The samples of batches (dicts of stacked arrays and lists) one by one, as dicts."""
    for b in batches:
        for j in range(len(b["index"])):
            yield {name: value[j] for name, value in b.items()}


def test_boxes_masks_and_keypoints_follow_the_pixels(testdata, tmp_path):
    """§6 geometry: 560 samples, random flips, 90-degree turns, crops, a resize and rotations."""
    allowlist.check(json.loads(json.dumps(A.to_dict(GEOMETRY))), PipelineLimits())  # a client may send it
    n, checked, dropped, rotated, whole = 560, 0, 0, 0, 0
    with InWorker({"rect": rectangles(n)}, tmp_path) as w:
        for s in samples(w.epoch("rect", n, 16, GEOMETRY, seed=5)):
            original = testdata.Rectangles(n, 48)[int(s["index"])]
            image = s["image"]
            assert image.shape == (96, 96, 3)
            objects = [int(i) % 100 for i in s["ids"]]
            dropped += len(original["ids"]) - len(objects)
            for k, obj in enumerate(objects):  # every per-object field is this object's
                assert s["labels"][k] == original["labels"][obj] and s["area"][k] == original["area"][obj]
                assert s["iscrowd"][k] == 0 and s["ids"][k] // 100 == s["index"]
                colour = (image == testdata.PALETTE[s["labels"][k]]).all(-1)
                assert np.array_equal(s["masks"][k].astype(bool), colour), f"sample {s['index']}: mask {k}"
                assert np.array_equal(s["mask"] == s["labels"][k] + 1, colour)
                ys, xs = np.nonzero(colour)
                pixels = np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1])
                box = s["boxes"][k]
                assert np.abs(box - pixels).max() <= 1.0, f"sample {s['index']}: box {box} vs pixels {pixels}"
                corners = s["keypoints"][k]
                assert corners.shape == (4, 3) and (corners[:, 2] == 2).all()  # each object keeps its 4 points
                if colour.sum() > 0.9 * 4 * original["area"][obj]:  # not cut by the crop: its corners are around it
                    # albumentations moves a point as a pixel index (a flip maps x to W - 1 - x, a box's
                    # edge goes to W - x), so each step may shift it by a pixel against the box: this
                    # checks that the points are this object's (object centres lie >= 16 px apart);
                    # ::test_the_worker_gives_what_albumentations_gives... checks the points exactly
                    centre = (box[:2] + box[2:]) / 2
                    assert np.abs(corners[:, :2].mean(0) - centre).max() < 5, (corners, box)
                    whole += 1
                rotated += not np.allclose(box, np.round(box), atol=0.01)
                checked += 1
            for label in set(range(len(testdata.PALETTE))) - set(s["labels"].tolist()):
                assert not (image == testdata.PALETTE[label]).all(-1).any(), "a dropped object is still drawn"
    assert checked >= 1000 and dropped >= 100 and rotated >= 500 and whole >= 300, (checked, dropped, rotated, whole)


def test_dropped_boxes_drop_every_per_object_field_alike(testdata, tmp_path):
    """A client's bbox_params (min_visibility) drops boxes; each field drops the same objects."""
    crop = A.Compose([A.RandomCrop(20, 20), A.HorizontalFlip(p=0.5)],
                     bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], min_visibility=0.5))
    allowlist.check(json.loads(json.dumps(A.to_dict(crop))), PipelineLimits())
    seen = dropped = 0
    with InWorker({"rect": rectangles(200)}, tmp_path) as w:
        for s in samples(w.epoch("rect", 200, 10, crop, seed=1)):
            original = testdata.Rectangles(200, 48)[int(s["index"])]
            n = len(s["boxes"])
            assert all(len(s[f]) == n for f in PER_OBJECT), {f: len(s[f]) for f in PER_OBJECT}
            dropped += len(original["boxes"]) - n
            for k, obj in enumerate(int(i) % 100 for i in s["ids"]):
                assert s["labels"][k] == original["labels"][obj] and s["area"][k] == original["area"][obj]
                visible = (s["image"] == testdata.PALETTE[s["labels"][k]]).all(-1)
                assert visible.sum() >= 0.5 * original["area"][obj] - 1, "a box under min_visibility survived"
                assert np.array_equal(s["masks"][k].astype(bool), visible)
                seen += 1
            assert s["name"] == original["name"] and s["label"] == original["label"]  # not per-object: untouched
    assert seen > 50 and dropped > 100, (seen, dropped)


def test_the_worker_gives_what_albumentations_gives_under_the_samples_stream(testdata, tmp_path):
    """The reference: the same Compose with the user's own label_fields, run by albumentations
    itself on the sample drawn from its stream; and the image is the one an image-only pipeline gives."""
    pipe = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-20, 20), scale=(0.8, 1.2), p=0.9),
                      A.RandomCrop(40, 40), A.RandomBrightnessContrast(p=0.5)])
    reference = A.Compose(pipe.transforms, bbox_params=A.BboxParams(format="pascal_voc", label_fields=["ids"]),
                          keypoint_params=A.KeypointParams(format="xy", label_fields=["kp_ids"], remove_invisible=False))
    image_only = A.from_dict(A.to_dict(pipe))
    rnd = SampleRandom()
    rnd.attach(reference)
    rnd.attach(image_only)
    key = sample_key(seed=11, epoch=2)
    ds = testdata.Rectangles(64, 48, mask_dtype="int64")
    with InWorker({"rect": rectangles(64, mask_dtype="int64")}, tmp_path) as w:
        indices = [3, 10, 0, 22, 41, 63, 7]
        _, got = w.batch("rect", indices, pipe, seed=11, epoch=2, positions=[100 + i for i in indices])
    for j, i in enumerate(indices):
        s = ds[i]
        rnd.start(key, 100 + i)
        targets = {"masks": list(s["masks"])} if len(s["masks"]) else {}  # albumentations cannot stack no masks
        want = reference(image=s["image"], mask=s["mask"], bboxes=s["boxes"], ids=s["ids"],
                         keypoints=s["keypoints"].reshape(-1, 3), kp_ids=np.repeat(s["ids"], 4), **targets)
        assert np.array_equal(got["image"][j], want["image"]), i
        assert got["mask"][j].dtype == np.int64, "a target keeps its dtype (albumentations gives int32)"
        assert np.array_equal(got["mask"][j], want["mask"]), i
        assert np.array_equal(got["boxes"][j], np.asarray(want["bboxes"], np.float32).reshape(-1, 4)), i
        assert got["ids"][j].tolist() == list(want["ids"]), i
        kept = np.isin(np.repeat(s["ids"], 4), want["ids"])
        want_points = np.asarray(want["keypoints"], np.float32).reshape(-1, 3)  # (0, 2) when there are none
        assert np.array_equal(got["keypoints"][j].reshape(-1, 3), want_points[kept]), i
        if len(s["masks"]):
            masks = np.stack(want["masks"])[np.searchsorted(s["ids"], want["ids"])]
            assert np.array_equal(got["masks"][j], masks.reshape(-1, *got["masks"][j].shape[1:])), i
        rnd.start(key, 100 + i)
        assert np.array_equal(got["image"][j], image_only(image=s["image"])["image"]), \
            f"sample {i}: targets changed the image's random draws"


@pytest.mark.parametrize("fmt", ["coco", "yolo", "albumentations"])
def test_a_clients_bbox_format_is_the_format_of_the_boxes_it_gets(testdata, tmp_path, fmt):
    from albumentations.core import bbox_utils

    def compose(f):
        return A.Compose([A.HorizontalFlip(p=0.5), A.RandomCrop(40, 44)], bbox_params=A.BboxParams(format=f))
    with InWorker({"rect": rectangles(30)}, tmp_path) as w:
        indices = list(range(1, 30, 2))
        _, voc = w.batch("rect", indices, compose("pascal_voc"), seed=3)
        _, other = w.batch("rect", indices, compose(fmt), seed=3)
    for a, b in zip(voc["boxes"], other["boxes"]):
        normalized = bbox_utils.convert_bboxes_to_albumentations(a.astype(np.float64), "pascal_voc", (40, 44))
        want = normalized if fmt == "albumentations" else \
            bbox_utils.convert_bboxes_from_albumentations(normalized, fmt, (40, 44))
        assert np.allclose(b, want, atol=1e-4), (fmt, a, b)
    assert [len(b) for b in voc["boxes"]] == [len(b) for b in other["boxes"]] and any(len(b) for b in voc["boxes"])


FLIPS = A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5)])


def read_flips(samples, ds, side: int) -> tuple[np.ndarray, np.ndarray]:
    """(horizontal, vertical) flip flags, bool [M], of the samples (dicts of numpy values) of ``ds``
    (Rectangles of ``side``, one object at most) that went through FLIPS, read from each sample's
    box; checks that its image and mask were flipped alike. Samples whose flips cannot be told
    (no object, or its box centred on an axis) are left out."""
    h, v = [], []
    for s in samples:
        original = ds[int(s["index"])]
        if not len(original["boxes"]):
            continue
        box, was = s["boxes"][0], original["boxes"][0]
        if was[0] + was[2] == side or was[1] + was[3] == side:
            continue  # a box centred on an axis looks the same flipped
        flipped_h, flipped_v = abs(box[0] - was[0]) > 0.5, abs(box[1] - was[1]) > 0.5
        assert np.allclose(box, [side - was[2] if flipped_h else was[0], side - was[3] if flipped_v else was[1],
                                 side - was[0] if flipped_h else was[2], side - was[1] if flipped_v else was[3]],
                           atol=1e-3), (box, was)
        image = original["image"][:, ::-1] if flipped_h else original["image"]
        assert np.array_equal(s["image"], image[::-1] if flipped_v else image), "boxes and pixels disagree"
        mask = original["masks"][0][:, ::-1] if flipped_h else original["masks"][0]
        assert np.array_equal(s["masks"][0], mask[::-1] if flipped_v else mask), "masks and pixels disagree"
        h.append(flipped_h)
        v.append(flipped_v)
    return np.array(h), np.array(v)


def assert_independent_flips(h: np.ndarray, v: np.ndarray, what: str, min_count: int = 1100) -> None:
    """Chi-square: the two flips independent of each other and each p = 0.5 (test_randomness.py's
    tests), over at least ``min_count`` samples."""
    from test_randomness import assert_chi2, chi2_independence, chi2_uniform, contingency

    table = contingency(h, v)
    assert table.sum() > min_count and table.min() > 0, table
    assert_chi2(chi2_independence(table), f"HorizontalFlip x VerticalFlip independence {what}", table)
    assert_chi2(chi2_uniform(table), f"HorizontalFlip x VerticalFlip {what}, each p=0.5", table)


def test_flips_stay_independent_with_targets_present(testdata, tmp_path):
    """The independence statistics of tests/compute/test_randomness.py with boxes, masks and
    keypoints in every sample; each sample's flips read from its boxes agree with its pixels.
    (Through a real server: tests/compute/test_targets_served.py.)"""
    n, side = 1600, 40
    with InWorker({"rect": rectangles(n, side, max_objects=1)}, tmp_path) as w:
        h, v = read_flips(samples(w.epoch("rect", n, 64, FLIPS, seed=2024)), testdata.Rectangles(n, side, max_objects=1),
                          side)
    assert_independent_flips(h, v, "with targets")


def test_the_cache_gives_the_same_bytes_with_targets(testdata, tmp_path):
    """The prefix (Resize, CenterCrop) of image, boxes, masks and keypoints cached together: the
    bytes of every field equal those of a worker without a cache, on a miss and on a hit."""
    pipe = A.Compose([A.Resize(60, 60), A.CenterCrop(52, 52), A.HorizontalFlip(p=0.5), A.RandomCrop(40, 40)])
    plain = InWorker({"rect": rectangles(40)}, tmp_path)
    prefix = "batchd-test-cache-" + tmp_path.name[-8:] + "-"
    cache = SharedCache.create(f"{prefix}cache", memory_bytes=8 << 20, datasets=["rect"], workers=1, build="b")
    try:
        with plain, InWorker({"rect": rectangles(40)}, tmp_path, cache_prefix=prefix) as cached:
            assert cached.worker.cache is not None
            want = [flat(b) for b in plain.epoch("rect", 40, 8, pipe, seed=9)]
            assert any(len(boxes) for boxes in want[0]["boxes"])
            for attempt in ("miss", "hit"):
                got = [flat(b) for b in cached.epoch("rect", 40, 8, pipe, seed=9)]
                assert got == want, f"{attempt}: other bytes than without the cache"
            stats = cache.stats()["rect"]
            assert stats["misses"] == 40 and stats["hits"] == 40, stats
            # the same prefix transforms under other bbox_params keep other boxes: entries of their own
            strict = A.Compose(pipe.transforms, bbox_params=A.BboxParams(format="pascal_voc", min_visibility=0.9))
            want = [flat(b) for b in plain.epoch("rect", 40, 8, strict, seed=9)]
            assert want != [flat(b) for b in plain.epoch("rect", 40, 8, pipe, seed=9)], "a test of nothing"
            assert [flat(b) for b in cached.epoch("rect", 40, 8, strict, seed=9)] == want
    finally:
        cache.close()


def flat(batch: dict) -> dict:
    """A batch as comparable values: each array as (dtype, shape, bytes), lists element-wise."""
    def one(x):
        return (x.dtype.str, x.shape, x.tobytes()) if isinstance(x, np.ndarray) else x
    return {k: [one(x) for x in v] if isinstance(v, list) else one(v) for k, v in batch.items()}


def test_an_entry_of_the_image_only_format_is_refused_not_misread():
    key = bytes(range(16))
    head, payload = entry.encode(key, {"image": np.ones((4, 4, 3), np.uint8), "boxes": np.zeros((1, 4), np.float32)},
                                 False)
    buf = bytearray(bytes(head) + bytes(payload))
    assert entry.decode(bytes(buf), key)["boxes"].shape == (1, 4)
    buf[:4] = b"BDC1"  # what an older batchd wrote (one image)
    with pytest.raises(entry.CorruptEntry):
        entry.decode(bytes(buf), key)


@pytest.fixture(scope="module")
def rect_server(testdata, tmp_path_factory):
    from conftest import running_server

    with running_server(python_path=[str(PYDATA)], workers=1, cache_dir=tmp_path_factory.mktemp("rect"),
                        datasets={"rect": rectangles(8)}) as s:
        yield s


@pytest.mark.parametrize("params, field, words", [
    ({"bbox_params": {"format": "xyxy"}}, "bbox_params", "key 'format': expected one of 'pascal_voc'"),
    ({"bbox_params": {"format": "coco", "min_visibility": 1.5}}, "bbox_params", "key 'min_visibility'"),
    ({"bbox_params": {"format": "coco", "label_fields": ["../labels"]}}, "bbox_params", "key 'label_fields'"),
    ({"bbox_params": {"format": "coco", "read_from": "/etc"}}, "bbox_params", "key 'read_from' is not one"),
    ({"keypoint_params": {"format": "xy", "remove_invisible": True}}, "keypoint_params", "must be false"),
    ({"keypoint_params": {"format": "yx"}}, "keypoint_params", "key 'format'"),
])
def test_a_clients_bbox_and_keypoint_params_are_checked_field_by_field(rect_server, params, field, words):
    import grpc

    from batchd.v1 import loader_pb2 as pb
    from rawclient import RawSession

    server = rect_server
    spec = A.to_dict(A.Compose([A.HorizontalFlip()]))
    spec["transform"].update(params)
    with grpc.insecure_channel(server.address) as channel:
        session = RawSession(channel)
        try:
            with pytest.raises(grpc.RpcError) as e:
                next(iter(session.stream(dataset="rect", batch_size=2,
                                         pipeline=pb.Pipeline(albumentations_json=json.dumps(spec)))))
        finally:
            session.close()
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"field {field!r}" in e.value.details() and words in e.value.details(), e.value.details()


def test_decode_on_client_refuses_a_dataset_with_targets(tmp_path):
    from batchd.server.compute import encoded, python_pipeline
    from batchd.server.config import ImageFolderConfig
    from batchd.server.data.datasets import FieldSpec
    from batchd.server.data.datasets.imagefolder import ImageFolder
    from helpers import write_png

    write_png(tmp_path / "photos" / "a" / "0.png", np.zeros((8, 8, 3), np.uint8))

    class WithBoxes(ImageFolder):  # a kind of encoded files whose samples carry boxes (as COCO's)
        @property
        def fields(self):
            return (*super().fields, FieldSpec("boxes", "float32", (-1, 4)))

    cfg = ImageFolderConfig(kind="imagefolder", root=tmp_path / "photos")
    plain = ImageFolder("photos", cfg, tmp_path, build=True)
    assert encoded.check_request(plain, "jpeg", "") == (0, 0)
    with pytest.raises(ValueError, match=r"dataset 'photos' has targets or other fields \(boxes\)"):
        encoded.check_request(WithBoxes("photos", cfg, tmp_path, build=True), "jpeg", "")
    text = python_pipeline.preset_json("mine", {"python": "batchd_testdata:make_flip", "args": {}})
    with pytest.raises(ValueError, match="the pipeline is a python preset"):  # it runs on the server's pixels
        encoded.check_request(plain, "jpeg", text)
