"""A ``batchd serve`` subprocess on 127.0.0.1:0 (or a unix socket) with a generated YAML config.

    with ServerProcess(datasets={...}, pipelines={...}, workers=2, cache_dir=...) as srv:
        RemoteDataLoader(srv.address, "photos", ...)

``batchd.server_process`` starts it and parses the bound address from ``listening on ADDRESS
(...)``; the worker pids come from ``N workers ready (pids [...])``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time

import yaml

from batchd import server_process

_DIE_WITH_PARENT = (
    "import ctypes, os, signal, sys; ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM); "  # PR_SET_PDEATHSIG
    "os.execv(sys.argv[1], sys.argv[1:])"
)
_WORKERS = re.compile(r"workers ready \(pids \[([\d, ]*)\]\)")


def private_shm_available() -> bool:
    """Whether ``ServerProcess(private_shm=True)`` can run here (``unshare -m`` and a tmpfs mount)."""
    try:
        return subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


class ServerProcess(server_process.ServerProcess):
    """``batchd.server_process.ServerProcess`` over a config written from its arguments, that dies
    with this process (even SIGKILLed: no orphaned servers), with its worker pids; a server that
    does not start raises RuntimeError with its log."""

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
        self.worker_pids: list[int] = []
        self._tmp = tempfile.TemporaryDirectory(prefix="batchd-bench-")
        super().__init__([], timeout=start_timeout, keep_lines=400, on_line=self._worker_line)

    def start(self) -> "ServerProcess":
        cfg = os.path.join(self._tmp.name, "server.yaml")
        with open(cfg, "w") as f:
            yaml.safe_dump(self.config, f, sort_keys=False)
        serve = server_process.serve_command("--config", cfg, "--address", self.config["address"])
        if isinstance(self.workers, int):  # a range ({min, max}) stays in the config
            serve += ["--workers", str(self.workers)]
        # the server gets SIGTERM if this process dies (even by SIGKILL): no orphaned servers
        self.argv = [sys.executable, "-c", _DIE_WITH_PARENT, *serve]
        if self.private_shm:
            self.argv = ["unshare", "-m", "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh", *self.argv]
        try:
            return super().start()
        except (server_process.ServerExited, TimeoutError) as e:
            what = "exited" if isinstance(e, server_process.ServerExited) else "did not start in time"
            self.stop()
            raise RuntimeError(f"batchd server {what}; its log:\n{self.log}") from None

    def _worker_line(self, line: str) -> None:
        m = _WORKERS.search(line)
        if m:
            self.worker_pids = [int(p) for p in m.group(1).replace(" ", "").split(",") if p]

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
        super().stop(timeout)
        self._tmp.cleanup()
