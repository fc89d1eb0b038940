"""http(s) reads with retries (obstore's HTTPStore): a real HTTP server on 127.0.0.1:0 that answers
503 to the first requests of each path, 404 to missing files, and records every request line."""

from __future__ import annotations

import collections
import contextlib
import http.server
import logging
import threading

import numpy as np
import pytest

import batchd
from batchd.errors import SampleError
from batchd.server.config import ManifestConfig
from batchd.server.data.datasets import open_dataset
from helpers import digest, write_png

N_IMAGES = 9


class _Flaky(http.server.SimpleHTTPRequestHandler):
    """Serves ``directory``; the first ``fail_first`` GETs/HEADs of each path (query ignored) get 503."""

    fail_first = 0
    counts: collections.Counter
    lock: threading.Lock

    def _flaky(self) -> bool:
        path = self.path.split("?", 1)[0]
        with self.lock:
            self.counts[path] += 1
            n = self.counts[path]
        if n <= self.fail_first:
            self.send_error(503, "try later")
            return True
        return False

    def do_GET(self):
        if not self._flaky():
            super().do_GET()

    def do_HEAD(self):
        if not self._flaky():
            super().do_HEAD()

    def log_message(self, *args):  # quiet
        pass


@contextlib.contextmanager
def flaky_server(directory, fail_first: int):
    """(base URL, per-path request counter) of a threaded HTTP server answering 503 ``fail_first`` times per path."""
    handler = type("H", (_Flaky,), {"fail_first": fail_first, "counts": collections.Counter(), "lock": threading.Lock()})
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), lambda *a: handler(*a, directory=str(directory)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", handler.counts
    finally:
        httpd.shutdown()
        httpd.server_close()


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    root = tmp_path_factory.mktemp("web")
    rng = np.random.default_rng(0)
    files = []
    for i in range(N_IMAGES):
        p = root / ("cat" if i % 2 else "dog") / f"{i:02d}.png"
        write_png(p, rng.integers(0, 256, (12, 16, 3), dtype=np.uint8))
        files.append(p)
    return root, files


def _manifest(tmp_path, name, rows):
    table = tmp_path / name
    table.write_text("path,label\n" + "".join(f"{r},{i % 2}\n" for i, r in enumerate(rows)))
    return str(table)


def _loader(server, dataset, **kw):
    return batchd.RemoteDataLoader(server.address, dataset, connect_timeout=10, timeout=60, **kw)


def test_http_rows_survive_503s_and_stream_as_local_files(images, make_server, tmp_path):
    root, files = images
    with flaky_server(root, fail_first=2) as (base, counts):
        opts = {"max_attempts": 4, "timeout_s": 5}
        local = _manifest(tmp_path, "local.csv", [str(p) for p in files])
        web = _manifest(tmp_path, "web.csv", [f"{base}/{p.relative_to(root).as_posix()}" for p in files])
        ds = open_dataset("web", ManifestConfig(kind="manifest", path=web, storage_options=opts), tmp_path, build=True)
        assert bytes(ds.read_bytes(0)) == files[0].read_bytes()  # after two 503s
        assert counts[f"/{files[0].relative_to(root).as_posix()}"] == 3
        server = make_server(datasets={"local": {"kind": "manifest", "path": local},
                                       "web": {"kind": "manifest", "path": web, "storage_options": opts}})
        with _loader(server, "local", batch_size=4) as a, _loader(server, "web", batch_size=4) as b:
            got_a, got_b = list(a), list(b)
        assert [digest(x) for x in got_b] == [digest(x) for x in got_a]
        assert sorted(np.concatenate([x["index"].numpy() for x in got_b]).tolist()) == list(range(N_IMAGES))
        assert all(counts[f"/{p.relative_to(root).as_posix()}"] >= 3 for p in files)  # every path retried


def test_presigned_rows_read_through_fsspec_survive_503s_too(images, make_server, tmp_path, caplog):
    """URLs with a query string (presigned) or user info stay on fsspec's HTTP filesystem, which has
    no retries of its own: batchd retries them (tenacity, server/data/storage/_fsspec_retry.py)."""
    root, files = images
    with flaky_server(root, fail_first=2) as (base, counts):
        opts = {"max_attempts": 4, "timeout_s": 5}
        rows = [f"{base}/{p.relative_to(root).as_posix()}?X-Amz-Signature=s1gnatur3&X-Amz-Expires=600" for p in files]
        rows[1] = rows[1].split("?")[0].replace("http://", "http://reader:pa55word@")
        web = _manifest(tmp_path, "presigned.csv", rows)
        local = _manifest(tmp_path, "local-presigned.csv", [str(p) for p in files])
        ds = open_dataset("pre", ManifestConfig(kind="manifest", path=web, storage_options=opts), tmp_path, build=True)
        assert ds.storage._obstore(rows[0]) is None and ds.storage._obstore(rows[1]) is None  # fsspec's path
        assert bytes(ds.read_bytes(0)) == files[0].read_bytes()  # after two 503s
        assert counts[f"/{files[0].relative_to(root).as_posix()}"] == 3
        caplog.set_level(logging.DEBUG, logger="batchd")  # (fsspec.http logs URLs at DEBUG: batchd serve keeps it at INFO)
        server = make_server(datasets={"local": {"kind": "manifest", "path": local},
                                       "pre": {"kind": "manifest", "path": web, "storage_options": opts}})
        with _loader(server, "local", batch_size=4) as a, _loader(server, "pre", batch_size=4) as b:
            got_a, got_b = list(a), list(b)
        assert [digest(x) for x in got_b] == [digest(x) for x in got_a]
        assert all(counts[f"/{p.relative_to(root).as_posix()}"] >= 3 for p in files)  # every path retried
    with flaky_server(root, fail_first=2) as (base, counts):  # one attempt: the 503 is the answer
        url = f"{base}/{files[0].relative_to(root).as_posix()}?token=tok3nvalue"
        one = _manifest(tmp_path, "presigned1.csv", [url])
        ds = open_dataset("pre1", ManifestConfig(kind="manifest", path=one, storage_options={"max_attempts": 1}),
                          tmp_path, build=True)
        with pytest.raises(SampleError) as e:
            ds.read_bytes(0)
        assert "503" in e.value.reason and counts[f"/{files[0].relative_to(root).as_posix()}"] == 1
    text = caplog.text + str(e.value)
    assert "s1gnatur3" not in text and "pa55word" not in text and "tok3nvalue" not in text


def test_http_rows_fail_after_the_retries_naming_dataset_index_and_url(images, make_server, tmp_path, caplog):
    root, files = images
    with flaky_server(root, fail_first=2) as (base, counts):
        opts = {"max_attempts": 2, "timeout_s": 5}  # 2 attempts, 2 x 503: every read fails
        url = f"{base}/{files[0].relative_to(root).as_posix()}"
        web = _manifest(tmp_path, "web.csv", [url, f"{base}/dog/absent.png"])
        ds = open_dataset("web", ManifestConfig(kind="manifest", path=web, storage_options=opts), tmp_path, build=True)
        with pytest.raises(SampleError) as e:
            ds.read_bytes(0)
        assert e.value.dataset == "web" and e.value.index == 0 and url in str(e.value)
        assert "503" in e.value.reason and counts[url[len(base):]] == 2
    with flaky_server(root, fail_first=0) as (base, _):
        web = _manifest(tmp_path, "web404.csv", [f"{base}/dog/absent.png"])
        ds = open_dataset("web404", ManifestConfig(kind="manifest", path=web, storage_options=opts), tmp_path, build=True)
        with pytest.raises(SampleError, match=f"no such object: {base}/dog/absent.png"):
            ds.read_bytes(0)
    # through a server, with raise and skip: row 0 is local, rows 1-3 are http and always 503
    with flaky_server(root, fail_first=10) as (base, counts):
        rows = [f"{base}/{p.relative_to(root).as_posix()}" for p in files[:3]]
        secret_rows = [rows[0].replace("http://", "http://user:hunter2pw@"), rows[1] + "?token=tok3nvalue"]
        caplog.set_level(logging.DEBUG)
        web = _manifest(tmp_path, "web2.csv", [str(files[0])] + secret_rows + [rows[2]])
        server = make_server(datasets={
            "raise": {"kind": "manifest", "path": web, "storage_options": opts},
            "skip": {"kind": "manifest", "path": web, "storage_options": opts, "on_error": "skip", "max_skipped_fraction": 1.0},
        })
        with pytest.raises(batchd.SampleError) as e:
            with _loader(server, "raise", batch_size=4) as ld:
                list(ld)
        assert e.value.dataset == "raise" and e.value.index in (1, 2, 3)
        with _loader(server, "skip", batch_size=4) as ld:
            batches = list(ld)
        served = np.concatenate([b["index"].numpy() for b in batches]).tolist()
        skipped = sorted(i for b in batches if "skipped" in b for i in b["skipped"].tolist())
        assert served == [0] and skipped == [1, 2, 3]
        text = caplog.text + str(e.value)
        assert "hunter2pw" not in text and "tok3nvalue" not in text and "user:" not in text


def test_backend_fsspec_keeps_fsspec_for_http(images, tmp_path):
    from batchd.server.data.storage import Storage, StorageOptions

    root, files = images
    with flaky_server(root, fail_first=0) as (base, _):
        url = f"{base}/{files[0].relative_to(root).as_posix()}"
        assert Storage(base, StorageOptions(backend="fsspec"))._obstore(url) is None
        assert Storage(base)._obstore(url) is not None
        assert Storage(base).read(url, 2, 10) == files[0].read_bytes()[2:10]
        assert Storage(base, StorageOptions(backend="fsspec")).read(url) == files[0].read_bytes()


def test_batchd_serve_keeps_fsspec_url_logging_at_info_even_at_debug(monkeypatch):
    """fsspec.http logs fetched URLs (query strings, i.e. presigned signatures) at DEBUG; the
    server's logging setup keeps that logger at INFO whatever --log-level says."""
    from batchd.cli import configure_logging

    root, fsspec_http = logging.getLogger(), logging.getLogger("fsspec.http")
    levels = root.level, fsspec_http.level
    monkeypatch.setattr(root, "handlers", [])  # basicConfig configures only a root without handlers
    try:
        configure_logging("DEBUG")
        assert root.isEnabledFor(logging.DEBUG)
        assert not fsspec_http.isEnabledFor(logging.DEBUG) and fsspec_http.isEnabledFor(logging.INFO)
        configure_logging("WARNING")
        assert not fsspec_http.isEnabledFor(logging.INFO)
    finally:
        root.setLevel(levels[0])  # setLevel also clears the loggers' isEnabledFor caches
        fsspec_http.setLevel(levels[1])
