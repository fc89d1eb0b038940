"""One Compose stack of the repository, run in the real engine and taken down whatever happens.

``running(file, project, log)`` starts every service of ``file`` detached from the images built
beforehand (``up -d --no-build``: Compose waits for the servers' healthchecks, as
``depends_on: condition: service_healthy`` says, then starts the trainer) and yields a
``Stack``; on exit it appends every container's log to ``log`` and runs ``down --volumes
--remove-orphans`` (containers, the project's network and named volumes), then checks that
nothing of the project is left. ``Stack.wait`` waits for a service's container to exit (its exit
status), ``Stack.logs`` and ``Stack.exec`` read from it.

Compose is Debian's ``docker-compose`` 1.29 where installed (the version the Compose files are
written for), else the ``docker compose`` plugin.
"""

from __future__ import annotations

import contextlib
import pathlib
import shutil

from docker_engine import DockerError, docker, run

UP_TIMEOUT_S = 300  # pulls nothing; waits for the servers' healthchecks (start_period 60 s)
DOWN_TIMEOUT_S = 120


def compose_command() -> list[str]:
    """``["docker-compose"]`` (Debian's 1.29) or ``["docker", "compose"]``; DockerError if neither."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if run(["docker", "compose", "version"], timeout=30, check=False).returncode == 0:
        return ["docker", "compose"]
    raise DockerError("neither docker-compose nor the docker compose plugin is installed (apt-get install "
                      "docker-compose; make test-containers does it as root)")


class Stack:
    """A started Compose project: ``file`` (its folder is the project directory) as ``project``."""

    def __init__(self, file: pathlib.Path, project: str):
        self.file, self.project = file, project
        self._base = [*compose_command(), "--project-name", project, "--file", str(file)]

    def compose(self, *args: str, timeout: float = 60, check: bool = True):
        return run([*self._base, *args], timeout=timeout, check=check, cwd=self.file.parent)

    def container(self, service: str) -> str:
        """The id of ``service``'s (one) container, stopped ones included."""
        plugin = self._base[0] == "docker"  # (Compose v2 lists stopped containers only with --all; 1.29 always)
        ids = self.compose("ps", *(["--all"] if plugin else []), "--quiet", service).stdout.split()
        if len(ids) != 1:
            raise DockerError(f"{self.project}: expected one container of {service}, found {ids}")
        return ids[0]

    def wait(self, service: str, timeout: float) -> int:
        """Wait for ``service``'s container to exit; its exit status. DockerError after ``timeout`` s."""
        return int(docker("wait", self.container(service), timeout=timeout).stdout.strip().splitlines()[-1])

    def logs(self, service: str) -> str:
        """Everything ``service``'s container wrote (stdout and stderr)."""
        res = docker("logs", self.container(service), timeout=60)
        return res.stdout + res.stderr

    def exec(self, service: str, *argv: str, timeout: float = 60) -> str:
        """``argv`` run in ``service``'s running container; its stdout. DockerError if it fails."""
        return docker("exec", self.container(service), *argv, timeout=timeout).stdout

    def leftovers(self) -> list[str]:
        """Containers, networks and volumes of this project still present."""
        label = f"label=com.docker.compose.project={self.project}"
        found = []
        for kind in (("ps", "--all"), ("network", "ls"), ("volume", "ls")):
            found += docker(*kind, "--quiet", "--filter", label).stdout.split()
        return found


@contextlib.contextmanager
def running(file: pathlib.Path, project: str, log: pathlib.Path):
    """``Stack`` of ``file`` up as ``project`` (module docstring); logs to ``log``, down on exit.
    Raises DockerError if it does not come up, or if ``down`` leaves something behind."""
    stack = Stack(file, project)
    try:
        stack.compose("up", "--detach", "--no-build", timeout=UP_TIMEOUT_S)
        yield stack
    finally:
        with open(log, "a") as out:
            res = stack.compose("logs", "--no-color", "--timestamps", timeout=120, check=False)
            out.write(f"\n===== {file.name} as {project}\n{res.stdout}{res.stderr}")
        stack.compose("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=DOWN_TIMEOUT_S, check=False)
        left = stack.leftovers()
        if left:
            raise DockerError(f"{project}: `down` left {left}")
