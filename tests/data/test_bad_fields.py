"""A field that cannot become an array is a bad sample, not a failed stream.

Where a field can be wrong: a ``kind: python`` dataset's ``__getitem__`` (any object it returns)
and a python pipeline's output, on a dataset of any kind (the built-in kinds imagefolder,
manifest, segmentation and coco are each run here). The built-in kinds make their fields
themselves (their bad files are SampleErrors already: tests/data/test_coco.py,
test_segmentation.py, test_datasets.py). Through a real server: with ``on_error: raise`` the
stream fails with a SampleError naming the dataset, the sample's index and the field; with
``on_error: skip`` that sample alone is left out (listed in ``skipped``) and every other one is
served once. On main the stream failed with ``WorkerError: TypeError: field 'extra' is a dict``,
naming no sample, and ``on_error: skip`` did not apply.
"""

from __future__ import annotations

import json
import pathlib
import sys

import cv2
import numpy as np
import pytest

import batchd
from conftest import running_server
from helpers import write_png

pytestmark = pytest.mark.timeout(180)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
WHAT = ("dict", "object", "list", "none", "bfloat16")
KINDS = ("imagefolder", "manifest", "segmentation", "coco")
N, AT = 12, 5


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    sys.path.insert(0, str(PYDATA))
    datasets = {}
    for what in WHAT:
        ds = {"kind": "python", "factory": "batchd_testdata:BadField", "args": {"n": N, "at": AT, "what": what}}
        datasets[what] = ds
        datasets[f"{what}-skip"] = {**ds, "on_error": "skip", "max_skipped_fraction": 0.5}
    good = {"kind": "python", "factory": "batchd_testdata:BadField", "args": {"n": N, "at": -1}}
    datasets["good"], datasets["good-skip"] = good, {**good, "on_error": "skip", "max_skipped_fraction": 0.5}
    pipelines = {"note": {"python": "batchd_testdata:dict_field_at", "args": {"label": AT}}}
    with running_server(python_path=[str(PYDATA)], workers=1, cache_dir=tmp_path_factory.mktemp("bad"),
                        datasets=datasets, pipelines=pipelines) as s:
        yield s
    sys.path.remove(str(PYDATA))


def assert_named_then_skipped(server, dataset: str, reason: str, **options) -> None:
    with pytest.raises(batchd.SampleError) as e:
        with batchd.RemoteDataLoader(server.address, dataset, batch_size=4, timeout=60, **options) as ld:
            for _ in ld:
                pass
    assert e.value.dataset == dataset and e.value.index == AT, str(e.value)
    assert "field 'extra'" in str(e.value) or "field 'note'" in str(e.value), str(e.value)
    assert reason in str(e.value), str(e.value)
    with batchd.RemoteDataLoader(server.address, f"{dataset}-skip", batch_size=4, timeout=60, **options) as ld:
        batches = list(ld)
    served = sorted(i for b in batches for i in b["index"].tolist())
    skipped = [i for b in batches if "skipped" in b for i in b["skipped"].tolist()]
    assert served == [i for i in range(N) if i != AT] and skipped == [AT]


@pytest.mark.parametrize("what, reason", [
    ("dict", "is a dict"), ("object", "is a object"), ("list", "make lists numpy arrays"), ("none", "is a NoneType"),
    ("bfloat16", "torch tensor of dtype torch.bfloat16"),
])
def test_a_python_datasets_bad_field_is_a_sample_error_naming_index_and_field(server, what, reason):
    assert_named_then_skipped(server, what, reason)


def test_a_python_pipelines_bad_field_is_a_sample_error_naming_index_and_field(server):
    assert_named_then_skipped(server, "good", "the python pipeline returned field 'note' is a dict", transform="note")


@pytest.fixture(scope="module")
def kinds_server(tmp_path_factory):
    """Each built-in kind of image files over the same N PNGs (sample k: 12 x (16 + k) pixels),
    its sample AT marked by a value the python pipeline ``note-<kind>`` reads: imagefolder's and
    manifest's label AT, segmentation's mask of value AT, coco's image id (coco orders its
    samples by image id, which here is not the JSON's order nor the files')."""
    root = tmp_path_factory.mktemp("kinds")
    rng = np.random.default_rng(0)
    image_ids = [(37 * k) % 101 + 1 for k in range(N)]  # file k's image id; coco's sample AT: sorted(image_ids)[AT]
    rows, images, annotations = ["path,label"], [], []
    for k in range(N):
        rgb = rng.integers(0, 256, (12, 16 + k, 3), dtype=np.uint8)
        write_png(root / "tree" / f"c{k:02d}" / "0.png", rgb)  # class k, the only image: imagefolder's sample k
        write_png(root / "flat" / f"{k:02d}.png", rgb)
        (root / "masks").mkdir(exist_ok=True)
        assert cv2.imwrite(str(root / "masks" / f"{k:02d}.png"), np.full((12, 16 + k), k, np.uint8))
        rows.append(f"{k:02d}.png,{k}")
        images.append({"id": image_ids[k], "file_name": f"{k:02d}.png", "height": 12, "width": 16 + k})
        annotations.append({"id": k + 1, "image_id": image_ids[k], "category_id": 1, "bbox": [2, 3, 8, 6],
                            "area": 48.0, "iscrowd": 0, "segmentation": [[2, 3, 10, 3, 10, 9, 2, 9]]})
    (root / "flat" / "labels.csv").write_text("\n".join(rows) + "\n")
    coco = root / "instances.json"
    coco.write_text(json.dumps({"images": images, "annotations": annotations,
                                "categories": [{"id": 1, "name": "thing"}]}))
    datasets = {
        "imagefolder": {"kind": "imagefolder", "root": str(root / "tree")},
        "manifest": {"kind": "manifest", "path": str(root / "flat" / "labels.csv")},
        "segmentation": {"kind": "segmentation", "images": str(root / "flat"), "masks": str(root / "masks"),
                         "extensions": [".png"]},
        "coco": {"kind": "coco", "images": str(root / "flat"), "annotations": str(coco), "masks": True},
    }
    for kind in KINDS:
        datasets[f"{kind}-skip"] = {**datasets[kind], "on_error": "skip", "max_skipped_fraction": 0.5}
    marks = {"imagefolder": {}, "manifest": {}, "segmentation": {"key": "mask"},
             "coco": {"label": sorted(image_ids)[AT], "key": "image_id"}}
    pipelines = {f"note-{kind}": {"python": "batchd_testdata:dict_field_at", "args": {"label": AT, **marks[kind]}}
                 for kind in KINDS}
    sys.path.insert(0, str(PYDATA))
    try:
        with running_server(python_path=[str(PYDATA)], workers=1, cache_dir=tmp_path_factory.mktemp("kinds-cache"),
                            datasets=datasets, pipelines=pipelines) as s:
            yield s
    finally:
        sys.path.remove(str(PYDATA))


@pytest.mark.parametrize("kind", KINDS)
def test_a_python_pipelines_bad_field_is_a_sample_error_in_every_built_in_kind(kinds_server, kind):
    """The same rule whatever the dataset's kind: the sample the pipeline gave a dict is named by
    dataset, index and field, and ``on_error: skip`` leaves out that sample alone."""
    assert_named_then_skipped(kinds_server, kind, "the python pipeline returned field 'note' is a dict",
                              transform=f"note-{kind}")


def test_good_samples_are_untouched(server):
    with batchd.RemoteDataLoader(server.address, "good", batch_size=4, timeout=60) as ld:
        batches = list(ld)
    extra = np.concatenate([b["extra"].numpy() for b in batches])
    assert extra.shape == (N, 2) and np.array_equal(extra[:, 0], np.arange(N))
