"""Dataset and build fingerprints (issue 10.5): DescribeDataset reports them; resume and several
servers refuse batches that cannot be the same bytes unless ``strict=False``. Real servers on
127.0.0.1:0 over real files."""

from __future__ import annotations

import os
import re
import shutil

import albumentations
import cv2
import numpy as np
import pytest

import batchd
from batchd.client.transport.datasets import describe_dataset, list_datasets
from helpers import digest, free_port, wait_until, write_png

pytestmark = pytest.mark.timeout(120)

HEX32 = re.compile(r"^[0-9a-f]{32}$")
KW = dict(batch_size=2, transport="inline", connect_timeout=10, timeout=60)


def photos(root, n_per_class=3, seed=0):
    """Two classes of 8x8 PNGs (one nested), n_per_class each; returns root."""
    rng = np.random.default_rng(seed)
    for cls in ("ant", "bee"):
        for i in range(n_per_class):
            sub = "deep/" if i == n_per_class - 1 else ""
            write_png(root / cls / f"{sub}{i}.png", rng.integers(0, 256, (8, 8, 3), dtype=np.uint8))
    return root


def folder_server(make_server, root, **dataset):
    return make_server(workers=1, datasets={"pics": {"kind": "imagefolder", "root": str(root), **dataset}})


def test_describe_dataset_reports_fingerprints_that_follow_the_files(make_server, tmp_path):
    root = photos(tmp_path / "pics")
    server = folder_server(make_server, root)
    info = describe_dataset(server.address, "pics")
    assert HEX32.match(info.fingerprint) and HEX32.match(info.build_fingerprint)
    assert info.build["opencv"] == cv2.__version__ and info.build["albumentations"] == albumentations.__version__
    assert info.build["numpy"] == np.__version__ and info.build["batchd"] and info.build["reduced_decode"] == "on"
    assert info.build["cv2_threads"] == "1"
    [listed] = list_datasets(server.address)
    assert (listed.fingerprint, listed.build_fingerprint, listed.build) == (info.fingerprint, info.build_fingerprint,
                                                                             info.build)
    server.stop(grace=0)

    again = describe_dataset(folder_server(make_server, root).address, "pics")
    assert (again.fingerprint, again.build_fingerprint) == (info.fingerprint, info.build_fingerprint)  # stable

    f = root / "ant" / "0.png"
    st = f.stat()
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))  # touched: same bytes, newer mtime
    touched = describe_dataset(folder_server(make_server, root).address, "pics")
    assert touched.fingerprint != info.fingerprint and touched.build_fingerprint == info.build_fingerprint

    f.write_bytes(f.read_bytes() + b"\0")  # changed content (and size)
    changed = describe_dataset(folder_server(make_server, root).address, "pics")
    assert changed.fingerprint not in (info.fingerprint, touched.fingerprint)

    off = describe_dataset(folder_server(make_server, root, reduced_decode=False).address, "pics")
    assert off.fingerprint == changed.fingerprint
    assert off.build["reduced_decode"] == "off" and off.build_fingerprint != info.build_fingerprint


def test_the_build_says_whether_a_cache_serves_and_under_which_prefix_rule(make_server, tmp_path, monkeypatch):
    """Parts ``cache`` (on/off) and ``cache_prefix_rules``; the disk cache is stamped with them.
    They do not change a byte, so they are not in the build fingerprint clients compare: a loader
    under ``strict`` reads a cached server beside an uncached one (issue 36: it refused them)."""
    from batchd.client.transport.datasets import mismatches
    from batchd.server.compute.build import build_fingerprint, build_parts
    from batchd.server.compute import prefix

    root = photos(tmp_path / "pics")
    plain = describe_dataset(folder_server(make_server, root).address, "pics")
    assert plain.build["cache"] == "off" and "cache_prefix_rules" not in plain.build
    cached_server = make_server(workers=1, datasets={"pics": {"kind": "imagefolder", "root": str(root)}},
                                cache={"memory_bytes": "1MiB", "disk_dir": str(tmp_path / "disk"), "disk_bytes": "1MiB"})
    cached = describe_dataset(cached_server.address, "pics")
    assert cached.build["cache"] == "on" and cached.build["cache_prefix_rules"] == prefix.PREFIX_RULES == "3"
    assert cached.fingerprint == plain.fingerprint and cached.build_fingerprint == plain.build_fingerprint
    assert mismatches(plain.identity(), cached.identity()) == []
    stamp = (tmp_path / "disk" / "BUILD").read_text().strip()
    assert stamp == build_fingerprint(build_parts(cache=True))  # disk entries of another rule are wiped at start
    monkeypatch.setattr(prefix, "PREFIX_RULES", "4")
    assert build_fingerprint(build_parts(cache=True)) != stamp


def test_manifest_and_fashion_mnist_fingerprints_hash_content(make_server, tmp_path, fmnist_root):
    photos(tmp_path / "m")
    table = tmp_path / "m" / "list.csv"
    table.write_text("path,label\nant/0.png,0\nbee/1.png,1\n")
    datasets = {"m": {"kind": "manifest", "path": str(table)},
                "fm": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}
    first = make_server(workers=1, cache_dir=tmp_path / "c1", datasets=datasets)
    m1, fm1 = describe_dataset(first.address, "m"), describe_dataset(first.address, "fm")
    assert HEX32.match(m1.fingerprint) and HEX32.match(fm1.fingerprint)
    first.stop(grace=0)

    # a moved copy with a new mtime and a fresh cache: the same content, the same fingerprints
    copy = tmp_path / "copy"
    shutil.copytree(tmp_path / "m", copy, copy_function=shutil.copyfile)
    datasets["m"]["path"] = str(copy / "list.csv")
    second = make_server(workers=1, cache_dir=tmp_path / "c2", datasets=datasets)
    assert describe_dataset(second.address, "m").fingerprint == m1.fingerprint
    assert describe_dataset(second.address, "fm").fingerprint == fm1.fingerprint
    second.stop(grace=0)

    (copy / "list.csv").write_text("path,label\nant/0.png,0\nbee/2.png,1\n")  # same size, other rows
    third = make_server(workers=1, cache_dir=tmp_path / "c2", datasets=datasets)
    assert describe_dataset(third.address, "m").fingerprint != m1.fingerprint


def test_resume_into_a_changed_dataset_is_refused_unless_not_strict(make_server, tmp_path):
    root = photos(tmp_path / "pics")
    server = folder_server(make_server, root)
    with batchd.RemoteDataLoader(server.address, "pics", **KW) as ld:
        it = iter(ld)
        next(it)
        state = ld.state_dict()
        rest = [digest(b) for b in it]
    assert state["fingerprint"] == ld.info.fingerprint and state["build"] == dict(ld.info.build)
    server.stop(grace=0)

    same = folder_server(make_server, root)  # restarted, nothing changed: resumes
    with batchd.RemoteDataLoader(same.address, "pics", **KW) as ld:
        ld.load_state_dict(state)
        assert [digest(b) for b in ld] == rest
    same.stop(grace=0)

    f = root / "bee" / "1.png"
    os.utime(f, ns=(f.stat().st_atime_ns, f.stat().st_mtime_ns + 1_000_000))
    changed = folder_server(make_server, root)
    with batchd.RemoteDataLoader(changed.address, "pics", **KW) as ld:
        with pytest.raises(ValueError, match=f"dataset fingerprint {state['fingerprint']} vs {ld.info.fingerprint}") as e:
            ld.load_state_dict(state)
        assert "strict=False" in str(e.value)
        ld.load_state_dict(state, strict=False)
        assert [digest(b) for b in ld] == rest  # same pixels here: only the mtime moved
    with batchd.RemoteDataLoader(changed.address, "pics", strict=False, **KW) as ld:
        ld.load_state_dict(state)  # the loader's own strict=False
        with pytest.raises(ValueError, match="dataset fingerprint"):
            ld.load_state_dict(state, strict=True)

    off = folder_server(make_server, root, reduced_decode=False)
    with batchd.RemoteDataLoader(off.address, "pics", **KW) as ld:
        with pytest.raises(ValueError, match="reduced_decode on vs off"):
            ld.load_state_dict({**state, "fingerprint": ld.info.fingerprint})


def test_several_servers_with_different_datasets_are_refused_unless_not_strict(make_server, tmp_path):
    a = photos(tmp_path / "a", seed=1)
    b = photos(tmp_path / "b", seed=2)
    twin = tmp_path / "twin"
    shutil.copytree(a, twin)  # copy2: same bytes and mtimes
    (b / "ant" / "0.png").write_bytes((b / "ant" / "0.png").read_bytes() + b"\0" * 7)
    sa, sb, st = (folder_server(make_server, r) for r in (a, b, twin))

    with batchd.RemoteDataLoader([sa.address, st.address], "pics", **KW) as ld:  # same files elsewhere
        assert len(list(ld)) == 3

    with pytest.raises(ValueError) as e:
        batchd.RemoteDataLoader([sa.address, sb.address], "pics", **KW)
    msg = str(e.value)
    assert sa.address in msg and sb.address in msg and "dataset fingerprint" in msg, msg
    with batchd.RemoteDataLoader([sa.address, sb.address], "pics", strict=False, **KW) as ld:
        assert len(list(ld)) == 3

    off = folder_server(make_server, a, reduced_decode=False)
    with pytest.raises(ValueError, match=r"reduced_decode on vs off") as e:
        batchd.RemoteDataLoader([sa.address, off.address], "pics", **KW)
    assert off.address in str(e.value) and "dataset fingerprint" not in str(e.value)


def test_a_cached_and_an_uncached_server_feed_one_strict_loader_with_the_same_bytes(make_server, tmp_path):
    """The cache never changes a byte, so ``strict`` takes a cached server beside an uncached one
    (issue 36: it refused them, naming ``cache off vs on``); each batch is the one either gives."""
    a = photos(tmp_path / "a", seed=1)
    plain = folder_server(make_server, a)
    cached = make_server(workers=1, datasets={"pics": {"kind": "imagefolder", "root": str(a)}},
                         cache={"memory_bytes": "4MiB"})
    import albumentations as A

    kw = {**KW, "transform": A.Compose([A.Resize(6, 6)])}  # (a cacheable prefix)
    with batchd.RemoteDataLoader(plain.address, "pics", **kw) as ld:
        alone = [b["image"].clone() for b in ld]
    with batchd.RemoteDataLoader([plain.address, cached.address], "pics", strict=True, **kw) as ld:
        for epoch in range(2):  # (the second: cache hits)
            ld.set_epoch(0)
            got = [b["image"].clone() for b in ld]
            assert len(got) == len(alone) and all((x == y).all() for x, y in zip(got, alone))


def test_a_server_that_comes_back_with_another_dataset_is_left_out(make_server, tmp_path):
    a = photos(tmp_path / "a", seed=1)
    twin, other = tmp_path / "twin", photos(tmp_path / "other", seed=3)
    shutil.copytree(a, twin)
    sa = folder_server(make_server, a)
    port = free_port()
    sb = make_server(workers=1, address=f"127.0.0.1:{port}",
                     datasets={"pics": {"kind": "imagefolder", "root": str(twin)}})
    with batchd.RemoteDataLoader([sa.address, sb.address], "pics", reconnect_timeout=5,
                                 probe_interval=0.2, **KW) as ld:
        sb.stop(grace=0)
        assert len(list(ld)) == 3  # sb's batches went to sa
        make_server(workers=1, address=f"127.0.0.1:{port}",
                    datasets={"pics": {"kind": "imagefolder", "root": str(other)}})
        assert wait_until(lambda: "dataset fingerprint" in ld.server_stats()[1]["error"], 10.0), ld.server_stats()
        assert not ld.server_stats()[1]["up"]
        assert len(list(ld)) == 3
