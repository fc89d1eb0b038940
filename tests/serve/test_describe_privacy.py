"""A dataset name that is a server path gets the same answer whether or not the path exists (issue 10.8).

Before: the NOT_FOUND message ran the requested name through the server's path redaction, so a
configured path (a dataset root, the cache directory, the Python install) came back as
``'<server path>'`` and a path that does not exist came back as sent: one unauthenticated
DescribeDataset per candidate told which paths exist on the server. Now the name is echoed as sent,
whatever it is; the answers for an existing and a missing path differ only by the name itself.
"""

from __future__ import annotations

import pathlib
import sys

import grpc
import numpy as np
import pytest
from helpers import write_png

from batchd.client.transport.channel import make_channel
from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> pathlib.Path:
    """base/photos/cat/0.png (the dataset root) and base/elsewhere/ (exists, not configured)."""
    base = tmp_path_factory.mktemp("privacy")
    write_png(base / "photos" / "cat" / "0.png", np.zeros((8, 8, 3), np.uint8))
    (base / "elsewhere").mkdir()
    return base


def _pairs(tree: pathlib.Path, cache: pathlib.Path) -> list[tuple[str, str]]:
    """(a path that exists on the server, one that does not), both looking alike."""
    pairs = [
        (tree / "photos", tree / "photoz"),  # the dataset root itself
        (tree / "photos" / "cat", tree / "photos" / "dog"),  # inside the root
        (tree / "photos" / "cat" / "0.png", tree / "photos" / "cat" / "1.png"),
        (cache, cache.with_name(cache.name + "-none")),  # the cache directory
        (tree / "elsewhere", tree / "nowhere"),  # not in the config at all
        (pathlib.Path(sys.prefix), pathlib.Path(sys.prefix + "-none")),  # the server's Python
        (pathlib.Path(sys.prefix) / "bin", pathlib.Path(sys.prefix) / "nib"),
        (pathlib.Path("/etc/passwd"), pathlib.Path("/etc/passwd-none")),
    ]
    for there, missing in pairs:
        assert there.exists() and not missing.exists(), (there, missing)
    return [(str(a), str(b)) for a, b in pairs] + [(str(tree / "photos") + "/", str(tree / "photoz") + "/"),
                                                   (f"{tree}/photos/../photos", f"{tree}/photoz/../photoz"),
                                                   (f"{tree}/photos\n", f"{tree}/photoz\n")]  # echoed as repr() quotes it


def _not_found(call, name: str) -> str:
    with pytest.raises(grpc.RpcError) as e:
        call(name)
    assert e.value.code() == grpc.StatusCode.NOT_FOUND, (name, e.value.code(), e.value.details())
    return e.value.details()


def _shape(details: str, name: str) -> str:
    """The answer with the requested name taken out; it must be there, verbatim."""
    assert repr(name) in details, (name, details)
    return details.replace(repr(name), "NAME")


def test_existing_and_missing_server_paths_get_the_same_answer(make_server, tree, tmp_path):
    cache = tmp_path / "cache"
    server = make_server(datasets={"photos": {"kind": "imagefolder", "root": str(tree / "photos")}},
                         workers=1, cache_dir=cache)
    with make_channel(server.address) as channel:
        stub = loader_pb2_grpc.BatchLoaderStub(channel)

        def describe(name):
            stub.DescribeDataset(pb.DescribeDatasetRequest(name=name), timeout=10)

        def stream(name):
            list(stub.StreamBatches(pb.StreamBatchesRequest(dataset=name, batch_size=1), timeout=10))

        for call in (describe, stream):
            answers = set()
            for there, missing in _pairs(tree, cache):
                a, b = _shape(_not_found(call, there), there), _shape(_not_found(call, missing), missing)
                assert a == b, (call.__name__, there, a, missing, b)
                answers.add(a)
            assert len(answers) == 1, answers  # and every name, path or not, gets that one answer
            assert _shape(_not_found(call, "no-such-dataset"), "no-such-dataset") in answers
            assert "<server path>" not in answers.pop()

