"""Helpers of the tests that run servers as processes and watch them from /proc: ``ServerProcess``
(``batchd serve`` as a subprocess; the ``server_procs`` fixture in conftest.py makes them),
process trees, a server config over Fashion-MNIST's test split, gRPC health."""

from __future__ import annotations

import collections
import os
import pathlib
import subprocess

import albumentations as A
import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

import batchd
from batchd import server_process
from batchd.server import shm as server_shm

N_TEST = 10_000


def loader(server_or_address, dataset="fmnist-test", **kwargs) -> "batchd.RemoteDataLoader":
    address = getattr(server_or_address, "address", server_or_address)
    kwargs.setdefault("connect_timeout", 10)
    kwargs.setdefault("timeout", 60)
    return batchd.RemoteDataLoader(address, dataset, **kwargs)


def fmnist_test_config(fmnist_root) -> dict:
    return {"fmnist-test": {"kind": "fashion-mnist", "root": str(fmnist_root), "split": "test"}}


RANDOM_AUG = A.Compose([
    A.HorizontalFlip(p=0.5),
    A.Affine(rotate=(-20, 20), p=0.7),
    A.RandomBrightnessContrast(p=0.5),
])

# About 10 ms per Fashion-MNIST sample on one core, deterministic, back to 28x28: a batch stays in
# flight long enough for a thread polling the scheduler to see (and kill) the worker holding it.
SLOW = A.Compose([A.Resize(512, 512), A.MedianBlur(blur_limit=(15, 15), p=1.0), A.Resize(28, 28)])


# --- processes, from /proc --------------------------------------------------------------------


def _stat(pid: int) -> tuple[str, int, int] | None:
    """(state, ppid, starttime) of ``pid`` from /proc/PID/stat, or None if there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    fields = data.rsplit(")", 1)[1].split()  # the name in parentheses may contain spaces
    return fields[0], int(fields[1]), int(fields[19])


def descendants(root: int) -> dict[int, int]:
    """{pid: starttime} of every live descendant of ``root`` (children, grandchildren, ...)."""
    children: dict[int, list[int]] = collections.defaultdict(list)
    starts: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st is not None and st[0] not in "ZX":
                children[st[1]].append(int(entry))
                starts[int(entry)] = st[2]
    out, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            out[child] = starts[child]
            todo.append(child)
    return out


def alive(pid: int, starttime: int) -> bool:
    """The same process (not a reused pid) still exists and is not a zombie."""
    st = _stat(pid)
    return st is not None and st[2] == starttime and st[0] not in "ZX"


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def segments_of(pid: int) -> list[pathlib.Path]:
    return sorted(server_shm.SHM_DIR.glob(f"batchd-{pid}-*"))


class ServerProcess(server_process.ServerProcess):
    """``python -m batchd.cli serve --config CFG --address ADDR`` (``batchd.server_process``); a
    server that does not start, or does not exit when waited for, fails the test with its log."""

    def __init__(self, config: pathlib.Path, address: str):
        super().__init__(server_process.serve_command("--config", config, "--address", address), keep_lines=500)
        self.config, self.address = config, address

    def start(self, timeout: float = 90.0) -> "ServerProcess":
        self.timeout = timeout
        try:
            return super().start()
        except (server_process.ServerExited, TimeoutError):
            self.kill()
            pytest.fail(f"the server did not start (exit code {self.proc.returncode}); its log:\n{self.log}")

    def signal(self, sig: int) -> None:
        self.send_signal(sig)

    def wait(self, timeout: float) -> int:
        """The exit code; fails the test if the process is still running after ``timeout`` seconds."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the server (pid {self.pid}) did not exit within {timeout:g} s; its log:\n{self.log}")


def write_server_config(tmp_path: pathlib.Path, fmnist_root, workers: int = 2) -> pathlib.Path:
    cfg = tmp_path / "server.yaml"
    cfg.write_text(yaml.safe_dump({
        "workers": workers,
        "cache_dir": str(tmp_path / "cache"),
        "datasets": fmnist_test_config(fmnist_root),
    }))
    return cfg


def health_status(address: str, timeout: float = 3.0) -> str:
    """The gRPC health status name of the whole server, or the status code name if the call fails."""
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError as e:
            return e.code().name
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
