"""Shared fixtures: real servers on 127.0.0.1:0 over real files."""

from __future__ import annotations

import contextlib
import pathlib

import pytest

from batchd.server.app import Server
from batchd.server.config import ServerConfig

FMNIST_ROOT = pathlib.Path("/usr/share/datasets/fashion-mnist")


@pytest.fixture(scope="session")
def fmnist_root() -> pathlib.Path:
    if not (FMNIST_ROOT / "train-images-idx3-ubyte.gz").exists():
        pytest.skip("Fashion-MNIST is not installed (apt-get install dataset-fashion-mnist, or `make install`)")
    return FMNIST_ROOT


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> pathlib.Path:
    return tmp_path_factory.mktemp("batchd-cache")


@contextlib.contextmanager
def running_server(**config):
    """A started Server for ``ServerConfig(**config)`` on 127.0.0.1:0; stopped on exit."""
    config.setdefault("address", "127.0.0.1:0")
    config.setdefault("workers", 2)
    server = Server(ServerConfig.model_validate(config)).start()
    try:
        yield server
    finally:
        server.stop(grace=1.0)


@pytest.fixture
def make_server(cache_dir):
    """Factory: ``make_server(datasets={...}, workers=2, ...)`` -> a started Server, stopped after the test."""
    with contextlib.ExitStack() as stack:
        def make(**config):
            config.setdefault("cache_dir", cache_dir)
            return stack.enter_context(running_server(**config))

        yield make


@pytest.fixture(scope="module")
def fmnist_server(fmnist_root, tmp_path_factory):
    """One server per test module with fmnist-train, fmnist-test and a flip preset, 2 workers."""
    import albumentations as A

    flip = A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))
    with running_server(
        cache_dir=tmp_path_factory.mktemp("fmnist-cache"),
        datasets={
            "fmnist-train": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "train"},
            "fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"},
        },
        pipelines={"flip": flip},
    ) as server:
        yield server
