"""``kind: python`` (server/data/datasets/python.py): the operator's own dataset class, imported by
a real server from ``python_path`` (tests/pydata/batchd_testdata.py), compared with the same class
called in this process."""

from __future__ import annotations

import os
import pathlib
import shutil
import sys

import grpc
import numpy as np
import pytest
import yaml

import batchd
from batchd.server.config import PythonConfig
from batchd.server.data.datasets import open_dataset
from batchd.server_process import ServerExited, ServerProcess, serve_command
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from conftest import running_server
from helpers import free_port
from rawclient import RawSession, tensors

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
# fields the wire carries stacked today (tests/compute/test_batching.py reads the others, and a
# torch tensor, which costs each worker seconds of importing torch, from a worker's slots)
STACKED = ["image", "label", "weight", "flag", "vec"]


@pytest.fixture(scope="module")
def testdata():
    sys.path.insert(0, str(PYDATA))
    import batchd_testdata

    yield batchd_testdata
    sys.path.remove(str(PYDATA))


def mixed(**args) -> dict:
    return {"kind": "python", "factory": "batchd_testdata:Mixed", "args": args}


@pytest.fixture(scope="module")
def server(testdata, tmp_path_factory):
    with running_server(python_path=[str(PYDATA)], cache_dir=tmp_path_factory.mktemp("py"), datasets={
        "m": mixed(n=40, only=STACKED),
        "bad": mixed(n=10, fail_at=5, only=STACKED),
        "bad-skip": {**mixed(n=10, fail_at=5, only=STACKED), "on_error": "skip", "max_skipped_fraction": 0.5},
        "declared": {"kind": "python", "factory": "batchd_testdata:Declared", "args": {"n": 4}},
    }) as s:
        yield s


def read_epoch(server, dataset: str, **fields) -> list[dict]:
    """Every batch of one epoch through the raw gRPC client (shared memory), as numpy arrays."""
    with grpc.insecure_channel(server.address) as channel:
        session = RawSession(channel)
        try:
            out = []
            for batch in session.stream(dataset=dataset, **fields):
                out.append(tensors(batch))
                session.release([batch.lease])
            return out
        finally:
            session.close()


def test_a_python_dataset_serves_exactly_what_it_gives_in_process(server, testdata):
    ds = testdata.Mixed(n=40, only=STACKED)
    batches = read_epoch(server, "m", batch_size=7, shuffle=True, seed=3, world_size=1)
    seen = []
    for b in batches:
        assert set(b) == {"index", "position", *STACKED}
        for j, i in enumerate(b["index"].tolist()):
            want = ds[i]
            seen.append(i)
            for name in STACKED:
                assert np.array_equal(b[name][j], np.asarray(want[name])), (i, name)
            assert b["label"].dtype == np.int64 and b["weight"].dtype == np.float64 and b["flag"].dtype == np.bool_
            assert b["vec"].dtype == np.float32 and b["image"].dtype == np.uint8
    assert sorted(seen) == list(range(40))


def test_a_raise_in_getitem_is_a_sample_error_naming_the_index_with_the_users_traceback(server):
    with batchd.RemoteDataLoader(server.address, "bad", batch_size=4, timeout=60) as ld:
        with pytest.raises(batchd.SampleError) as e:
            for _ in ld:
                pass
    err = e.value
    assert (err.dataset, err.index) == ("bad", 5)
    assert "ZeroDivisionError: division by zero" in err.reason, err.reason
    # the user's own frame: file, function and line
    assert 'batchd_testdata.py", line' in err.reason and "in _broken" in err.reason, err.reason
    assert "ratio = i / (self.fail_at - i)" in err.reason, err.reason
    assert str(PYDATA) not in str(err), "server paths stay on the server"


def test_on_error_skip_leaves_the_raising_sample_out(server):
    with batchd.RemoteDataLoader(server.address, "bad-skip", batch_size=4, timeout=60) as ld:
        batches = list(ld)
    got = sorted(i for b in batches for i in b["index"].tolist())
    assert got == [i for i in range(10) if i != 5]
    assert [i for b in batches if "skipped" in b for i in b["skipped"].tolist()] == [5]


def test_describe_dataset_gives_the_fields(server, testdata):
    with grpc.insecure_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)
        declared = stub.DescribeDataset(pb.DescribeDatasetRequest(name="declared"), timeout=10)
        read = stub.DescribeDataset(pb.DescribeDatasetRequest(name="m"), timeout=10)
    specs = {t.name: (t.dtype, list(t.shape)) for t in declared.sample}
    want = {name: (spec["dtype"], list(spec["shape"])) if isinstance(spec, dict) else (spec[0], list(spec[1]))
            for name, spec in testdata.Declared.fields.items()}
    assert specs == {**want, "index": ("int64", []), "position": ("int64", [])}
    assert declared.kind == "python" and declared.num_samples == 4
    # without a declaration: read from sample 0
    assert {t.name: (t.dtype, list(t.shape)) for t in read.sample} == {
        "image": ("uint8", [8, 8, 3]), "label": ("int64", []), "weight": ("float64", []), "flag": ("bool", []),
        "vec": ("float32", [3]), "index": ("int64", []), "position": ("int64", [])}
    # a field the dataset declares a dimension of as varying: -1
    assert {t.name: list(t.shape) for t in declared.sample}["boxes"] == [-1, 4]


def test_per_object_fields_are_the_standard_names_or_the_configs(testdata, tmp_path):
    sys.path.insert(0, str(PYDATA))
    try:
        plain = open_dataset("d", PythonConfig(kind="python", factory="batchd_testdata:Rectangles", args={"n": 3}),
                             tmp_path, build=True)
        chosen = open_dataset("d", PythonConfig(kind="python", factory="batchd_testdata:Rectangles", args={"n": 3},
                                                per_object_fields=("boxes", "ids")), tmp_path, build=True)
    finally:
        sys.path.remove(str(PYDATA))
    assert {f.name for f in plain.fields if f.per_object} == {"boxes", "labels", "masks", "keypoints", "iscrowd", "area"}
    assert {f.name for f in chosen.fields if f.per_object} == {"boxes", "ids"}
    assert {f.name: f.shape for f in plain.fields}["boxes"] == (-1, 4)  # N varies


def test_the_fingerprint_names_the_data_version_or_the_source_args_and_len(testdata, tmp_path):
    module = tmp_path / "pkg" / "mydata_fp.py"
    module.parent.mkdir()
    shutil.copy(PYDATA / "batchd_testdata.py", module)
    sys.path.insert(0, str(module.parent))
    try:
        def fp(factory="mydata_fp:Mixed", **args):
            return open_dataset("d", PythonConfig(kind="python", factory=factory, args=args), tmp_path,
                                build=True).fingerprint
        base = fp(n=5)
        assert len(base) == 32 and fp(n=5) == base
        assert fp(n=6) != base, "len and args"
        assert fp(n=5, only=["image"]) != base, "args"
        assert fp("mydata_fp:Versioned", n=5, version="v1") == fp("mydata_fp:Versioned", n=5, version="v1")
        assert fp("mydata_fp:Versioned", n=5, version="v1") != fp("mydata_fp:Versioned", n=5, version="v2")
        module.write_text(module.read_text() + "\n# an edit\n")
        sys.modules.pop("mydata_fp")
        assert fp(n=5) != base, "the factory's source file"
    finally:
        sys.path.remove(str(module.parent))
        sys.modules.pop("mydata_fp", None)


def _serve(tmp_path, factory: str, *extra: str, args=None, timeout: float = 60.0) -> tuple[int | None, str]:
    """Run ``batchd serve`` on a config with one python dataset; (exit code or None if it came up, its log)."""
    config = tmp_path / "server.yaml"
    config.write_text(yaml.safe_dump({"workers": 1, "cache_dir": str(tmp_path / "cache"),
                                      "datasets": {"mine": {"kind": "python", "factory": factory, "args": args or {}}}}))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    server = ServerProcess(serve_command("--config", config, "--address", f"127.0.0.1:{free_port()}", *extra),
                           env=env, cwd=tmp_path, timeout=timeout)
    try:
        server.start()
    except ServerExited as e:
        return e.returncode, e.log
    server.stop(30)
    return None, server.log


def test_a_factory_that_fails_to_import_stops_the_server_with_its_own_error(tmp_path):
    code, log = _serve(tmp_path, "batchd_broken:Anything", "--python-path", str(PYDATA))
    assert code == 1, log
    assert "RuntimeError: batchd_broken refuses to import: its data volume is not mounted" in log, log
    assert "batchd_broken.py" in log and "Traceback" in log, "the module's own traceback"
    assert "dataset 'mine' (kind python)" in log, log


def test_a_factory_that_fails_to_build_stops_the_server_with_its_own_error(tmp_path):
    code, log = _serve(tmp_path, "batchd_testdata:build_failing", "--python-path", str(PYDATA))
    assert code == 1, log
    assert "RuntimeError: cannot open the data: {}" in log and "in build_failing" in log, log


def test_python_path_finds_the_factory(tmp_path):
    code, log = _serve(tmp_path, "batchd_testdata:Mixed")
    assert code == 1 and "ModuleNotFoundError: No module named 'batchd_testdata'" in log, log  # not without it
    code, log = _serve(tmp_path, "batchd_testdata:Mixed", "--python-path", str(PYDATA), args={"only": ["image"]})
    assert code is None, log
    assert "dataset 'mine': python, 12 samples" in log, log


def test_torch_tensors_and_pil_images_become_numpy_arrays():
    """What torchvision-style datasets return, as the collate test reads them back (torch) and here (PIL)."""
    import torch
    from PIL import Image

    from batchd.server.data.datasets.python import to_numpy

    rgb = np.arange(4 * 3 * 3, dtype=np.uint8).reshape(3, 4, 3)
    assert np.array_equal(to_numpy(Image.fromarray(rgb)), rgb)
    t = torch.arange(6, dtype=torch.int32).reshape(2, 3)
    assert to_numpy(t).dtype == np.int32 and np.array_equal(to_numpy(t), t.numpy())
    assert to_numpy(t.requires_grad_(False).float().requires_grad_()).dtype == np.float32  # detached
    assert to_numpy(5) == 5 and to_numpy("x") == "x"
