"""A field that cannot become an array is a bad sample, not a failed stream.

Where a field can be wrong: a ``kind: python`` dataset's ``__getitem__`` (any object it returns)
and a python pipeline's output (any kind). The built-in kinds make their fields themselves
(their bad files are SampleErrors already: tests/data/test_coco.py, test_segmentation.py,
test_datasets.py). Through a real server: with ``on_error: raise`` the stream fails with a
SampleError naming the dataset, the sample's index and the field; with ``on_error: skip`` that
sample alone is left out (listed in ``skipped``) and every other one is served once.
On main the stream failed with ``WorkerError: TypeError: field 'extra' is a dict``, naming no
sample, and ``on_error: skip`` did not apply.
"""

from __future__ import annotations

import pathlib
import sys

import numpy as np
import pytest

import batchd
from conftest import running_server

pytestmark = pytest.mark.timeout(180)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
WHAT = ("dict", "object", "list", "none", "bfloat16")
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


def test_good_samples_are_untouched(server):
    with batchd.RemoteDataLoader(server.address, "good", batch_size=4, timeout=60) as ld:
        batches = list(ld)
    extra = np.concatenate([b["extra"].numpy() for b in batches])
    assert extra.shape == (N, 2) and np.array_equal(extra[:, 0], np.arange(N))
