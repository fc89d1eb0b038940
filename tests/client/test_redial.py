"""A data connection refused or reset before its first byte is dialed again with the call's
token; a data port that refuses every dial sends a ``transport="auto"`` loader inline, with one
warning and ``stats()["data_plane_fallbacks"]`` (client/transport/redial.py; issue 37).

A real server on 127.0.0.1:0 whose data plane refuses connections on purpose (its accept
thread's ``on_token`` answers "evicted" for the first ones, or for all), as a flood of idle
connections made it do; the loaders' bytes equal those inline, every batch once.
"""

from __future__ import annotations

import logging

import albumentations as A
import pytest

import batchd
from helpers import digest
from procs import RANDOM_AUG, fmnist_test_config

pytestmark = pytest.mark.timeout(180)

BATCH = 500


@pytest.fixture(scope="module")
def server(fmnist_root, tmp_path_factory):
    from conftest import running_server

    with running_server(cache_dir=tmp_path_factory.mktemp("cache"), workers=2, datasets=fmnist_test_config(fmnist_root),
                        pipelines={"aug": A.to_dict(RANDOM_AUG)}) as srv:
        yield srv


def refusing(srv, first: int | None):
    """Make ``srv``'s data plane refuse the ``first`` connections that present a token (all, for
    None), as its accept thread refuses an evicted one: closed without a byte. Returns the list
    that counts them; undo with ``restore``."""
    handshakes = srv.data_plane._handshakes
    accept = handshakes._on_token
    refused: list[int] = []

    def on_token(*args):
        if first is None or len(refused) < first:
            refused.append(1)
            return "evicted (test)"
        return accept(*args)

    handshakes._on_token = on_token
    return refused, lambda: setattr(handshakes, "_on_token", accept)


def read(address, transport: str, **kw) -> tuple[list[str], dict]:
    kw = {"batch_size": BATCH, "shuffle": True, "seed": 3, "transform": "aug", "timeout": 60, "relay": False, **kw}
    with batchd.RemoteDataLoader(address, "fmnist-test", transport=transport, **kw) as ld:
        return [digest(b) for b in ld], ld.stats()


@pytest.fixture(scope="module")
def inline(server):
    return read(server.address, "inline")[0]


@pytest.mark.parametrize("relay", [False, True], ids=["in-the-trainer", "relay"])
def test_a_connection_refused_before_its_first_byte_is_dialed_again_and_the_loader_stays_on_the_data_plane(
        server, inline, relay, caplog):
    refused, restore = refusing(server, 2)
    try:
        with caplog.at_level(logging.WARNING, logger="batchd.client"):
            got, stats = read(server.address, "socket", relay=relay)
    finally:
        restore()
    assert len(refused) == 2 and got == inline
    assert stats["bytes_received"]["socket"] > 0 and stats["bytes_received"]["inline"] == 0, stats["bytes_received"]
    assert stats["data_plane_fallbacks"] == 0 and stats["reconnects"] == 0, stats
    assert "lost the stream" not in caplog.text  # the call never broke: its connection was dialed again


@pytest.mark.parametrize("relay", [False, True], ids=["in-the-trainer", "relay"])
def test_a_data_port_that_refuses_every_dial_sends_auto_inline_once_and_fails_socket(server, inline, relay, caplog,
                                                                                     monkeypatch):
    from batchd.client.transport import shm

    monkeypatch.setattr(shm.SharedMemorySession, "open", classmethod(
        lambda cls, *a, **k: (_ for _ in ()).throw(shm.SharedMemoryUnavailable("another host (test)"))))
    refused, restore = refusing(server, None)
    try:
        with caplog.at_level(logging.WARNING, logger="batchd.client"):
            got, stats = read(server.address, "auto", relay=relay)
        assert got == inline
        assert stats["data_plane_fallbacks"] == 1 and stats["bytes_received"]["socket"] == 0, stats
        assert caplog.text.count("come inside the gRPC messages from now on") == 1
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING and "shared memory" not in r.message]
        assert len(warnings) == 1, caplog.text  # one warning (beside the test's own "no shared memory")
        assert 2 <= len(refused) <= 4  # (the dials of one call: then inline)
        with pytest.raises(ConnectionError, match=r"the data port \d+ of the batchd server at 127\.0\.0\.1:\d+ closed "
                                                  r"the data connection before its first byte"):
            read(server.address, "socket", relay=relay, reconnect_timeout=1)
    finally:
        restore()
