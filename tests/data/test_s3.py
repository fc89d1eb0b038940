"""Datasets on object storage, against a real S3 server (SeaweedFS, started by tests/seaweed.py).

The same small image folder is kept on local disk and uploaded to a bucket; a batchd server
serves both, and everything a client receives from the bucket must equal what it receives from
the local copy: same order, same bytes, every sample once. Then the failures: a missing object,
a wrong secret (never echoed), and connections cut in the middle of an epoch.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

import batchd
from batchd.client.transport.datasets import describe_dataset
from batchd.errors import SampleError
from batchd.server.config import CocoConfig, ImageFolderConfig, ManifestConfig, SegmentationConfig
from batchd.server.data.datasets import open_dataset
from helpers import assert_raise_names_then_skip_serves_the_rest, digest, write_class_tree
from seaweed import DroppingProxy, seaweed  # noqa: F401  (the session fixture)

pytestmark = pytest.mark.timeout(300)

CLASSES = {"cat": 5, "dog": 4, "emu": 3}


@pytest.fixture(scope="module")
def photos(seaweed, tmp_path_factory):  # noqa: F811
    """(local root, s3 URL of the same folder, s3 URL of a manifest of it with a missing row)."""
    root = tmp_path_factory.mktemp("photos") / "photos"
    write_class_tree(root, CLASSES)
    seaweed.upload_tree(root, "photos")
    rows = ["path,label"] + [f"{p.relative_to(root).as_posix()},{p.parts[-2] if p.parent.name != 'nested' else p.parts[-3]}"
                             for p in sorted(root.rglob("*.png"))]
    rows.append("cat/missing.png,cat")  # the last sample: no such object
    seaweed.put("photos/rows.csv", ("\n".join(rows) + "\n").encode())
    return root, f"s3://{seaweed.bucket}/photos", f"s3://{seaweed.bucket}/photos/rows.csv"


def _loader(server, dataset, **kw):
    return batchd.RemoteDataLoader(server.address, dataset, connect_timeout=10, timeout=60, **kw)


@pytest.mark.parametrize("backend", ["obstore", "fsspec"])
def test_imagefolder_on_a_bucket_lists_and_reads_as_the_local_copy(seaweed, photos, tmp_path, backend):  # noqa: F811
    root, url, _ = photos
    local = open_dataset("local", ImageFolderConfig(kind="imagefolder", root=root), tmp_path, build=True)
    cfg = ImageFolderConfig(kind="imagefolder", root=url, storage_options={**seaweed.storage_options, "backend": backend})
    remote = open_dataset("remote", cfg, tmp_path, build=True)
    assert len(remote) == len(local) == sum(CLASSES.values())
    assert remote.classes == local.classes == sorted(CLASSES)
    assert [remote.source(i) for i in range(len(remote))] == [local.source(i) for i in range(len(local))]
    assert [remote.label(i) for i in range(len(remote))] == [local.label(i) for i in range(len(local))]
    for i in range(len(local)):
        assert bytes(remote.read_bytes(i)) == local.path(i).read_bytes()
        assert np.array_equal(remote.load_image(i), local.load_image(i))
    # a worker maps the index the server built: no second listing
    worker = open_dataset("remote", cfg, tmp_path, build=False)
    assert worker.fingerprint == remote.fingerprint and len(worker) == len(remote)


def test_a_server_streams_the_bucket_exactly_as_the_local_folder(seaweed, photos, make_server):  # noqa: F811
    root, url, _ = photos
    server = make_server(datasets={
        "local": {"kind": "imagefolder", "root": str(root)},
        "s3": {"kind": "imagefolder", "root": url, "storage_options": seaweed.storage_options},
    })
    n = sum(CLASSES.values())
    for kw in (dict(shuffle=False), dict(shuffle=True, seed=7)):
        with _loader(server, "local", batch_size=5, **kw) as a, _loader(server, "s3", batch_size=5, **kw) as b:
            got_a, got_b = list(a), list(b)
        assert [digest(x) for x in got_b] == [digest(x) for x in got_a]
        indices = np.concatenate([x["index"].numpy() for x in got_b])
        assert sorted(indices.tolist()) == list(range(n))  # every sample once


def test_manifest_on_a_bucket_missing_object_names_the_key(seaweed, photos, make_server, tmp_path):  # noqa: F811
    _, _, manifest = photos
    opts = seaweed.storage_options
    ds = open_dataset("rows", ManifestConfig(kind="manifest", path=manifest, storage_options=opts), tmp_path, build=True)
    missing = len(ds) - 1
    assert ds.source(missing) == "cat/missing.png"
    with pytest.raises(SampleError) as e:
        ds.read_bytes(missing)
    assert e.value.dataset == "rows" and e.value.index == missing and e.value.path == "cat/missing.png"
    assert "no such object: s3://batchd-test/photos/cat/missing.png" in e.value.reason
    # through a server: raise names the sample; skip leaves it out and serves the rest once
    server = make_server(datasets={
        "rows": {"kind": "manifest", "path": manifest, "storage_options": opts},
        "rows-skip": {"kind": "manifest", "path": manifest, "storage_options": opts,
                      "on_error": "skip", "max_skipped_fraction": 0.5},
    })
    assert_raise_names_then_skip_serves_the_rest(lambda name: _loader(server, name, batch_size=4), missing,
                                                 "cat/missing.png")


def test_full_urls_in_manifest_rows(seaweed, photos, tmp_path):  # noqa: F811
    root, url, _ = photos
    table = tmp_path / "urls.csv"
    first = sorted(root.rglob("*.png"))[0]
    key = first.relative_to(root).as_posix()
    table.write_text(f"path,label\n{url}/{key},a\n{first},b\n")  # a full URL, then a local absolute path
    cfg = ManifestConfig(kind="manifest", path=table, root=url, storage_options=seaweed.storage_options)
    ds = open_dataset("mixed", cfg, tmp_path, build=True)
    assert bytes(ds.read_bytes(0)) == first.read_bytes()
    assert ds.source(0) == f"{url}/{key}"


def test_wrong_secret_is_a_clear_error_that_never_shows_it(seaweed, photos, make_server, tmp_path, caplog):  # noqa: F811
    root, url, _ = photos
    secret = "wrong-secret-must-not-leak-4242"
    bad = {**seaweed.storage_options, "secret": secret, "max_attempts": 2}
    cfg = ImageFolderConfig(kind="imagefolder", root=url, storage_options=bad)
    assert secret not in repr(cfg) and secret not in str(cfg.model_dump())
    with pytest.raises(Exception) as e:  # listing the bucket fails when the server opens it
        open_dataset("bad", cfg, tmp_path, build=True)
    assert "cannot list s3://batchd-test/photos" in str(e.value) and secret not in str(e.value)
    assert "The request signature we calculated does not match" in str(e.value)
    # a local manifest whose rows are on the bucket: the index builds, every read is refused
    table = tmp_path / "rows.csv"
    table.write_text("path,label\n" + "\n".join(f"{p.relative_to(root).as_posix()},x" for p in sorted(root.rglob("*.png"))))
    caplog.set_level(logging.DEBUG)
    server = make_server(datasets={"bad": {"kind": "manifest", "path": str(table), "root": url, "storage_options": bad}})
    info = describe_dataset(server.address, "bad")
    assert info.num_samples == sum(CLASSES.values())
    with _loader(server, "bad", batch_size=4) as ld:
        with pytest.raises(batchd.SampleError) as e:
            for _ in ld:
                pass
    assert e.value.dataset == "bad" and e.value.index == 0
    assert f"cannot read {url}/" in e.value.reason and secret not in str(e.value)
    assert secret not in caplog.text and secret not in str(info)


def test_an_epoch_survives_cut_connections(seaweed, photos, make_server):  # noqa: F811
    root, url, _ = photos
    proxy = DroppingProxy(int(seaweed.endpoint.rsplit(":", 1)[1]))
    try:
        opts = {**seaweed.storage_options, "endpoint_url": proxy.url, "timeout_s": 5}
        server = make_server(datasets={
            "local": {"kind": "imagefolder", "root": str(root)},
            "s3": {"kind": "imagefolder", "root": url, "storage_options": opts},
        })
        kw = dict(batch_size=2, shuffle=True, seed=3, prefetch=1)
        with _loader(server, "local", **kw) as ld:
            want = [digest(b) for b in ld]
        got, cut = [], 0
        with _loader(server, "s3", **kw) as ld:
            for i, batch in enumerate(ld):
                got.append(digest(batch))
                if i in (1, 3):
                    cut += proxy.drop(pause_s=0.5)
        assert cut > 0  # the workers' pooled connections were reset under them
        assert got == want
    finally:
        proxy.close()


def test_credentials_from_a_file_or_the_environment(seaweed, photos, tmp_path, monkeypatch):  # noqa: F811
    root, url, _ = photos
    creds = tmp_path / "s3-credentials.yaml"
    creds.write_text(f"key: {seaweed.key}\nsecret: {seaweed.secret}\n")
    first = sorted(root.rglob("*.png"))[0]
    for options, env in (({"endpoint_url": seaweed.endpoint, "credentials_file": str(creds)}, {}),
                         ({"endpoint_url": seaweed.endpoint},
                          {"AWS_ACCESS_KEY_ID": seaweed.key, "AWS_SECRET_ACCESS_KEY": seaweed.secret})):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        cache = tmp_path / f"cache-{len(env)}"
        ds = open_dataset("c", ImageFolderConfig(kind="imagefolder", root=url, storage_options=options), cache, build=True)
        assert bytes(ds.read_bytes(0)) == first.read_bytes()
        cfg = ImageFolderConfig(kind="imagefolder", root=url, storage_options=options)
        assert seaweed.secret not in repr(cfg)


def test_http_urls_in_manifest_rows(photos, tmp_path):
    import functools
    import http.server
    import threading

    root, _, _ = photos
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        base = f"http://127.0.0.1:{httpd.server_address[1]}"
        files = sorted(root.rglob("*.png"))[:3]
        table = tmp_path / "http.csv"
        table.write_text("path,label\n" + "".join(f"{p.relative_to(root).as_posix()},a\n" for p in files)
                         + "cat/absent.png,a\n")
        ds = open_dataset("web", ManifestConfig(kind="manifest", path=table, root=base), tmp_path, build=True)
        assert [bytes(ds.read_bytes(i)) for i in range(3)] == [p.read_bytes() for p in files]
        with pytest.raises(SampleError, match=f"no such object: {base}/cat/absent.png"):
            ds.read_bytes(3)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_coco_and_segmentation_on_a_bucket_load_as_the_local_copies(seaweed, fashion_coco, tmp_path):  # noqa: F811
    """Images, masks and the annotation JSON read from S3 (the segmentation folders listed there)."""
    for folder in ("images/val", "masks/val"):
        seaweed.upload_tree(fashion_coco / folder, f"fashion-coco/{folder}")
    seaweed.upload_file(fashion_coco / "annotations/instances_val.json", "fashion-coco/annotations/instances_val.json")
    url, opts = f"s3://{seaweed.bucket}/fashion-coco", seaweed.storage_options
    pairs = [
        (CocoConfig(kind="coco", images=fashion_coco / "images/val", masks=True,
                    annotations=fashion_coco / "annotations/instances_val.json"),
         CocoConfig(kind="coco", images=f"{url}/images/val", masks=True, storage_options=opts,
                    annotations=f"{url}/annotations/instances_val.json")),
        (SegmentationConfig(kind="segmentation", images=fashion_coco / "images/val", masks=fashion_coco / "masks/val"),
         SegmentationConfig(kind="segmentation", images=f"{url}/images/val", masks=f"{url}/masks/val",
                            storage_options=opts)),
    ]
    for local_cfg, remote_cfg in pairs:
        local = open_dataset("local", local_cfg, tmp_path, build=True)
        remote = open_dataset("remote", remote_cfg, tmp_path, build=True)
        assert len(remote) == len(local) == 20
        assert [remote.source(i) for i in range(20)] == [local.source(i) for i in range(20)]
        for i in range(20):
            want = local.load_sample(i)
            got = remote.load_sample(i)
            assert set(got) == set(want)
            for name in want:
                np.testing.assert_array_equal(got[name], want[name], err_msg=f"{remote_cfg.kind} sample {i} {name}")
        worker = open_dataset("remote", remote_cfg, tmp_path, build=False)
        assert worker.fingerprint == remote.fingerprint and len(worker) == 20
