"""Who converts a received batch (``batchd.client.iteration.epoch``): with CPU tensors as they came,
the training loop's own thread (one thread hand-off less per batch), whether one server or several
feed the loader; with a ``collate_fn`` (or a device copy, ``gpu_transform``, ``decode_on_client``)
the loader's thread, one batch ahead (the double buffer). Batches are received by each server's
link thread either way. Every batch once, in order, with the same bytes."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils.data import default_collate

import batchd
from batchd.client.iteration import epoch as epoch_mod

pytestmark = pytest.mark.timeout(120)

KW = dict(batch_size=500, shuffle=True, seed=3)


@pytest.fixture
def converted_in(monkeypatch):
    """The name of the thread each batch was converted in, by batch index."""
    seen: dict[int, str] = {}
    real = epoch_mod.convert

    def spy(raw, shm, **kw):
        seen[raw.batch_index] = threading.current_thread().name
        return real(raw, shm, **kw)

    monkeypatch.setattr(epoch_mod, "convert", spy)
    return seen


@pytest.fixture
def received_in(monkeypatch):
    """The name of the thread each batch was received in (``Epoch.arrived``), by batch index."""
    seen: dict[int, str] = {}
    real = epoch_mod.Epoch.arrived

    def spy(self, link, raw, received, nbytes, shm):
        seen[raw.batch_index] = threading.current_thread().name
        return real(self, link, raw, received, nbytes, shm)

    monkeypatch.setattr(epoch_mod.Epoch, "arrived", spy)
    return seen


def _read(loader) -> list:
    return [(b["index"].clone(), b["image"].clone()) for b in loader]


@pytest.mark.parametrize("transport", ["shm", "inline", "socket"])
def test_cpu_batches_convert_in_the_loops_thread_with_the_same_batches(fmnist_server, converted_in, received_in,
                                                                       transport):
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport=transport, **KW) as ld:
        got = _read(ld)
        got_again = _read(ld)  # a second epoch: a new pass, inline again
    loop = threading.current_thread().name
    assert set(converted_in.values()) == {loop}, collections.Counter(converted_in.values())
    assert set(received_in.values()) == {"batchd-server"}, collections.Counter(received_in.values())
    assert len(got) == len(got_again) == 20
    indices = torch.cat([i for i, _ in got])
    assert sorted(indices.tolist()) == list(range(10_000)), "a sample missing or repeated"
    converted_in.clear()
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport=transport,
                                 collate_fn=default_collate, **KW) as ld:  # (a collate_fn: the loader's thread)
        want = [(b["index"], b["image"]) for b in ld]
    assert set(converted_in.values()) == {"batchd-loader"}, collections.Counter(converted_in.values())
    for (i, x), (j, y) in zip(got, want):
        assert torch.equal(i, j) and torch.equal(x, y), "inline conversion changed a batch"


def test_several_servers_convert_in_the_loops_thread_too(make_server, fmnist_root, converted_in, received_in):
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}
    servers = [make_server(workers=1, datasets=datasets) for _ in range(2)]
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", transport="shm", **KW) as ld:
        got = _read(ld)
    assert set(converted_in.values()) == {threading.current_thread().name}, collections.Counter(converted_in.values())
    assert set(received_in.values()) == {"batchd-server"}, collections.Counter(received_in.values())
    assert sorted(torch.cat([i for i, _ in got]).tolist()) == list(range(10_000))
