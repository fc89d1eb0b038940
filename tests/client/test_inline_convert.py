"""Who converts a received batch (``batchd.client.delivery``): with one server and CPU tensors as
they came, the training loop's own thread (one thread hand-off less per batch), which also reads
each batch off the call itself (the call on loan from its lane thread,
``batchd.client.lane_runner``: another hand-off less); with a ``collate_fn``, or several servers
(hedging, lateness), the converter thread, and the lane threads receive. Either way every batch
once, in order, with the same bytes."""

from __future__ import annotations

import collections
import threading

import pytest
import torch
from torch.utils.data import default_collate

import batchd
from batchd.client.transport.connection import ServerConnection
from batchd.client.feed import Feed

pytestmark = pytest.mark.timeout(120)

KW = dict(batch_size=500, shuffle=True, seed=3)


@pytest.fixture
def converted_in(monkeypatch):
    """The name of the thread each batch was converted in, by batch index."""
    seen: dict[int, str] = {}
    real = ServerConnection.convert

    def spy(self, raw, stopping, record):
        seen[raw.batch_index] = threading.current_thread().name
        return real(self, raw, stopping, record)

    monkeypatch.setattr(ServerConnection, "convert", spy)
    return seen


@pytest.fixture
def received_in(monkeypatch):
    """The name of the thread each batch was received in (``Feed.arrive``), by batch index."""
    seen: dict[int, str] = {}
    real = Feed.arrive

    def spy(self, runner, raw, received, nbytes, record):
        seen[raw.batch_index] = threading.current_thread().name
        return real(self, runner, raw, received, nbytes, record)

    monkeypatch.setattr(Feed, "arrive", spy)
    return seen


def _read(loader) -> list:
    return [(b["index"].clone(), b["image"].clone()) for b in loader]


@pytest.mark.parametrize("transport", ["shm", "inline", "socket"])
def test_one_server_converts_in_the_loops_thread_with_the_same_batches(fmnist_server, converted_in, received_in,
                                                                        transport):
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport=transport, **KW) as ld:
        got = _read(ld)
        got_again = _read(ld)  # a second epoch: a new feed, inline again
    loop = threading.current_thread().name
    assert set(converted_in.values()) == {loop}, collections.Counter(converted_in.values())
    assert set(received_in.values()) == {loop}, collections.Counter(received_in.values())
    assert len(got) == len(got_again) == 20
    indices = torch.cat([i for i, _ in got])
    assert sorted(indices.tolist()) == list(range(10_000)), "a sample missing or repeated"
    converted_in.clear()
    received_in.clear()
    with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport=transport,
                                 collate_fn=default_collate, **KW) as ld:  # (a collate_fn: the converter's)
        want = [(b["index"], b["image"]) for b in ld]
    assert set(converted_in.values()) == {"batchd-convert"}, collections.Counter(converted_in.values())
    assert loop not in received_in.values(), collections.Counter(received_in.values())
    for (i, x), (j, y) in zip(got, want):
        assert torch.equal(i, j) and torch.equal(x, y), "inline conversion changed a batch"


def test_several_servers_convert_in_the_converter(make_server, fmnist_root, converted_in, received_in):
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}
    servers = [make_server(workers=1, datasets=datasets) for _ in range(2)]
    with batchd.RemoteDataLoader([s.address for s in servers], "fmnist-test", transport="shm", **KW) as ld:
        got = _read(ld)
    assert set(converted_in.values()) == {"batchd-convert"}, collections.Counter(converted_in.values())
    assert set(received_in.values()) == {"batchd-lane"}, collections.Counter(received_in.values())
    assert sorted(torch.cat([i for i, _ in got]).tolist()) == list(range(10_000))
