"""kind: coco against its oracle: pycocotools' reading of the same JSON, in torchvision's order.

The oracle (tests/coco_oracle.py) is what torchvision's ``CocoDetection`` with the detection
references' box conversion gives, with pycocotools' masks.
"""

from __future__ import annotations

import copy
import functools
import http.server
import json
import mmap
import pathlib
import threading

import cv2
import numpy as np
import pytest
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from batchd.errors import SampleError
from batchd.server.config import CocoConfig
from batchd.server.data.datasets import open_dataset
from batchd.server.data.datasets.coco_segments import rle_string_counts
import coco_oracle
from coco_oracle import expected

pytestmark = pytest.mark.timeout(60)


def coco_dataset(images, annotations, cache_dir, build=True, **kw):
    return open_dataset("det", CocoConfig(kind="coco", images=images, annotations=annotations, **kw), cache_dir, build=build)


def assert_matches_pycocotools(ds, json_path: pathlib.Path, images: pathlib.Path, masks: bool) -> COCO:
    coco = COCO(str(json_path))
    ids = sorted(coco.imgs)  # torchvision's CocoDetection order
    assert len(ds) == len(ids)
    for i, img_id in enumerate(ids):
        sample = ds.load_sample(i)
        want, ann_ids = expected(coco, img_id, masks)
        assert set(sample) == set(want) | {"image"}
        for name, value in want.items():
            got = sample[name]
            if isinstance(value, np.ndarray):
                assert got.dtype == value.dtype and got.shape == value.shape, (i, name)
                np.testing.assert_array_equal(got, value, err_msg=f"sample {i} field {name}")
            else:
                assert got == value
        np.testing.assert_array_equal(sample["image"], coco_oracle.image(coco, img_id, images))
        assert ds.annotation_ids(i) == ann_ids
    return coco


# --- the generated dataset -------------------------------------------------------------------


def test_generated_dataset_matches_pycocotools(fashion_coco, tmp_path):
    json_path = fashion_coco / "annotations" / "instances_train.json"
    images = fashion_coco / "images" / "train"
    ds = coco_dataset(images, json_path, tmp_path, masks=True)
    coco = assert_matches_pycocotools(ds, json_path, images, masks=True)
    anns = coco.dataset["annotations"]
    # the data exercises every case the test is about
    kinds = {"polygon" if isinstance(a["segmentation"], list) else type(a["segmentation"]["counts"]).__name__ for a in anns}
    assert kinds == {"polygon", "str", "list"}
    assert any(len(a["segmentation"]) > 1 for a in anns if isinstance(a["segmentation"], list))
    assert any(a["iscrowd"] for a in anns)
    assert any(not coco.getAnnIds(imgIds=i) for i in coco.imgs)
    assert ds.classes[1:] == [c["name"] for c in coco.dataset["categories"]] and ds.classes[0] == ""
    # a worker maps the index the server built: arrays on the mapped file, no per-annotation objects
    worker = coco_dataset(images, json_path, tmp_path, build=False, masks=True)
    assert isinstance(worker._ann_boxes.base, mmap.mmap) and isinstance(worker._segments.coords.base, mmap.mmap)
    for i in (0, len(ds) - 1):
        for name, value in ds.load_sample(i).items():
            np.testing.assert_array_equal(worker.load_sample(i)[name], value)


def test_without_masks_gives_the_same_boxes_and_no_masks_field(fashion_coco, tmp_path):
    json_path = fashion_coco / "annotations" / "instances_val.json"
    images = fashion_coco / "images" / "val"
    ds = coco_dataset(images, json_path, tmp_path)
    assert_matches_pycocotools(ds, json_path, images, masks=False)
    assert [f.name for f in ds.fields] == ["image", "boxes", "labels", "iscrowd", "area", "image_id"]
    with pytest.raises(TypeError, match="no per-sample label"):
        ds.label(0)


# --- hand-written edge cases -----------------------------------------------------------------


def column_runs(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE of a 0/1 mask: run lengths in column-major order, zeros first."""
    flat = mask.ravel(order="F").astype(np.int16)
    runs = np.diff(np.flatnonzero(np.diff(np.r_[-1, flat, -1]))).tolist()
    return [0] + runs if flat[0] == 1 else runs


def _square(x0, y0, x1, y1) -> list[float]:
    return [x0, y0, x1, y0, x1, y1, x0, y1]


@pytest.fixture
def edge(tmp_path) -> tuple[pathlib.Path, pathlib.Path, dict]:
    """Four images (ids unsorted in the JSON, one without annotations) and annotations covering:
    polygons of one and two parts, compressed and uncompressed RLE, a crowd, a zero-width and a
    zero-height box, a box half outside its image and one wholly outside, categories with gaps."""
    images = tmp_path / "img"
    images.mkdir()
    sizes = {30: (20, 24), 10: (16, 12), 20: (18, 18), 40: (8, 8)}  # id -> (height, width)
    rng = np.random.default_rng(5)
    for img_id, (h, w) in sizes.items():
        cv2.imwrite(str(images / f"{img_id}.png"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    blob = np.zeros((18, 18), np.uint8)
    blob[3:9, 4:15] = 1
    blob[12:16, 2:5] = 1
    compressed = mask_utils.encode(np.asfortranarray(blob))["counts"].decode()
    runs = column_runs(blob)
    anns = [
        {"id": 7, "image_id": 30, "category_id": 9, "bbox": [2.1, 3.25, 10.7, 6.0], "area": 64.2, "iscrowd": 0,
         "segmentation": [_square(2.1, 3.25, 12.8, 9.25)]},  # x + w: 12.799999 in float32 (torchvision), 12.8 in float64
        {"id": 3, "image_id": 10, "category_id": 1, "bbox": [1, 1, 6, 9], "area": 40, "iscrowd": 0,
         "segmentation": [_square(1, 1, 4, 5), _square(5, 6, 7, 10)]},  # two parts: one mask
        {"id": 4, "image_id": 20, "category_id": 5, "bbox": [2, 3, 13, 13], "area": float(blob.sum()), "iscrowd": 0,
         "segmentation": {"size": [18, 18], "counts": compressed}},
        {"id": 5, "image_id": 20, "category_id": 1, "bbox": [2, 3, 13, 13], "area": float(blob.sum()), "iscrowd": 1,
         "segmentation": {"size": [18, 18], "counts": runs}},
        {"id": 6, "image_id": 30, "category_id": 1, "bbox": [5, 5, 0, 4], "area": 0, "iscrowd": 0,
         "segmentation": [_square(5, 5, 5.5, 9)]},  # zero width
        {"id": 8, "image_id": 30, "category_id": 1, "bbox": [5, 5, 4, 0.0], "area": 0, "iscrowd": 0,
         "segmentation": [_square(5, 5, 9, 5.5)]},  # zero height
        {"id": 9, "image_id": 10, "category_id": 9, "bbox": [8, 12, 10, 10], "area": 16, "iscrowd": 0,
         "segmentation": [_square(8, 12, 12, 16)]},  # half outside (12 wide, 16 high): clipped
        {"id": 11, "image_id": 30, "category_id": 9, "bbox": [30, 2, 5, 5], "area": 25, "iscrowd": 0,
         "segmentation": [_square(30, 2, 35, 7)]},  # wholly outside (24 wide): dropped
        {"id": 2, "image_id": 30, "category_id": 5, "bbox": [0, 0, 24, 20], "area": 480, "iscrowd": 0,
         "segmentation": [_square(0, 0, 24, 20)]},
    ]
    data = {"images": [{"id": i, "file_name": f"{i}.png", "height": h, "width": w} for i, (h, w) in sizes.items()],
            "annotations": anns,
            "categories": [{"id": 9, "name": "nine"}, {"id": 1, "name": "one"}, {"id": 5, "name": "five"}]}
    path = tmp_path / "instances.json"
    path.write_text(json.dumps(data))
    return images, path, data


def test_edge_cases_match_pycocotools_and_drops_are_counted(edge, tmp_path, caplog):
    images, path, _ = edge
    ds = coco_dataset(images, path, tmp_path / "cache", masks=True)
    assert_matches_pycocotools(ds, path, images, masks=True)
    assert [ds.image_id(i) for i in range(len(ds))] == [10, 20, 30, 40]
    assert ds.annotation_ids(2) == [7, 2]  # the JSON's order; 6, 8 (zero size) and 11 (outside) dropped
    assert ds.info == {"annotations": "6", "dropped_zero_size": "2", "dropped_outside_image": "1",
                       "empty_images": "1", "skipped_empty_images": "0"}
    assert "dropped 2 annotation(s) of zero width or height and 1 wholly outside" in caplog.text
    assert "annotation ids 6, 8, 11" in caplog.text
    assert ds.classes == ["", "one", "", "", "", "five", "", "", "", "nine"]
    half_outside = ds.load_sample(0)["boxes"][1]
    np.testing.assert_array_equal(half_outside, np.float32([8, 12, 12, 16]))
    empty = ds.load_sample(3)
    assert empty["boxes"].shape == (0, 4) and empty["boxes"].dtype == np.float32
    assert empty["labels"].shape == empty["iscrowd"].shape == empty["area"].shape == (0,)
    assert empty["masks"].shape == (0, 8, 8) and empty["masks"].dtype == np.uint8
    two_parts = ds.load_sample(0)["masks"][0]
    assert two_parts[1:5, 1:4].all() and two_parts[6:10, 5:7].all() and not two_parts[5:6].any()


def test_skip_empty_leaves_out_images_without_annotations(edge, tmp_path):
    images, path, _ = edge
    ds = coco_dataset(images, path, tmp_path / "cache", skip_empty=True)
    assert [ds.image_id(i) for i in range(len(ds))] == [10, 20, 30]
    assert ds.info["skipped_empty_images"] == "1"
    full = coco_dataset(images, path, tmp_path / "cache")
    assert len(full) == 4 and ds.fingerprint != full.fingerprint


def test_fingerprint_and_index_follow_the_annotation_file(edge, tmp_path):
    images, path, data = edge
    cache = tmp_path / "cache"
    a = coco_dataset(images, path, cache)
    assert coco_dataset(images, path, cache).fingerprint == a.fingerprint
    assert coco_dataset(images, path, cache, masks=True).fingerprint != a.fingerprint
    data["annotations"][0]["category_id"] = 5
    path.write_text(json.dumps(data))
    b = coco_dataset(images, path, cache)
    assert b.fingerprint != a.fingerprint and b.load_sample(2)["labels"].tolist() == [5, 5]


def test_an_image_of_another_size_than_the_json_says_is_a_sample_error(edge, tmp_path):
    images, path, _ = edge
    cv2.imwrite(str(images / "40.png"), np.zeros((9, 8, 3), np.uint8))
    ds = coco_dataset(images, path, tmp_path / "cache")
    with pytest.raises(SampleError, match=r"40\.png.*the image is 8x9 pixels, but the annotation file says 8x8") as e:
        ds.load_sample(3)
    assert e.value.dataset == "det" and e.value.index == 3


def test_masks_without_pycocotools_is_a_clear_error(edge, tmp_path, monkeypatch):
    images, path, _ = edge
    monkeypatch.setitem(__import__("sys").modules, "pycocotools", None)
    with pytest.raises(ImportError, match=r"dataset 'det' \(coco\) has masks: true, which needs pycocotools.*batchd\[coco\]"):
        coco_dataset(images, path, tmp_path / "cache", masks=True)
    assert len(coco_dataset(images, path, tmp_path / "cache")) == 4  # boxes alone need no pycocotools


# --- malformed annotation files --------------------------------------------------------------


def _set(ann_id, field, value):
    def change(data):
        ann = next(a for a in data["annotations"] if a["id"] == ann_id)
        if value is KeyError:
            del ann[field]
        else:
            ann[field] = value
    return change


MALFORMED = [
    (_set(7, "bbox", KeyError), 7, "bbox"),
    (_set(7, "bbox", [1, 2, 3]), 7, "bbox"),
    (_set(7, "bbox", [1, 2, -3, 4]), 7, "bbox"),
    (_set(7, "bbox", [1, 2, "3", 4]), 7, "bbox"),
    (_set(3, "category_id", 2), 3, "category_id"),
    (_set(3, "image_id", 99), 3, "image_id"),
    (_set(3, "iscrowd", 2), 3, "iscrowd"),
    (_set(3, "area", KeyError), 3, "area"),
    (_set(3, "area", 10**400), 3, "area"),  # no float holds it
    (_set(3, "segmentation", [[1, 2, 3, 4]]), 3, r"segmentation\[0\]"),  # pycocotools would read a box
    (_set(3, "segmentation", [_square(1, 1, 4, 5), [1, 2, 3, 4, 5, 6, 7]]), 3, r"segmentation\[1\]"),
    (_set(3, "segmentation", []), 3, "segmentation"),
    (_set(4, "segmentation", {"size": [18, 17], "counts": "PP5"}), 4, r"segmentation\.size"),
    (_set(5, "segmentation", {"size": [18, 18], "counts": [10, 5]}), 5, r"segmentation\.counts"),  # 15 of 324 pixels
    (_set(5, "segmentation", {"size": [18, 18], "counts": [300, -1, 25]}), 5, r"segmentation\.counts"),
    (_set(4, "segmentation", {"size": [18, 18], "counts": "0\x7f"}), 4, r"segmentation\.counts"),
    (_set(4, "segmentation", {"size": [18, 18], "counts": "Y"}), 4, r"segmentation\.counts"),  # ends inside a count
    (_set(4, "segmentation", {"size": [18, 18], "counts": "c9"}), 4, r"segmentation\.counts"),  # 500 > 324 pixels
]


@pytest.mark.parametrize("change,ann_id,field", MALFORMED)
def test_malformed_annotations_name_the_file_the_annotation_and_the_field(edge, tmp_path, change, ann_id, field):
    images, path, data = edge
    data = copy.deepcopy(data)
    change(data)
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=rf"^{path}: annotation id {ann_id}: field '{field}'"):
        coco_dataset(images, path, tmp_path / "cache", masks=True)


def test_duplicate_ids_and_missing_lists_are_errors(edge, tmp_path):
    images, path, data = edge
    for change, message in [
        (lambda d: d["annotations"].append(dict(d["annotations"][0])), "annotation id 7: two annotations have this id"),
        (lambda d: d["images"].append(dict(d["images"][0])), "image id 30: two images have this id"),
        (lambda d: d["images"][0].pop("width"), "image id 30: field 'width'"),
        (lambda d: d.pop("categories"), "field 'categories': expected a list"),
    ]:
        broken = copy.deepcopy(data)
        change(broken)
        path.write_text(json.dumps(broken))
        with pytest.raises(ValueError, match=f"^{path}: {message}"):
            coco_dataset(images, path, tmp_path / "cache")
    path.write_text("{not json")
    with pytest.raises(ValueError, match=f"^{path}: not a readable JSON file"):
        coco_dataset(images, path, tmp_path / "cache")
    with pytest.raises(FileNotFoundError, match="nothing.json: COCO annotation file not found"):
        coco_dataset(images, tmp_path / "nothing.json", tmp_path / "cache")


def test_segmentations_are_not_checked_without_masks(edge, tmp_path):
    images, path, data = edge
    _set(3, "segmentation", [[1, 2, 3, 4]])(data)
    path.write_text(json.dumps(data))
    assert len(coco_dataset(images, path, tmp_path / "cache")) == 4


def test_compressed_rle_strings_decode_to_pycocotools_runs():
    rng = np.random.default_rng(0)
    for trial in range(50):
        h, w = (int(v) for v in rng.integers(1, 40, 2))
        mask = (rng.random((h, w)) < rng.random()).astype(np.uint8)
        if trial % 5 == 0:
            mask[:] = trial % 2  # one run, or a first run of zero zeros
        runs = column_runs(mask)
        counts = mask_utils.encode(np.asfortranarray(mask))["counts"].decode()
        assert rle_string_counts(counts).tolist() == runs
        # and pycocotools agrees that these runs are the mask
        uncompressed = mask_utils.frPyObjects({"size": [h, w], "counts": runs}, h, w)
        np.testing.assert_array_equal(mask_utils.decode(uncompressed), mask)


# --- images over http ------------------------------------------------------------------------


def test_images_and_annotations_over_http(edge, tmp_path):
    images, path, _ = edge
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    handler = functools.partial(Quiet, directory=str(tmp_path))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        remote = coco_dataset(f"{base}/img", f"{base}/instances.json", tmp_path / "cache", masks=True)
        local = coco_dataset(images, path, tmp_path / "cache", masks=True)
        assert remote.fingerprint == local.fingerprint
        for i in range(len(local)):
            for name, value in local.load_sample(i).items():
                np.testing.assert_array_equal(remote.load_sample(i)[name], value)
    finally:
        httpd.shutdown()
        httpd.server_close()
