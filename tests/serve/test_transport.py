"""Transports: shared memory (leased slots) and inline bytes (optionally LZ4), against a real server;
ragged fields through ``Transport`` driven directly with hand-made layouts."""

from __future__ import annotations

import gc
import logging

import lz4.frame as lz4_frame
import numpy as np
import pytest
import torch

import batchd
import batches
from batch_server import ready_batch
from batchd.client.transport import shm as client_shm
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until

pytestmark = pytest.mark.timeout(120)


def _batches(address, transport, **kw):
    with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=100, shuffle=True, seed=3,
                                 transport=transport, **kw) as loader:
        return list(loader), loader


def test_shared_memory_equals_inline_bytes(fmnist_server):
    shm_batches, shm_loader = _batches(fmnist_server.address, "shm", transform="flip")
    inline_batches, _ = _batches(fmnist_server.address, "inline", transform="flip")
    lz4_batches, _ = _batches(fmnist_server.address, "inline", transform="flip", compression="lz4")
    assert shm_loader._shm is not None
    assert len(shm_batches) == len(inline_batches) == len(lz4_batches) == 100
    for a, b, c in zip(shm_batches, inline_batches, lz4_batches):
        for key in ("image", "label", "index"):
            assert torch.equal(a[key], b[key]) and torch.equal(a[key], c[key])


def test_keeping_every_batch_neither_corrupts_nor_deadlocks(fmnist_server):
    """list(loader) holds all 100 batches: the first max_leases_per_session stay in leased slots,
    the rest arrive inline, and none is overwritten while held."""
    kept, loader = _batches(fmnist_server.address, "shm")
    reference, _ = _batches(fmnist_server.address, "inline")
    max_held = fmnist_server.config.max_leases_per_session
    assert fmnist_server.loader.leases.held(loader._shm.session) == max_held  # the rest came inline
    # read again after more streams have run on the server: still the original bytes
    _batches(fmnist_server.address, "shm")
    for a, b in zip(kept, reference):
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["index"], b["index"])
    indices = torch.cat([b["index"] for b in kept])
    assert indices.unique().numel() == indices.numel() == 10_000


def test_slots_go_back_when_tensors_are_freed(fmnist_server):
    leases = fmnist_server.loader.leases
    loader = batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=500, transport="shm")
    held = [next(iter(loader))]  # abandons the iteration after one batch
    session = loader._shm.session
    # the batch we hold: those the server sent ahead are dropped as they come and released on the
    # call, which lives on for the loader's next pass
    assert wait_until(lambda: leases.held(session) == 1), leases.held(session)
    held.clear()
    gc.collect()
    assert wait_until(lambda: leases.held(session) == 0), "the lease was not released after the batch was freed"
    # the loader keeps working after its first iteration was abandoned
    assert sum(b["image"].shape[0] for b in loader) == 10_000
    loader.close()
    assert wait_until(lambda: leases.sessions == 0 or session not in leases._sessions)


def test_close_waits_for_batches_still_held(fmnist_server):
    leases = fmnist_server.loader.leases
    loader = batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=500, transport="shm")
    batch = next(iter(loader))
    expected = batch["image"].clone()
    session = loader._shm.session
    loader.close()
    # a second loader churns through slots; the held batch must not change
    _batches(fmnist_server.address, "shm")
    assert torch.equal(batch["image"], expected)
    assert session in leases._sessions and leases.held(session) >= 1
    del batch
    gc.collect()
    assert wait_until(lambda: session not in leases._sessions), "the session did not end after the last batch was freed"


def test_falls_back_to_inline_when_shared_memory_is_not_shared(fmnist_server, tmp_path, monkeypatch, caplog):
    # A client whose /dev/shm is another directory: as in a container without the server's IPC namespace.
    monkeypatch.setattr(client_shm, "SHM_DIR", tmp_path)
    with caplog.at_level(logging.WARNING, logger="batchd.client.loader"):
        batches, loader = _batches(fmnist_server.address, "auto")
    assert loader._shm is None
    assert sum(b["image"].shape[0] for b in batches) == 10_000
    assert any("shared memory with" in r.message and "unavailable" in r.message for r in caplog.records)
    with pytest.raises(RuntimeError, match="transport='shm'"):
        _batches(fmnist_server.address, "shm")


def test_unavailable_shared_memory_is_said_once_per_loader(fmnist_server, tmp_path, monkeypatch, caplog):
    """Each loader that finds the server's shared memory unreadable says so once: not again on its
    next epochs nor after a reconnect (which opens a new session: ``new_session``, then asks again
    on its next ``open``), and not hidden from a second loader in the same process (each is told once)."""
    monkeypatch.setattr(client_shm, "SHM_DIR", tmp_path)
    tries = []  # shared-memory sessions asked for: the first, then one after each new_session
    open_session = client_shm.SharedMemorySession.open

    def counted_open(*args, **kwargs):
        tries.append(args)
        return open_session(*args, **kwargs)

    monkeypatch.setattr(client_shm.SharedMemorySession, "open", counted_open)

    def said() -> int:
        return sum("shared memory with" in r.getMessage() and "unavailable" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="batchd.client.loader"):
        for loader_number in (1, 2):
            with batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", batch_size=2500,
                                         transport="auto") as loader:
                conn = loader.servers.links[0].conn
                for epoch in range(3):
                    loader.set_epoch(epoch)
                    assert sum(len(b["label"]) for b in loader) == 10_000
                    conn.new_session()  # what a reconnect does before its new call's open
                    conn.request(epoch + 1)  # (that open asks for shared memory again)
                assert loader._shm is None and loader.stats()["bytes_received"]["shm"] == 0
            assert len(tries) == 4 * loader_number, "the first open and each after a new session should ask"
            assert said() == loader_number, [r.getMessage() for r in caplog.records]


def test_bad_transport_arguments(fmnist_server):
    with pytest.raises(ValueError, match="transport"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", transport="tcp")
    with pytest.raises(ValueError, match="compression"):
        batchd.RemoteDataLoader(fmnist_server.address, "fmnist-test", compression="gzip")


# --- ragged fields: Transport driven directly with hand-made layouts ------------------------------


@pytest.fixture
def transport():
    from batchd.server.serve.leases import LeaseTable
    from batchd.server.shm import Owner, SlotPool
    from batchd.server.serve.transport import Transport

    owner = Owner()
    slots = SlotPool(max_slots=4, prefix=owner.prefix)
    try:
        yield Transport(slots, LeaseTable(slots, max_held=4))
    finally:
        slots.close()
        owner.close()


def _stream(transport, how: str):
    from batchd.server.compute.protocol import StreamRequest
    from batchd.server.serve.stream import Stream

    request = StreamRequest("det", batch_size=3, transport="shm" if how == "shm" else "inline",
                            session="s" if how == "shm" else "", compression="lz4" if how == "lz4" else "none")
    if how == "shm":
        transport.leases.open("s")
    stream = Stream(request, num_batches=1)
    transport.open(stream)
    return stream


@pytest.mark.parametrize("how", ["inline", "lz4", "shm"])
def test_ragged_layouts_travel_with_their_shapes_and_offsets(transport, how):
    samples = batches.detection_samples([3, 4, 5])  # ragged image, boxes (N = 3, 0, 1), masks; str, bytes
    ready = ready_batch(transport.slots, 0, batches.pack(samples))
    stream = _stream(transport, how)
    m = pb.Batch.FromString(transport.encode(stream, ready))
    assert bool(m.segment) == (how == "shm")
    for t, layout in zip(m.tensors, ready.tensors):
        if how == "shm":
            data = bytes(ready.slot.buf[t.offset:t.offset + layout.nbytes])  # lent in place: no bytes in the message
            assert not t.data
        else:
            data = lz4_frame.decompress(t.data) if t.compression == pb.COMPRESSION_LZ4 else t.data
        values = batches.unpack(t, data)  # as the proto's comment says
        for i, (value, sample) in enumerate(zip(values, samples)):
            want = sample[t.name]
            assert value == want if isinstance(want, str | bytes) else np.array_equal(value, want), f"{t.name}[{i}]"
    by_name = {t.name: t for t in m.tensors}
    assert (by_name["boxes"].sample_ndim, list(by_name["boxes"].sample_offsets)) == (2, [0, 12, 12, 16])
    assert by_name["name"].sample_ndim == 1 and by_name["label"].sample_ndim == 0
    if how == "shm":  # the lease counts B samples, not the ragged first field's elements
        transport.release(pb.ReleaseLeasesRequest(session="s", leases=[m.lease]))
        assert (stream.batches_taken, stream.samples_taken) == (1, 3)
    else:
        assert stream.bytes_copied == sum(t.nbytes for t in ready.tensors)
    transport.slots.release(ready.slot)


def test_a_layout_whose_shapes_do_not_fit_its_values_is_never_sent():
    from batchd.server.compute.protocol import TensorLayout
    from batchd.server.serve.transport import ragged_fields

    assert ragged_fields(TensorLayout("label", "int64", (3,), 0)) == {}
    b0 = ragged_fields(TensorLayout("x", "int64", (0,), 0, ()))  # B = 0: still ragged, offsets [0]
    assert b0 == {"sample_ndim": 1, "sample_shapes": (), "sample_offsets": (0,)}
    for name, dtype, shapes, message in [
        ("boxes", "float32", ((2,), (4,)), "sample shapes of 6 elements for values of shape \\[8\\]"),
        ("boxes", "float32", ((1, 4), (4,)), "sample shape \\[4\\] among shapes of 2 dimensions"),
        ("boxes", "float32", ((-1, 4), (3, 4)), "sample shape \\[-1, 4\\]"),
        ("name", "str", ((2, 2), (1, 2)), "str samples must have one dimension, not 2"),
    ]:
        with pytest.raises(ValueError, match=f"field {name!r}: {message}"):
            ragged_fields(TensorLayout(name, dtype, (8,), 0, shapes))
