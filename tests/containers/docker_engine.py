"""The Docker engine the container tests drive: ``docker`` commands, and a daemon started here.

``docker(*args)`` runs the CLI with a timeout and raises ``DockerError`` (the command and its
output) when it fails. ``engine(log)`` yields once a daemon answers: the one already running, or
Debian's ``dockerd`` (package docker.io, 20.10) started here as root, which is stopped again
(SIGTERM, then SIGKILL after ``STOP_TIMEOUT_S``) on exit. dockerd picks its storage driver itself
(overlay2 where the kernel has overlayfs, else vfs). Where it cannot set up iptables (a sandbox
without netfilter) it is started again with ``--iptables=false``: containers on one Compose
network still reach each other (one bridge) and published ports still work (docker-proxy, a
userland forwarder), but containers cannot reach the internet, so images are built on the host's
network (``docker build --network host``, ``images.py``). ``BATCHD_DOCKERD_ARGS`` adds arguments
(e.g. ``--storage-driver=vfs``).

Builds use Docker's classic builder (``DOCKER_BUILDKIT=0``): BuildKit would fetch the
``# syntax=docker/dockerfile:1`` frontend image from Docker Hub, which no registry here serves.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import shlex
import shutil
import subprocess
import time

START_TIMEOUT_S = 90
STOP_TIMEOUT_S = 30
ENV = {**os.environ, "DOCKER_BUILDKIT": "0", "DOCKER_CLI_HINTS": "false"}


class DockerError(RuntimeError):
    """A ``docker`` (or ``docker-compose``) command failed: its argv, exit status and output."""


def run(argv: list[str], *, timeout: float, check: bool = True, cwd: pathlib.Path | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    """``argv`` with stdout and stderr captured (text), at most ``timeout`` seconds. Raises
    DockerError if it exits non-zero (``check``) or runs too long."""
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env or ENV,
                             stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        raise DockerError(f"`{shlex.join(argv)}` ran for more than {timeout:g} s:\n{out[-4000:]}") from None
    if check and res.returncode != 0:
        raise DockerError(f"`{shlex.join(argv)}` exited {res.returncode}:\n{(res.stdout + res.stderr)[-4000:]}")
    return res


def docker(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess:
    """``docker ARGS...`` (see ``run``)."""
    return run(["docker", *args], timeout=timeout, check=check)


def answering(timeout: float = 20) -> bool:
    """Whether a Docker daemon answers ``docker info`` within ``timeout`` seconds."""
    if shutil.which("docker") is None:
        return False
    try:
        return docker("info", "--format", "{{.ServerVersion}}", timeout=timeout, check=False).returncode == 0
    except DockerError:
        return False


def _start(dockerd: str, extra: list[str], log: pathlib.Path) -> subprocess.Popen | None:
    """dockerd with ``extra`` arguments, once ``docker info`` answers; None if it exited first."""
    with open(log, "ab") as out:
        out.write(f"\n--- {dockerd} {shlex.join(extra)}\n".encode())
        out.flush()
        proc = subprocess.Popen([dockerd, *extra], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return None
        if answering(timeout=5):
            return proc
        time.sleep(0.5)
    _stop(proc)
    raise DockerError(f"dockerd did not answer within {START_TIMEOUT_S} s; see {log}")


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


@contextlib.contextmanager
def engine(log: pathlib.Path):
    """Yields ``True`` if it started dockerd (stopped on exit), ``False`` if one already answered.
    Raises DockerError if none answers and none can be started (not root, docker.io missing,
    dockerd exits: the reason is in ``log``)."""
    if answering():
        yield False
        return
    dockerd = shutil.which("dockerd") or shutil.which("dockerd", path="/usr/sbin:/usr/bin")
    if dockerd is None or shutil.which("docker") is None:
        raise DockerError("no Docker daemon answers and dockerd/docker are not installed "
                          "(apt-get install docker.io; make test-containers does it as root)")
    if os.geteuid() != 0:
        raise DockerError("no Docker daemon answers, and starting dockerd needs root")
    extra = shlex.split(os.environ.get("BATCHD_DOCKERD_ARGS", ""))
    proc = _start(dockerd, extra, log)
    if proc is None and "iptables" in log.read_text(errors="replace").rsplit("\n--- ", 1)[-1]:
        proc = _start(dockerd, [*extra, "--iptables=false", "--ip-masq=false"], log)
    if proc is None:
        tail = log.read_text(errors="replace")[-3000:]
        raise DockerError(f"dockerd exited at start; its log ({log}) ends:\n{tail}")
    try:
        yield True
    finally:
        _stop(proc)
