"""Fixtures of the real-engine tests (``make test-containers``): the daemon, the images, the logs.

Session-wide, set up once for the three stacks: ``engine`` (a Docker daemon: the running one, or
dockerd started and stopped here, ``docker_engine.py``), ``images`` (the base image from
debootstrap, ``base_image.py``, then every image the Compose files build, ``images.py``; all of a
run's images removed at the end, earlier tags given back). Logs (dockerd, debootstrap, builds,
every container's output) go to ``logs_dir``: ``BATCHD_CONTAINER_LOGS`` or a pytest temporary
folder, named in each failure.

A module of its own, imported by the test module, not a ``conftest.py``: a second ``conftest``
module would shadow ``tests/conftest.py``, which the other tests import by name.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import uuid

import pytest

import base_image
import images as images_module
from docker_engine import engine as docker_engine

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILES = [REPO / "docker-compose.yml", REPO / "docker-compose.pool.yml", REPO / "docker-compose.tcp.yml"]
CACHE = REPO / ".cache" / "containers"  # the base image's root file system, kept between runs (make clean drops it)
RUN_LABEL = "io.batchd.test-run"  # on the base image, so on every image built FROM it
ENABLED = os.environ.get("BATCHD_CONTAINER_TESTS") == "1"


@pytest.fixture(scope="session")
def run_id() -> str:
    """Names this run's projects and labels its images: 8 hex digits."""
    return uuid.uuid4().hex[:8]


LOGS = ("dockerd.log", "debootstrap.log", "build.log", "compose.log")


@pytest.fixture(scope="session")
def logs_dir(tmp_path_factory) -> pathlib.Path:
    """Where this run's ``LOGS`` go (an earlier run's are removed first)."""
    folder = os.environ.get("BATCHD_CONTAINER_LOGS")
    if not folder:
        return tmp_path_factory.mktemp("container-logs")
    path = pathlib.Path(folder).resolve()
    path.mkdir(parents=True, exist_ok=True)
    for name in LOGS:
        (path / name).unlink(missing_ok=True)
    return path


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


@pytest.fixture(scope="session")
def engine(logs_dir):
    """The Docker daemon (``docker_engine.engine``). While it is held, SIGTERM (a cancelled CI job)
    interrupts the run as Ctrl-C does, so that the fixtures still take down what they made (stacks,
    images, the dockerd started here) instead of leaving it running."""
    if not ENABLED:
        pytest.skip("the real-engine tests run with `make test-containers` (BATCHD_CONTAINER_TESTS=1)")
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with docker_engine(logs_dir / "dockerd.log") as started:
            yield started
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.fixture(scope="session")
def images(engine, run_id, logs_dir) -> dict[str, pathlib.Path]:
    """{tag: Dockerfile}: every image the Compose files run, built for this run."""
    builds = images_module.compose_builds(REPO, COMPOSE_FILES)
    base_tag = f"batchd-test/python:3.11-bookworm-{run_id}"
    tarball = base_image.root_tarball(CACHE, logs_dir / "debootstrap.log")
    build_log = logs_dir / "build.log"
    with images_module.keep_tags(list(builds)):
        try:
            base_image.import_image(images_module.docker, tarball, base_tag, {RUN_LABEL: run_id})
            torch_args = os.environ.get("BATCHD_TRAINER_TORCH_PIP_ARGS")
            folder = images_module.torch_wheel_folder() if torch_args is None else None
            if torch_args is None and folder is None:
                pytest.fail("no torch wheel in pip's find-links folders (`pip config list`) and no "
                            "BATCHD_TRAINER_TORCH_PIP_ARGS: the trainer image cannot get torch without a registry")
            with images_module.wheel_links(folder) if folder is not None else contextlib.nullcontext() as url:
                for tag, dockerfile in builds.items():
                    args = {"PYTHON_IMAGE": base_tag}
                    if "TORCH_PIP_ARGS" in dockerfile.read_text():
                        args["TORCH_PIP_ARGS"] = torch_args if torch_args is not None else f"--find-links {url}"
                    images_module.build(REPO, tag, dockerfile, args, build_log)
            yield builds
        finally:
            images_module.remove_run_images(RUN_LABEL, run_id)
            images_module.docker("rmi", "--force", base_tag, check=False)

