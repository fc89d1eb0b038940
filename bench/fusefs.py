"""A read-only FUSE pass-through that adds latency to every ``open``: slow storage, simulated.

    python bench/fusefs.py SOURCE MOUNTPOINT --latency-file FILE     # foreground; Ctrl-C unmounts

Every file and folder of SOURCE appears under MOUNTPOINT, read-only. Each ``open`` of a file
sleeps the latency first (what NFS, Lustre metadata or an object store's first byte cost per
object); reads are ``pread`` on the real file. The latency, in milliseconds, is the number in
FILE, re-read at most every 0.1 s, so a benchmark changes it without remounting (a missing or
empty FILE means 0). libfuse serves up to ``--threads`` requests at once (default 256; libfuse's
own default of 10 would cap a filesystem that sleeps at 10 opens per latency).

``Mount`` runs it as a subprocess for a benchmark (needs ``/dev/fuse``, Debian's ``fuse3`` for
``fusermount3``, and ``mfusepy`` from PyPI: the bench extra).
"""

from __future__ import annotations

import argparse
import errno
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import time

_REFRESH_S = 0.1


class LatencyPassthrough:
    """mfusepy operations: SOURCE read-only, ``open`` delayed by the latency in ``latency_file`` (ms)."""

    use_ns = True

    def __init__(self, source: str, latency_file: str):
        self.source = os.path.realpath(source)
        self.latency_file = latency_file
        self._latency_s = 0.0
        self._checked = 0.0
        self._lock = threading.Lock()

    def _real(self, path: str) -> str:
        return os.path.join(self.source, path.lstrip("/"))

    def latency_s(self) -> float:
        now = time.monotonic()
        if now - self._checked >= _REFRESH_S:
            with self._lock:
                try:
                    text = pathlib.Path(self.latency_file).read_text().strip()
                    self._latency_s = float(text) / 1000.0 if text else 0.0
                except (OSError, ValueError):
                    self._latency_s = 0.0
                self._checked = now
        return self._latency_s

    def getattr(self, path: str, fh=None) -> dict:
        try:
            st = os.lstat(self._real(path))
        except OSError as e:
            raise _fuse_error(e.errno) from None
        keys = ("st_mode", "st_nlink", "st_size", "st_uid", "st_gid", "st_atime_ns", "st_mtime_ns", "st_ctime_ns")
        out = {k.replace("_ns", ""): getattr(st, k) for k in keys}
        out["st_mode"] &= ~0o222  # read-only
        return out

    def readdir(self, path: str, fh) -> list[str]:
        try:
            return [".", "..", *os.listdir(self._real(path))]
        except OSError as e:
            raise _fuse_error(e.errno) from None

    def open(self, path: str, flags: int) -> int:
        if flags & (os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_TRUNC):
            raise _fuse_error(errno.EROFS)
        delay = self.latency_s()
        if delay > 0:
            time.sleep(delay)
        try:
            return os.open(self._real(path), os.O_RDONLY)
        except OSError as e:
            raise _fuse_error(e.errno) from None

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def statfs(self, path: str) -> dict:
        st = os.statvfs(self.source)
        return {k: getattr(st, k) for k in ("f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files",
                                            "f_ffree", "f_favail", "f_flag", "f_namemax")}


def _fuse_error(code: int | None):
    import mfusepy

    return mfusepy.FuseOSError(code or errno.EIO)


class Mount:
    """``source`` mounted read-only at a fresh folder (``.path``) through this module, in a
    subprocess, with ``latency_ms`` added to every open (``set_latency`` changes it live).

    Raises RuntimeError if the mount does not appear within ``timeout`` seconds (no /dev/fuse,
    no fusermount3, mfusepy missing: the daemon's output says which).
    """

    def __init__(self, source: str | os.PathLike, latency_ms: float = 0.0, *, threads: int = 256,
                 timeout: float = 30.0):
        self._tmp = tempfile.mkdtemp(prefix="batchd-fuse-")
        self.path = os.path.join(self._tmp, "mnt")
        self.latency_file = os.path.join(self._tmp, "latency_ms")
        os.mkdir(self.path)
        self.set_latency(latency_ms)
        self._log = open(os.path.join(self._tmp, "log"), "w+")
        self.proc = subprocess.Popen(
            [sys.executable, __file__, os.fspath(source), self.path, "--latency-file", self.latency_file,
             "--threads", str(threads)],
            stdout=self._log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while not os.path.ismount(self.path):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                self._log.seek(0)
                raise RuntimeError(f"the FUSE pass-through did not mount {self.path}: {self._log.read()[-2000:]}")
            time.sleep(0.05)

    def set_latency(self, latency_ms: float) -> None:
        """Every open from now on (within 0.1 s) sleeps ``latency_ms`` milliseconds first."""
        tmp = self.latency_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{float(latency_ms)}\n")
        os.replace(tmp, self.latency_file)
        time.sleep(2 * _REFRESH_S)

    def close(self) -> None:
        """Unmount (lazily if busy), stop the daemon, remove the folders."""
        if os.path.ismount(self.path):
            subprocess.run(["fusermount3", "-u", "-z", self.path], capture_output=True)
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._log.close()
        shutil.rmtree(self._tmp, ignore_errors=True)

    def __enter__(self) -> "Mount":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("source")
    p.add_argument("mountpoint")
    p.add_argument("--latency-file", required=True, help="a file holding the latency per open, in ms")
    p.add_argument("--threads", type=int, default=256, help="libfuse's max_threads: requests served at once")
    args = p.parse_args(argv)
    import mfusepy

    ops = LatencyPassthrough(args.source, args.latency_file)
    mfusepy.FUSE(ops, args.mountpoint, foreground=True, ro=True, max_threads=args.threads,
                 fsname="batchd-latency")


if __name__ == "__main__":
    main()
