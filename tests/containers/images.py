"""The images the Compose files run, built with Docker's classic builder on the local base image.

``compose_builds`` reads what to build from the Compose files themselves (each service's
``image`` tag and its ``build`` Dockerfile), so the tags built are the ones the stacks run.
``build`` passes ``PYTHON_IMAGE`` (``base_image.py``) and, for the trainer,
``TORCH_PIP_ARGS``: pip's ``--find-links`` to torch's CPU wheel. That wheel lies in the folder
pip's own configuration names as find-links (``pip config list``: /opt/wheels on these
machines); ``wheel_links`` serves that folder over HTTP on 127.0.0.1 for as long as the builds
last, and builds run on the host's network (``--network host``), so pip inside the build reaches
it (and PyPI, for everything else) whether or not dockerd could set up NAT.
``BATCHD_TRAINER_TORCH_PIP_ARGS`` overrides the find-links (e.g. ``--index-url
https://download.pytorch.org/whl/cpu``, the Dockerfile's default, where that index is reachable).

Every image a run makes carries the base image's run label (``LABEL`` is inherited through
``FROM``, and a container has its image's labels), so ``remove_run_images`` finds them all, the
builder stages' untagged images and an interrupted build's container too.
``keep_tags`` gives back the tags (``batchd:local``...) to the images that held them before.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import pathlib
import shlex
import subprocess
import sys
import threading
import urllib.parse

import yaml

from docker_engine import DockerError, docker, run

BUILD_TIMEOUT_S = 1200  # one image: pip downloads its dependencies from PyPI (torch's wheel from disk)
TORCH_WHEEL_GLOB = "torch-*.whl"


def compose_builds(repo: pathlib.Path, files: list[pathlib.Path]) -> dict[str, pathlib.Path]:
    """{image tag: Dockerfile} of every service with a ``build`` in ``files``; ValueError if one
    tag is built from two Dockerfiles or a service builds without naming its image."""
    builds: dict[str, pathlib.Path] = {}
    for path in files:
        for name, svc in yaml.safe_load(path.read_text())["services"].items():
            build = svc.get("build")
            if build is None:
                continue
            build = {"context": build} if isinstance(build, str) else build
            if "image" not in svc:
                raise ValueError(f"{path.name}: service {name} builds an image without naming it (image:)")
            dockerfile = (path.parent / build.get("context", ".") / build.get("dockerfile", "Dockerfile")).resolve()
            if builds.setdefault(svc["image"], dockerfile) != dockerfile:
                raise ValueError(f"{svc['image']} is built from {builds[svc['image']]} and {dockerfile}")
    return builds


def pip_find_links() -> list[str]:
    """The find-links locations of pip's configuration (files and environment), as pip lists them."""
    res = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60, stdin=subprocess.DEVNULL)
    links: list[str] = []
    for line in res.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(".find-links"):
            links += [v for v in shlex.split(shlex.split(value)[0] if value else "") if v not in links]
    return links


def torch_wheel_folder() -> pathlib.Path | None:
    """The first local find-links folder (a path or file:// URL) that holds a torch wheel."""
    for link in pip_find_links():
        parsed = urllib.parse.urlparse(link)
        if parsed.scheme not in ("", "file"):
            continue
        folder = pathlib.Path(urllib.parse.unquote(parsed.path) if parsed.scheme else link)
        if folder.is_dir() and any(folder.glob(TORCH_WHEEL_GLOB)):
            return folder
    return None


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:  # (pip's requests are not this test's output)
        pass


@contextlib.contextmanager
def wheel_links(folder: pathlib.Path):
    """Serve ``folder`` read-only on 127.0.0.1; yields its URL (``http://127.0.0.1:PORT/``)."""
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, name="wheel-links", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10)


def build(repo: pathlib.Path, tag: str, dockerfile: pathlib.Path, build_args: dict[str, str],
          log: pathlib.Path) -> None:
    """``docker build`` of ``dockerfile`` (context: the repository) as ``tag``, on the host's
    network, its output appended to ``log``. Raises DockerError with the output's end."""
    args = [a for k, v in build_args.items() for a in ("--build-arg", f"{k}={v}")]
    argv = ["docker", "build", "--network", "host", "--force-rm", "-f", str(dockerfile), "-t", tag, *args, str(repo)]
    try:
        res = run(argv, timeout=BUILD_TIMEOUT_S, check=False)
    except DockerError as e:
        with open(log, "a") as out:
            out.write(f"\n--- {shlex.join(argv)}\n{e}\n")
        raise
    with open(log, "a") as out:
        out.write(f"\n--- {shlex.join(argv)}\n{res.stdout}{res.stderr}")
    if res.returncode != 0:
        raise DockerError(f"`{shlex.join(argv)}` exited {res.returncode}:\n{(res.stdout + res.stderr)[-4000:]}")


def image_id(ref: str) -> str | None:
    """The id of image ``ref`` (a tag), None if there is none."""
    res = docker("image", "inspect", "--format", "{{.Id}}", ref, check=False)
    return res.stdout.strip() if res.returncode == 0 else None


@contextlib.contextmanager
def keep_tags(tags: list[str]):
    """On exit, point each of ``tags`` back at the image it named before (if it named one)."""
    before = {tag: image_id(tag) for tag in tags}
    try:
        yield
    finally:
        for tag, old in before.items():
            if old is not None and image_id(tag) != old:
                docker("tag", old, tag, check=False)


def remove_run_images(label: str, value: str) -> list[str]:
    """Remove every container, then every image, labelled ``label=value`` (a container has its
    image's labels: an interrupted build's leftover too), images newest first; the images' ids."""
    containers = docker("ps", "--all", "--quiet", "--no-trunc", "--filter", f"label={label}={value}").stdout.split()
    if containers:
        docker("rm", "--force", "--volumes", *containers, timeout=300, check=False)
    ids = docker("images", "--all", "--quiet", "--no-trunc", "--filter", f"label={label}={value}").stdout.split()
    ids = list(dict.fromkeys(ids))
    if ids:
        docker("rmi", "--force", *ids, timeout=300, check=False)
    return ids
