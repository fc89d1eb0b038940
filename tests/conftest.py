"""Shared fixtures: real servers on 127.0.0.1:0 over real files."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal

import pytest

from batchd.server.app import Server
from batchd.server.config import ServerConfig
from procs import ServerProcess, alive, descendants

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


@pytest.fixture
def server_procs():
    """Factory of ServerProcess objects; any still running at the end are killed, with their workers."""
    made: list[ServerProcess] = []

    def make(config: pathlib.Path, address: str) -> ServerProcess:
        made.append(ServerProcess(config, address))
        return made[-1]

    yield make
    for p in made:
        if p.proc is not None and p.proc.poll() is None:
            tree = descendants(p.pid)
            p.kill()
            for pid, start in tree.items():
                if alive(pid, start):
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass


@pytest.fixture(scope="session")
def fashion_coco(fmnist_root, tmp_path_factory) -> pathlib.Path:
    """A small dataset of examples/make_fashion_coco.py (seed 0): 60 train and 20 val canvases,
    images/{train,val}/, masks/{train,val}/ (VOC-style) and annotations/instances_{train,val}.json."""
    from helpers import load_example

    out = tmp_path_factory.mktemp("fashion-coco")
    gen = load_example("make_fashion_coco")
    gen.main(["--out", str(out), "--images", "60", "--val-images", "20", "--seed", "0", "--fmnist", str(fmnist_root)])
    return out


@pytest.fixture(scope="session")
def pki(tmp_path_factory):
    """PEM files (tests/pki.py): ca, server cert/key (SAN 127.0.0.1, localhost), client cert/key, a
    rogue client's cert/key. Skips without ``cryptography``."""
    pytest.importorskip("cryptography")
    from pki import make_pki

    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture
def slots():
    """A SlotPool of 8 batch slots in shared memory of this process's own (unlinked after the test)."""
    from batchd.server.shm import Owner, SlotPool

    owner = Owner()
    pool = SlotPool(max_slots=8, prefix=owner.prefix)
    yield pool
    pool.close()
    owner.close()
