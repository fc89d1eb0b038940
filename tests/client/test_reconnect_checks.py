"""A reconnect checks what it reconnected to (issue 18 §2): a server restarted mid-epoch over other
files, under the same dataset name, must not feed the rest of the epoch silently.

Servers are ``batchd serve`` subprocesses over a small folder of tiny PNGs, SIGKILLed mid-epoch and
started again on the same port after the folder changed. The transform is slow on purpose (a few
ms a sample) so that most of the epoch is still unbuilt when the server dies: the stream really
breaks and the loader really reconnects.
"""

from __future__ import annotations

import concurrent.futures
import logging
import pathlib
import shutil
import signal

import albumentations as A
import numpy as np
import pytest
import yaml

import batchd
from batchd.client.transport.datasets import describe_dataset
from helpers import digest, free_port, wait_until, write_png

pytestmark = pytest.mark.timeout(120)

N = 40  # images; batch_size 4: 10 batches
SLOWISH = A.Compose([A.Resize(192, 192), A.MedianBlur(blur_limit=(9, 9), p=1.0), A.Resize(8, 8)])  # ~4 ms a sample
KW = dict(batch_size=4, shuffle=True, seed=3, transform=SLOWISH, prefetch=1, transport="inline", timeout=30,
          connect_timeout=10, reconnect_timeout=10)  # a limit: a restart takes 2-3 s


def photos(root: pathlib.Path, count: int, seed: int, prefix: str = "") -> None:
    """``count`` random 8x8 PNGs, half in root/a, half in root/b."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        write_png(root / "ab"[i % 2] / f"{prefix}{i:03d}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))


def replace(root: pathlib.Path, seed: int) -> None:
    """The folder's images replaced by as many other ones (same names, other pixels and mtimes)."""
    shutil.rmtree(root)
    photos(root, N, seed)


def start(server_procs, tmp_path: pathlib.Path, *roots: pathlib.Path):
    """A ``batchd serve`` subprocess of 1 worker per root, serving it as dataset "photos" (started
    in parallel)."""
    procs = []
    for root in roots:
        cfg = tmp_path / f"{root.name}.yaml"
        cfg.write_text(yaml.safe_dump({"workers": 1, "cache_dir": str(tmp_path / f"cache-{root.name}"),
                                       "datasets": {"photos": {"kind": "imagefolder", "root": str(root)}}}))
        procs.append(server_procs(cfg, f"127.0.0.1:{free_port()}"))
    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        list(pool.map(lambda p: p.start(), procs))
    return procs[0] if len(procs) == 1 else procs


def epoch(address, **kw) -> list[str]:
    with batchd.RemoteDataLoader(address, "photos", **{**KW, **kw}) as ld:
        return [digest(b) for b in ld]


def restart_over(server, server_procs, tmp_path, root, change) -> None:
    """SIGKILL ``server``, ``change(root)``, start it again on the same address."""
    server.signal(signal.SIGKILL)
    server.wait(10)
    change(root)
    server.start()


def read_until_error(it, got: list[str], indices: list[np.ndarray]) -> None:
    for b in it:
        got.append(digest(b))
        indices.append(b["index"].numpy().copy())


@pytest.mark.parametrize("transport", ["inline", "socket"])
def test_one_server_restarted_over_other_images_strict_raises_before_any_new_batch(server_procs, tmp_path, caplog,
                                                                                   transport):
    root = tmp_path / "photos"
    photos(root, N, seed=0)
    server = start(server_procs, tmp_path, root)
    old = epoch(server.address)
    assert len(old) == 10
    before = describe_dataset(server.address, "photos").fingerprint
    got, indices = [], []
    caplog.set_level(logging.INFO, logger="batchd.client.loader.loader")
    with batchd.RemoteDataLoader(server.address, "photos", **{**KW, "transport": transport}) as ld:
        it = iter(ld)
        read_until_error([next(it) for _ in range(3)], got, indices)
        restart_over(server, server_procs, tmp_path, root, lambda r: replace(r, seed=1))
        with pytest.raises(batchd.DatasetChangedError) as e:
            read_until_error(it, got, indices)
        assert ld.info.fingerprint == before  # nothing of the new data was taken in
    now = describe_dataset(server.address, "photos").fingerprint
    assert now != before
    assert "lost the stream" in caplog.text and "resumed the stream" not in caplog.text
    assert 3 <= len(got) < 10, "the stream did not break mid-epoch"
    assert got == old[:len(got)], "a batch of the new images was yielded before the error"
    err = e.value
    assert isinstance(err, ValueError) and err.num_samples is None
    assert (err.dataset, err.address) == ("photos", server.address)
    for part in ("photos", server.address, f"dataset fingerprint {before} vs {now}", "strict=False"):
        assert part in str(err), f"{part!r} not in {str(err)!r}"


def test_one_server_restarted_over_other_images_not_strict_warns_and_reports_them(server_procs, tmp_path, caplog):
    root = tmp_path / "photos"
    photos(root, N, seed=0)
    server = start(server_procs, tmp_path, root)
    old = epoch(server.address)
    before = describe_dataset(server.address, "photos").fingerprint
    got, indices = [], []
    caplog.set_level(logging.INFO, logger="batchd.client.loader.loader")
    with batchd.RemoteDataLoader(server.address, "photos", strict=False, **KW) as ld:
        it = iter(ld)
        read_until_error([next(it) for _ in range(3)], got, indices)
        restart_over(server, server_procs, tmp_path, root, lambda r: replace(r, seed=1))
        read_until_error(it, got, indices)
        info, state = ld.info, ld.state_dict()
    new = epoch(server.address)
    now = describe_dataset(server.address, "photos").fingerprint
    assert info.fingerprint == now != before and state["fingerprint"] == now
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "changed" in r.getMessage()]
    assert len(warned) == 1 and f"dataset fingerprint {before} vs {now}" in warned[0], warned
    assert "photos" in warned[0] and server.address in warned[0]
    # the old images up to the reconnect, the new ones from there on (each batch as a fresh loader's)
    k = next(i for i in range(len(got)) if got[i] != old[i])
    assert 3 <= k < 10 and got == old[:k] + new[k:]


def test_images_added_while_the_server_is_down_always_raise_naming_the_counts(server_procs, tmp_path):
    root = tmp_path / "photos"
    photos(root, N, seed=0)
    server = start(server_procs, tmp_path, root)
    old = epoch(server.address)
    got, indices = [], []
    with batchd.RemoteDataLoader(server.address, "photos", strict=False, **KW) as ld:  # even without strict
        total = len(ld)
        it = iter(ld)
        read_until_error([next(it) for _ in range(3)], got, indices)
        restart_over(server, server_procs, tmp_path, root, lambda r: photos(r, 5, seed=2, prefix="new"))
        with pytest.raises(batchd.DatasetChangedError) as e:
            read_until_error(it, got, indices)
        assert ld.info.num_samples == N
    assert describe_dataset(server.address, "photos").num_samples == N + 5
    err = e.value
    assert err.num_samples == (N, N + 5)
    for part in ("photos", server.address, f"{N} samples before, {N + 5} now", "len(loader)"):
        assert part in str(err), f"{part!r} not in {str(err)!r}"
    assert 3 <= len(got) <= total == 10
    seen = np.concatenate(indices)
    assert len(np.unique(seen)) == len(seen) == 4 * len(got), "a sample was repeated"
    assert got == old[:len(got)], "a batch of the grown folder was yielded"


def test_several_servers_leave_out_one_restarted_over_other_images(server_procs, tmp_path, caplog):
    """As the prober leaves out a server whose dataset differs (``_probe``), a reconnect does: the
    others take its batches and the epoch is the one the old images give, each sample once."""
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    photos(root_a, N, seed=0)
    shutil.copytree(root_a, root_b, copy_function=shutil.copy2)  # mtimes kept: the same fingerprint
    a, b = start(server_procs, tmp_path, root_a, root_b)
    old = epoch(a.address)
    caplog.set_level(logging.INFO, logger="batchd.client")
    got, indices = [], []
    # probe_interval: b is tried again at once (its channel comes back ready within a second) or a
    # second later (a fresh connection); its batches go to a while it is away
    with batchd.RemoteDataLoader([a.address, b.address], "photos", probe_interval=1, hedge=False, **KW) as ld:
        it = iter(ld)
        read_until_error([next(it) for _ in range(4)], got, indices)
        restart_over(b, server_procs, tmp_path, root_b, lambda r: replace(r, seed=1))
        read_until_error(it, got, indices)
        assert wait_until(lambda: "dataset fingerprint" in ld.server_stats()[1]["error"], 20), ld.server_stats()
        again = [digest(x) for x in ld]  # the next epoch: a alone
        stats = ld.server_stats()
    assert got == old, "the epoch across the restart is not the old images' epoch"
    seen = np.concatenate(indices)
    assert sorted(seen.tolist()) == list(range(N)), "a sample is missing or repeated"
    assert len(again) == len(old) and [s["up"] for s in stats] == [True, False], stats
    assert b.address in stats[1]["error"] and "resumed the call" not in caplog.text
    assert f"batchd server {b.address} is left out" in caplog.text


# --- a restart between epochs: no stream breaks, gRPC reconnects the channel silently ---------------


def test_a_restart_between_epochs_over_other_images_is_caught_before_the_next_epoch(server_procs, tmp_path):
    root = tmp_path / "photos"
    photos(root, N, seed=0)
    server = start(server_procs, tmp_path, root)
    with batchd.RemoteDataLoader(server.address, "photos", **KW) as ld:
        before = ld.info.fingerprint
        assert len([digest(b) for b in ld]) == 10  # epoch 0, whole
        restart_over(server, server_procs, tmp_path, root, lambda r: replace(r, seed=1))
        with pytest.raises(batchd.DatasetChangedError, match="dataset fingerprint"):
            next(iter(ld))  # epoch 1
        assert ld.info.fingerprint == before


def test_several_servers_leave_out_one_restarted_between_epochs(server_procs, tmp_path, caplog):
    root_a, root_b = tmp_path / "a", tmp_path / "b"
    photos(root_a, N, seed=0)
    shutil.copytree(root_a, root_b, copy_function=shutil.copy2)  # mtimes kept: the same fingerprint
    a, b = start(server_procs, tmp_path, root_a, root_b)
    with batchd.RemoteDataLoader([a.address, b.address], "photos", probe_interval=60, hedge=False, **KW) as ld:
        assert len(list(ld)) == 10  # epoch 0
        restart_over(b, server_procs, tmp_path, root_b, lambda r: replace(r, seed=1))
        got = [digest(x) for x in ld]  # epoch 1: a alone
        # (b is tried again with a fresh connection, at growing intervals, and found changed)
        assert wait_until(lambda: "dataset fingerprint" in ld.server_stats()[1]["error"], 20), ld.server_stats()
        stats = ld.server_stats()
    with batchd.RemoteDataLoader(a.address, "photos", **KW) as one:
        one.set_epoch(1)
        reference = [digest(x) for x in one]
    assert got == reference, "epoch 1 mixed in batches of the restarted server's other images"
    assert [s["up"] for s in stats] == [True, False], stats
    assert "changed since the loader last read it (a restart): dataset fingerprint" in stats[1]["error"], stats
