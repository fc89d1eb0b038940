"""A ``batchd serve`` subprocess on 127.0.0.1:0 (or a unix socket) with a generated YAML config.

    with ServerProcess(datasets={...}, pipelines={...}, workers=2, cache_dir=...) as srv:
        RemoteDataLoader(srv.address, "photos", ...)

The server logs ``listening on ADDRESS (...)`` when ready; we parse the bound address from it,
and the worker pids from ``N workers ready (pids [...])``.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque

import yaml

_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)
_LISTENING = re.compile(r"listening on (\S+)")
_WORKERS = re.compile(r"workers ready \(pids \[([\d, ]*)\]\)")


def private_shm_available() -> bool:
    """Whether ``ServerProcess(private_shm=True)`` can run here (``unshare -m`` and a tmpfs mount)."""
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def child_env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no version check over the network
    return env


class ServerProcess:
    def __init__(self, *, datasets: dict, pipelines: dict | None = None, workers: int | dict, cache_dir,
                 address: str = "127.0.0.1:0", extra: dict | None = None, start_timeout: float = 180.0,
                 private_shm: bool = False):
        """private_shm: run the server with a /dev/shm of its own (a mount namespace, ``unshare -m``;
        needs root): a client on this host cannot read its shared memory and gets its batches
        over TCP, as from another host (``private_shm_available``)."""
        self.private_shm = private_shm
        self.config = {
            "address": address,
            "workers": workers,
            "cache_dir": str(cache_dir),
            "datasets": datasets,
            "pipelines": pipelines or {},
            **(extra or {}),
        }
        self.workers = workers
        self.start_timeout = start_timeout
        self.address: str | None = None
        self.worker_pids: list[int] = []
        self.log: deque[str] = deque(maxlen=400)
        self.proc: subprocess.Popen | None = None
        self.startup_s: float | None = None
        self._ready = threading.Event()
        self._tmp = tempfile.TemporaryDirectory(prefix="batchd-bench-")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def start(self) -> "ServerProcess":
        cfg = os.path.join(self._tmp.name, "server.yaml")
        with open(cfg, "w") as f:
            yaml.safe_dump(self.config, f, sort_keys=False)
        serve = [sys.executable, "-m", "batchd.cli", "serve", "--config", cfg, "--address", self.config["address"]]
        if isinstance(self.workers, int):  # a range ({min, max}) stays in the config
            serve += ["--workers", str(self.workers)]
        # the server gets SIGTERM if this process dies (even by SIGKILL): no orphaned servers
        cmd = [sys.executable, "-c", _DIE_WITH_PARENT, *serve]
        if self.private_shm:
            cmd = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", *cmd]
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     env=child_env())
        threading.Thread(target=self._read_log, name="bench-server-log", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                what = f"exited with {self.proc.returncode}" if self.proc.poll() is not None else "did not start in time"
                self.stop()
                raise RuntimeError(f"batchd server {what}; its log:\n" + "\n".join(self.log))
        self.startup_s = time.perf_counter() - t0
        return self

    def _read_log(self) -> None:
        for line in self.proc.stderr:
            line = line.rstrip("\n")
            self.log.append(line)
            m = _WORKERS.search(line)
            if m:
                self.worker_pids = [int(p) for p in m.group(1).replace(" ", "").split(",") if p]
            m = _LISTENING.search(line)
            if m and not self._ready.is_set():
                self.address = m.group(1)
                self._ready.set()

    def descendants(self) -> list[int]:
        """Every live process under the server (forkserver, workers, resource tracker)."""
        children: dict[int, list[int]] = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
        out, todo = [], [self.pid]
        while todo:
            for c in children.get(todo.pop(), []):
                out.append(c)
                todo.append(c)
        return sorted(out)

    def wait_idle(self, timeout: float = 15.0, quiet_s: float = 0.1) -> float:
        """Wait until the workers have finished the batches of streams that ended (a cancelled
        stream's in-flight batches are still built): until they use under 5% of a core over
        ``quiet_s``. Returns the seconds waited."""
        from bench.measure import cpu_seconds

        t0 = time.perf_counter()
        pids = list(self.worker_pids)
        while time.perf_counter() - t0 < timeout:
            try:
                c0 = sum(cpu_seconds(p) for p in pids)
                time.sleep(quiet_s)
                c1 = sum(cpu_seconds(p) for p in pids)
            except OSError:
                break
            if c1 - c0 < 0.05 * quiet_s:
                break
        return time.perf_counter() - t0

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            self._tmp.cleanup()
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self._tmp.cleanup()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
