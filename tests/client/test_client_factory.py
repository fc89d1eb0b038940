"""``RemoteDataLoader(...)``, the one entry point: a facade over one ``Servers`` (one server is
the same code with n = 1), options checked once in the caller's thread (the CUDA device index
too), and the ``gpu_transform`` hook. Real servers; CUDA itself is replaced only where this
machine has none.
"""

from __future__ import annotations

import threading

import pytest
import torch

import batchd
from batchd.client.device import transfer as transfer_mod
from batchd.client.device.transfer import finish
from batchd.client.iteration.servers import Servers
from batchd.client.loader.loader import RemoteDataLoader
from batchd.client.loader.options import resolve_device

pytestmark = pytest.mark.timeout(120)

KW = dict(batch_size=500, shuffle=True, seed=11)


def _servers(make_server, fmnist_root, n):
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}
    return [make_server(workers=1, datasets=datasets) for _ in range(n)]


def test_one_entry_point_one_implementation(make_server, fmnist_root):
    a, b = _servers(make_server, fmnist_root, 2)
    assert "__new__" not in RemoteDataLoader.__dict__
    with batchd.RemoteDataLoader(a.address, "fmnist-test", **KW) as one, \
         batchd.RemoteDataLoader([a.address], "fmnist-test", **KW) as listed, \
         batchd.RemoteDataLoader([a.address, b.address], "fmnist-test", **KW) as two:
        assert type(one) is type(listed) is type(two) is batchd.RemoteDataLoader
        assert type(one.servers) is type(listed.servers) is type(two.servers) is Servers
        assert one.servers.single and listed.servers.single and not two.servers.single
        assert two.addresses == [a.address, b.address]
        assert len(one) == len(two) == 20 and one.batch_size == two.batch_size == 500
        assert one.reconnect_timeout == two.reconnect_timeout == 60.0 and one.connect_timeout == 10.0
        first = [bt["index"].clone() for bt in one]
        assert [bt["index"].tolist() for bt in two] == [f.tolist() for f in first]
        assert one.epoch == two.epoch == 1
        assert one.state_dict() == {**two.state_dict()}
    with pytest.raises(AttributeError):
        one.no_such_attribute


def test_bad_arguments_are_refused_before_any_connection():
    for kwargs, match in (({"batch_size": 0}, "batch_size"), ({"prefetch": 0}, "prefetch"),
                          ({"transport": "tcp"}, "transport"), ({"device": "mps"}, "device"),
                          ({"gpu_transform": 3}, "gpu_transform"), ({"seed": -1}, "seed")):
        with pytest.raises(ValueError, match=match):
            batchd.RemoteDataLoader("127.0.0.1:1", "fmnist-test", connect_timeout=0.1, **kwargs)


def test_resolve_device():
    assert resolve_device(None) == torch.device("cpu") == resolve_device("cpu")
    assert resolve_device("cuda", current_index=lambda: 3) == torch.device("cuda", 3)
    assert resolve_device(torch.device("cuda"), current_index=lambda: 1) == torch.device("cuda", 1)
    assert resolve_device("cuda:2", current_index=lambda: 0) == torch.device("cuda", 2)
    with pytest.raises(ValueError, match="device"):
        resolve_device("mps")
    with pytest.raises(ValueError, match="device"):
        resolve_device("not a device")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="CUDA is not available"):
            resolve_device("cuda")


class FakeTransfer:
    """Stands in for CudaTransfer on a machine without CUDA: records where it was built."""

    built: list = []
    maps_host_memory = False

    def __init__(self, device):
        self.device = device
        self.thread = threading.current_thread()
        self.copies = 0
        FakeTransfer.built.append(self)

    def to_device(self, batch, stopping=None, *, registered=False, finish=None, seed=0, epoch=0, marks=None):
        self.copies += 1
        return batch, "event"

    def hand_over(self, batch, event):
        assert event == "event"
        return batch

    def close(self):
        pass


def test_several_servers_use_the_callers_cuda_device(make_server, fmnist_root, monkeypatch):
    """DDP rank 1 after torch.cuda.set_device(1): "cuda" is cuda:1 for every server's stream,
    although the per-server connections are built in pool threads (whose current device is 0)."""
    servers = _servers(make_server, fmnist_root, 2)
    main = threading.current_thread()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1 if threading.current_thread() is main else 0)
    monkeypatch.setattr(transfer_mod, "CudaTransfer", FakeTransfer)
    FakeTransfer.built.clear()
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", device="cuda", **KW) as ld:
        assert ld.device == torch.device("cuda", 1)
        assert [t.device for t in FakeTransfer.built] == [torch.device("cuda", 1)]
        assert FakeTransfer.built[0].thread is main
        conns = [link.conn for link in ld.servers.links]
        assert all(c.transfer is FakeTransfer.built[0] and c.options.device == torch.device("cuda", 1) for c in conns)
        assert sum(1 for _ in ld) == 20 and FakeTransfer.built[0].copies == 20


def test_gpu_transform_finishes_each_batch(make_server, fmnist_root):
    (server,) = _servers(make_server, fmnist_root, 1)
    calls = []

    def to_float(images, positions, *, seed, epoch):
        calls.append((positions.clone(), seed, epoch))
        return images.permute(0, 3, 1, 2).float() / 255

    with batchd.RemoteDataLoader(server.address, "fmnist-test", **KW) as plain, \
         batchd.RemoteDataLoader(server.address, "fmnist-test", gpu_transform=to_float, **KW) as finished:
        finished.set_epoch(1)
        plain.set_epoch(1)
        for p, f in zip(plain, finished):
            assert f["image"].dtype == torch.float32 and f["image"].shape == (500, 1, 28, 28)
            assert torch.equal(f["image"], p["image"].permute(0, 3, 1, 2).float() / 255)
            assert torch.equal(f["position"], p["position"])
    assert len(calls) == 20 and all(seed == 11 and epoch == 1 for _, seed, epoch in calls)
    assert torch.equal(torch.sort(torch.cat([c[0] for c in calls])).values, torch.arange(10_000))


def test_gpu_transform_needs_positions():
    with pytest.raises(ValueError, match="position"):
        finish({"image": torch.zeros(2, 4, 4, 3, dtype=torch.uint8)}, lambda i, p, **kw: i, 0, 0)
    with pytest.raises(TypeError, match="tensor"):
        finish({"image": torch.zeros(2, 4, 4, 3, dtype=torch.uint8), "position": torch.arange(2)},
               lambda i, p, **kw: None, 0, 0)
