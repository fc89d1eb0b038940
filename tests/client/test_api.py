"""The API that tools can see: what ``batchd`` exports, ``RemoteDataLoader``'s declared (not
forwarded) attributes and documented arguments, the ``PythonDataset`` protocol, and batchd's
errors, which ``except batchd.BatchdError`` catches: a real unreachable server and a real timeout."""

from __future__ import annotations

import builtins
import inspect
import pathlib
import re

import numpy as np
import pytest

import batchd
from batchd.client.transport import channel
from batchd.client.transport import datasets
from batchd.client.transport import server_stats as stats
from batchd.client.loader.options import LoaderOptions, LoaderSettings, Setting
from helpers import free_port
from procs import SLOW

pytestmark = pytest.mark.timeout(120)


def test_the_public_names_are_sorted_and_resolve():
    assert batchd.__all__ == sorted(batchd.__all__)
    for name in batchd.__all__:
        assert getattr(batchd, name) is not None, name
    assert batchd.describe_dataset is datasets.describe_dataset
    assert batchd.get_stats is stats.get_stats
    assert batchd.TLS is channel.TLS
    assert (pathlib.Path(batchd.__file__).parent / "py.typed").is_file(), "the PEP 561 marker"


def test_connection_and_timeout_errors_are_batchd_errors_and_the_builtins():
    for ours, builtin in ((batchd.ConnectionError, builtins.ConnectionError),
                          (batchd.TimeoutError, builtins.TimeoutError)):
        assert ours is not builtin and issubclass(ours, batchd.BatchdError) and issubclass(ours, builtin)
        error = ours("no batchd server answered at 127.0.0.1:1 within 0.5 s")
        assert str(error) == "no batchd server answered at 127.0.0.1:1 within 0.5 s"


def test_batchd_error_catches_an_unreachable_server_and_a_timeout(make_server, fmnist_root):
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    for connect in (lambda: batchd.RemoteDataLoader(address, "fmnist", connect_timeout=0.5),
                    lambda: batchd.list_datasets(address, timeout=0.5),
                    lambda: batchd.get_stats(address, timeout=0.5)):
        with pytest.raises(batchd.BatchdError) as caught:
            connect()
        assert isinstance(caught.value, batchd.ConnectionError) and address in str(caught.value)
        with pytest.raises(ConnectionError):  # the built-in, as before
            connect()

    # a real server, but a batch takes about 10 ms per sample on its one worker: none within 0.2 s
    server = make_server(workers=1, datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root),
                                                          "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=64, transform=SLOW, timeout=0.2) as loader:
        with pytest.raises(batchd.BatchdError) as caught:
            next(iter(loader))
    assert isinstance(caught.value, batchd.TimeoutError) and isinstance(caught.value, TimeoutError)
    assert "no batch from" in str(caught.value) and "0.2 s" in str(caught.value)


def test_the_loaders_attributes_are_declared_not_forwarded(make_server, fmnist_root):
    assert not hasattr(batchd.RemoteDataLoader, "__getattr__"), "IDEs and type checkers cannot see forwarded names"
    for name in LoaderOptions.__dataclass_fields__:  # every setting, typed and read-only
        assert isinstance(inspect.getattr_static(batchd.RemoteDataLoader, name), Setting), name
    server = make_server(workers=1, datasets={"fmnist": {"kind": "fashion-mnist", "root": str(fmnist_root),
                                                          "split": "test"}})
    with batchd.RemoteDataLoader(server.address, "fmnist", batch_size=8, connect_timeout=3.0,
                                 max_message_bytes=64 << 20) as loader:
        assert {name: getattr(loader, name) for name in LoaderOptions.__dataclass_fields__} == \
            {name: getattr(loader.options, name) for name in LoaderOptions.__dataclass_fields__}
        assert (loader.connect_timeout, loader.max_message_bytes, loader.hedge) == (3.0, 64 << 20, True)
        assert loader.addresses == [server.address] and [s["address"] for s in loader.server_stats()] == loader.addresses
        with pytest.raises(AttributeError, match="read-only"):
            loader.batch_size = 16
        assert loader.batch_size == 8
        with pytest.raises(AttributeError):
            loader.no_such_attribute  # noqa: B018


def _documented_arguments(doc: str) -> set[str]:
    args = doc.split("\n    Args:\n", 1)[1].split("\n\n", 1)[0]
    return {name.strip() for names in re.findall(r"^ {8}(\w+(?:, \w+)*):", args, re.M) for name in names.split(",")}


def test_every_constructor_argument_is_documented():
    arguments = set(inspect.signature(batchd.RemoteDataLoader.__init__).parameters) - {"self"}
    documented = _documented_arguments(batchd.RemoteDataLoader.__doc__)
    assert arguments == documented, (f"undocumented: {sorted(arguments - documented)}; "
                                     f"documented but not taken: {sorted(documented - arguments)}")
    assert issubclass(batchd.RemoteDataLoader, LoaderSettings)


class _Squares(batchd.PythonDataset):
    def __init__(self, n: int = 3):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int, rng=None) -> dict:
        return {"image": np.full((4, 4, 1), index, np.uint8), "label": index}


class _NoLength:
    def __getitem__(self, index: int) -> dict:
        return {}


def test_the_python_dataset_protocol_is_what_the_server_needs():
    """``__len__`` and ``__getitem__``, with or without ``rng`` (server/data/datasets/python.py);
    ``fields`` and ``fingerprint`` stay optional (a class without them fits)."""
    assert isinstance(_Squares(), batchd.PythonDataset) and len(_Squares()) == 3
    assert _Squares()[2]["label"] == 2
    assert not isinstance(_NoLength(), batchd.PythonDataset)
    members = {name for name in vars(batchd.PythonDataset) if not name.startswith("_")}
    assert "fields" not in members and "fingerprint" not in members
