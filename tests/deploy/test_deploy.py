"""The deployment files: docker-compose.yml (+ .tcp.yml), the Dockerfiles, the example config, Makefile, .ci/run.

No container engine runs where these tests run, so the compose file is checked against the
Compose specification's JSON schema and against the repository (files it mounts and builds,
``batchd`` subcommands and options it calls), and what the compose file runs is run directly:
``batchd serve`` on the example config, probed with ``batchd health``, stopped with SIGTERM.

tests/compose-spec.json is the official Compose specification schema (compose-spec project,
Apache-2.0, licence in tests/compose-spec.LICENSE), copied unchanged from the copy that the PyPI
package check-jsonschema 0.39.0 vendors (check_jsonschema/builtin_schemas/vendor/compose-spec.json,
sha256 d549057e...0e64, the digest check-jsonschema records for it).
"""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import pathlib
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time

import numpy as np
import pytest
import yaml
from helpers import free_port

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_TCP_FILE = REPO / "docker-compose.tcp.yml"  # the same over TCP, without shared memory
COMPOSE_POOL_FILE = REPO / "docker-compose.pool.yml"  # a sidecar (shared memory) plus a remote server (TCP)
COMPOSE_FILES = [COMPOSE_FILE, COMPOSE_TCP_FILE, COMPOSE_POOL_FILE]
COMPOSE_SCHEMA = REPO / "tests" / "compose-spec.json"
DOCKERFILE = REPO / "Dockerfile"
TRAINER_DOCKERFILE = REPO / "examples" / "Dockerfile.trainer"
EXAMPLE_CONFIG = REPO / "examples" / "fashion_mnist.yaml"
FMNIST_DIR = pathlib.Path("/usr/share/datasets/fashion-mnist")
FMNIST_FILES = [
    "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz",
]
# The image's ENTRYPOINT (checked below), which a service's `command` follows.
IMAGE_ENTRYPOINT = ["batchd"]
# gRPC, and the data plane beside it: the server's default data port is the gRPC port + 1.
GRPC_PORT = 50051
DATA_PORT = GRPC_PORT + 1


# ---- helpers ------------------------------------------------------------------------------------


def load_compose(path: pathlib.Path = COMPOSE_FILE) -> dict:
    return yaml.safe_load(path.read_text())


def batchd_exe() -> str:
    """The `batchd` console script of the environment running the tests."""
    for where in (sysconfig.get_path("scripts"), os.path.dirname(sys.executable)):
        exe = shutil.which("batchd", path=where)
        if exe:
            return exe
    exe = shutil.which("batchd")
    if exe is None:
        pytest.fail("the `batchd` console script is not installed; run `make install`")
    return exe


def run_batchd(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(
        [batchd_exe(), *args], capture_output=True, text=True, timeout=timeout, cwd=REPO,
        stdin=subprocess.DEVNULL,
    )


def argv(value) -> list[str]:
    """A compose command/test (list, or a string split as a shell would) as a list."""
    return list(map(str, value)) if isinstance(value, list) else shlex.split(str(value))


def dockerfile_instructions(path: pathlib.Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out, pending = [], ""
    for line in path.read_text().splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if pending and stripped.startswith("#"):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        full = (pending + stripped).strip()
        pending = ""
        if full:
            instr, _, rest = full.partition(" ")
            out.append((instr.upper(), rest.strip()))
    assert not pending, f"{path}: dangling line continuation"
    return out


def final_stage(instructions: list[tuple[str, str]]) -> list[tuple[str, str]]:
    last_from = max(i for i, (instr, _) in enumerate(instructions) if instr == "FROM")
    return instructions[last_from:]


def exec_form(args: str) -> list[str]:
    """A Dockerfile JSON ("exec") form; fails the test for the shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        pytest.fail(f"expected the JSON (exec) form, got: {args}")
    assert isinstance(value, list) and all(isinstance(v, str) for v in value)
    return value


def dockerfile_healthcheck_cmd(instructions) -> list[str]:
    for instr, args in final_stage(instructions):
        if instr == "HEALTHCHECK":
            options, _, cmd = args.partition("CMD ")
            return exec_form(cmd.strip())
    pytest.fail("the final stage has no HEALTHCHECK")


def batchd_invocations() -> dict[str, list[str]]:
    """Every command line of the deployment files that runs `batchd`, by where it comes from."""
    found: dict[str, list[str]] = {}
    for path in COMPOSE_FILES:
        found.update(_compose_invocations(path))
    instructions = dockerfile_instructions(DOCKERFILE)
    found["Dockerfile HEALTHCHECK"] = dockerfile_healthcheck_cmd(instructions)
    stage = final_stage(instructions)
    entry = [exec_form(a) for i, a in stage if i == "ENTRYPOINT"][-1]
    cmd = [exec_form(a) for i, a in stage if i == "CMD"][-1]
    found["Dockerfile ENTRYPOINT+CMD"] = entry + cmd
    return found


def _compose_invocations(path: pathlib.Path) -> dict[str, list[str]]:
    """`batchd` command lines of one compose file: "compose SERVICE.command" (docker-compose.yml)
    or "FILE SERVICE.command" (the others), and the same for healthchecks."""
    found: dict[str, list[str]] = {}
    tag = "compose" if path == COMPOSE_FILE else path.name
    for name, svc in load_compose(path)["services"].items():
        if "command" in svc:
            cmd = argv(svc["command"])
            entry = argv(svc["entrypoint"]) if "entrypoint" in svc else None
            if entry is None and cmd[0] != "batchd" and _builds_server_image(svc):
                entry = IMAGE_ENTRYPOINT
            full = (entry or []) + cmd
            if full[0] == "batchd":
                found[f"{tag} {name}.command"] = full
        test = svc.get("healthcheck", {}).get("test")
        if test is not None:
            t = argv(test)
            if t[0] in ("CMD", "CMD-SHELL"):
                t = t[1:] if t[0] == "CMD" else shlex.split(" ".join(t[1:]))
            if t and t[0] == "batchd":
                found[f"{tag} {name}.healthcheck"] = t
    return found


def _builds_server_image(svc: dict) -> bool:
    build = svc.get("build")
    if build is None:
        return False
    if isinstance(build, str):
        build = {"context": build}
    context = (REPO / build.get("context", ".")).resolve()
    return context == REPO and build.get("dockerfile", "Dockerfile") == "Dockerfile"


# ---- docker-compose.yml -------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_validates_against_the_compose_spec(path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator_cls = jsonschema.validators.validator_for(schema)
    validator_cls.check_schema(schema)
    validator = validator_cls(schema)

    compose = load_compose(path)
    errors = sorted(validator.iter_errors(compose), key=lambda e: list(map(str, e.absolute_path)))
    assert not errors, "\n".join(f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors)

    # The schema is strict enough to catch what matters: a misspelt key, a wrongly typed value.
    typo = copy.deepcopy(compose)
    typo["services"]["batchd"]["shm_sise"] = typo["services"]["batchd"].pop("shm_size")
    assert list(validator.iter_errors(typo)), "a misspelt service key must not validate"
    wrong = copy.deepcopy(compose)
    wrong["services"]["trainer"]["depends_on"]["batchd"]["condition"] = "service_ready"
    assert list(validator.iter_errors(wrong)), "an unknown depends_on condition must not validate"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_file_suits_docker_compose_1_29_too(path):
    """Debian's docker-compose 1.29 refuses top-level keys the Compose spec added later (``name``)."""
    assert set(load_compose(path)) <= {"services", "volumes", "networks", "configs", "secrets"}, path.name
    if shutil.which("docker-compose"):  # the real one, where installed (apt-get install docker-compose)
        run = subprocess.run(["docker-compose", "-f", str(path), "config", "-q"], capture_output=True, text=True,
                             cwd=REPO, timeout=50)
        assert run.returncode == 0, run.stderr


@pytest.mark.timeout(60)
def test_compose_services_are_wired_together():
    compose = load_compose()
    services = compose["services"]
    assert set(services) >= {"batchd", "trainer"}
    server, trainer = services["batchd"], services["trainer"]

    # Shared memory: set deliberately on the server (Docker's default /dev/shm is 64 MB), shared
    # with the trainer through the server's IPC namespace.
    assert server.get("shm_size"), "batchd needs shm_size: Docker's default /dev/shm is 64 MB"
    assert server.get("ipc") == "shareable"
    assert trainer.get("ipc") == "service:batchd"
    assert "shm_size" not in trainer, "a container that joins another's IPC namespace cannot size /dev/shm"

    assert trainer["depends_on"]["batchd"]["condition"] == "service_healthy"
    assert "healthcheck" in server

    # A unix socket in a named volume that both mount at the same path: the server listens on it,
    # the healthcheck probes it, the trainer dials it (and asks for shared memory).
    cmd = argv(server["command"])
    address = cmd[cmd.index("--address") + 1]
    assert address.startswith("unix:"), address
    folder = str(pathlib.PurePosixPath(address[len("unix:"):]).parent)
    volume = next(v.split(":")[0] for v in server["volumes"] if v.split(":")[1] == folder)
    assert volume in compose["volumes"], f"{volume} should be a named volume"
    assert f"{volume}:{folder}" in trainer["volumes"], "the trainer must mount the socket's volume at the same path"
    tcmd = argv(trainer["command"])
    assert tcmd[tcmd.index("--address") + 1] == address
    assert tcmd[tcmd.index("--transport") + 1] == "shm"
    health = argv(server["healthcheck"]["test"])
    assert health[health.index("health") + 1] == address


@pytest.mark.timeout(60)
def test_compose_tcp_variant_uses_tcp_without_shared_memory():
    services = load_compose(COMPOSE_TCP_FILE)["services"]
    server, trainer = services["batchd"], services["trainer"]
    assert "ipc" not in server and "ipc" not in trainer, "the TCP variant shares no IPC namespace"
    assert server.get("shm_size"), "the workers still hand batches over in /dev/shm slots"
    assert trainer["depends_on"]["batchd"]["condition"] == "service_healthy"
    cmd = argv(server["command"])
    assert cmd[cmd.index("--address") + 1] == f"0.0.0.0:{GRPC_PORT}"
    tcmd = argv(trainer["command"])
    assert tcmd[tcmd.index("--address") + 1] == f"batchd:{GRPC_PORT}"
    assert tcmd[tcmd.index("--transport") + 1] == "socket", "the batch bytes come on the data plane"
    health = argv(server["healthcheck"]["test"])
    assert health[health.index("health") + 1] == f"127.0.0.1:{GRPC_PORT}"
    # both ports published under their own numbers: a client dials the data port the server announces
    assert published_ports(server) == {GRPC_PORT: GRPC_PORT, DATA_PORT: DATA_PORT}


def published_ports(service: dict) -> dict[int, int]:
    """{container port: host port} of a service's ``ports`` (short syntax, TCP, optional host IP)."""
    out = {}
    for spec in service.get("ports", []):
        parts = str(spec).split("/")[0].split(":")
        assert len(parts) in (2, 3), f"give the host port explicitly: {spec!r}"
        out[int(parts[-1])] = int(parts[-2])
    return out


@pytest.mark.timeout(60)
def test_compose_pool_variant_reads_a_sidecar_over_shared_memory_and_a_server_over_tcp():
    """docs/several-servers.md's deployment: the sidecar as in docker-compose.yml (socket volume,
    the trainer in its IPC namespace), the remote server sharing neither (TCP only), and one
    loader over both: --address twice, transport "auto" (shared memory where it can)."""
    compose = load_compose(COMPOSE_POOL_FILE)
    services = compose["services"]
    sidecar, remote, trainer = services["batchd"], services["batchd-remote"], services["trainer"]
    assert sidecar.get("ipc") == "shareable" and trainer.get("ipc") == "service:batchd"
    assert "ipc" not in remote and remote.get("shm_size"), "the remote server shares no IPC namespace"
    socket = argv(sidecar["command"])[argv(sidecar["command"]).index("--address") + 1]
    assert socket.startswith("unix:")
    folder = str(pathlib.PurePosixPath(socket[len("unix:"):]).parent)
    volume = next(v.split(":")[0] for v in sidecar["volumes"] if v.split(":")[1] == folder)
    assert f"{volume}:{folder}" in trainer["volumes"] and volume in compose["volumes"]
    rcmd = argv(remote["command"])
    assert rcmd[rcmd.index("--address") + 1] == f"0.0.0.0:{GRPC_PORT}"
    assert set(map(str, remote["expose"])) == {str(GRPC_PORT), str(DATA_PORT)}, "gRPC and the data plane"
    tcmd = argv(trainer["command"])
    addresses = [tcmd[i + 1] for i, a in enumerate(tcmd) if a == "--address"]
    assert addresses == [socket, "batchd-remote:50051"], addresses
    assert tcmd[tcmd.index("--transport") + 1] == "auto"
    assert {name: d["condition"] for name, d in trainer["depends_on"].items()} == {
        "batchd": "service_healthy", "batchd-remote": "service_healthy"}
    # the same config, datasets and image on both servers: the same bytes (strict refuses a mix)
    assert sidecar["image"] == remote["image"]
    assert [v for v in sidecar["volumes"] if not v.endswith(f":{folder}")] == remote["volumes"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_files_exist_in_the_repository(path):
    """Build contexts, Dockerfiles, bind-mounted repo files and scripts that the services run."""
    compose = load_compose(path)
    for name, svc in compose["services"].items():
        build = svc.get("build")
        if build is not None:
            context = REPO / (build if isinstance(build, str) else build.get("context", "."))
            assert context.is_dir(), f"{name}: build context {context} is missing"
            dockerfile = "Dockerfile" if isinstance(build, str) else build.get("dockerfile", "Dockerfile")
            assert (context / dockerfile).is_file(), f"{name}: {dockerfile} is missing"
        for vol in svc.get("volumes", []):
            source = vol.split(":")[0] if isinstance(vol, str) else vol.get("source", "")
            if source.startswith("."):
                assert (REPO / source).exists(), f"{name}: volume source {source} is not in the repository"
            elif not source.startswith("/"):
                assert source in (compose.get("volumes") or {}), f"{name}: named volume {source} is not declared"
        cmd = argv(svc.get("command", []))
        if cmd and cmd[0] in ("python", "python3"):
            script = next(a for a in cmd[1:] if not a.startswith("-"))
            assert (REPO / script).is_file(), f"{name}: runs {script}, which is not in the repository"
            res = subprocess.run([sys.executable, script, "--help"], cwd=REPO, capture_output=True,
                                 text=True, timeout=45, stdin=subprocess.DEVNULL)
            assert res.returncode == 0, f"{name}: {script} --help failed:\n{res.stderr}"
            for opt in (a.split("=")[0] for a in cmd[2:] if a.startswith("--")):
                assert opt in res.stdout, f"{name}: {script} has no option {opt}"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_compose_server_sees_the_config_and_the_datasets_it_names(path):
    from batchd.server.config import load_config

    server = load_compose(path)["services"]["batchd"]
    mounts = {}
    for vol in server["volumes"]:
        source, target, *mode = vol.split(":")
        mounts[target] = (source, mode)
    cmd = argv(server["command"])
    config_target = cmd[cmd.index("--config") + 1]
    assert config_target in mounts, f"--config {config_target} is not mounted into the container"
    source, mode = mounts[config_target]
    assert mode == ["ro"], "mount the config read-only"
    config = load_config(REPO / source)

    for name, ds in config.datasets.items():
        root = str(getattr(ds, "root", None) or ds.path)
        inside = [t for t in mounts if root == t or root.startswith(t.rstrip("/") + "/")]
        assert inside, f"dataset {name}: {root} is not inside any volume of the batchd service"
        assert all(mounts[t][1] == ["ro"] for t in inside), f"dataset {name}: mount it read-only"


# ---- the batchd CLI that the deployment files call ------------------------------------------------


@pytest.mark.timeout(60)
def test_deployment_files_call_batchd_subcommands_and_options_that_exist():
    calls = batchd_invocations()
    assert {"compose batchd.command", "compose batchd.healthcheck", "Dockerfile HEALTHCHECK",
            "docker-compose.tcp.yml batchd.command", "docker-compose.tcp.yml batchd.healthcheck"} <= set(calls)
    top = run_batchd("--help")
    assert top.returncode == 0, top.stderr
    help_of: dict[str, str] = {}
    for where, cmd in calls.items():
        sub = cmd[1]
        assert re.search(rf"\b{re.escape(sub)}\b", top.stdout), f"{where}: `batchd --help` lists no {sub!r}"
        if sub not in help_of:
            res = run_batchd(sub, "--help")
            assert res.returncode == 0, f"`batchd {sub} --help` failed: {res.stderr}"
            help_of[sub] = res.stdout
        for opt in (a.split("=")[0] for a in cmd[2:] if a.startswith("--")):
            assert opt in help_of[sub], f"{where}: `batchd {sub}` has no option {opt}"


@pytest.mark.timeout(60)
def test_health_fails_when_no_server_listens():
    start = time.monotonic()
    res = run_batchd("health", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "Traceback" not in res.stderr, f"expected a plain 'not serving', not a crash:\n{res.stderr}"
    assert time.monotonic() - start < 30


@pytest.mark.timeout(60)
def test_serve_example_config_reports_healthy_and_stops_on_sigterm(tmp_path):
    """What the compose file runs, run directly: serve, probe health, SIGTERM, exit 0."""
    missing = [f for f in FMNIST_FILES if not (FMNIST_DIR / f).is_file()]
    if missing:
        pytest.skip(f"Fashion-MNIST is not in {FMNIST_DIR} (apt-get install dataset-fashion-mnist)")
    from deployed import running

    # Its dataset cache goes to a temporary folder, not the user's ~/.cache.
    with running([batchd_exe(), "serve", "--config", str(EXAMPLE_CONFIG), "--address", "127.0.0.1:0"], cwd=REPO,
                 env={"XDG_CACHE_HOME": str(tmp_path)}, timeout=30) as (proc, log):
        address = re.search(r"listening on (\S+)", "".join(log)).group(1).rstrip(".,;:)'\"")
        assert not address.endswith(":0"), f"the log should name the bound port, not {address}"

        res = run_batchd("health", address, "--timeout", "5")
        assert res.returncode == 0, f"batchd health {address}: {res.returncode}\n{res.stdout}{res.stderr}"

        proc.send_signal(signal.SIGTERM)
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail("batchd serve did not exit within 20 s of SIGTERM:\n" + "".join(log))
        assert rc == 0, f"batchd serve exited {rc} on SIGTERM:\n" + "".join(log)


@pytest.mark.timeout(90)
def test_compose_sidecar_command_serves_its_socket_with_shared_memory(tmp_path):
    """docker-compose.yml's batchd command and healthcheck, run here: its volumes become folders
    (the named socket volume a temporary one), then the trainer's address and transport are read from."""
    missing = [f for f in FMNIST_FILES if not (FMNIST_DIR / f).is_file()]
    if missing:
        pytest.skip(f"Fashion-MNIST is not in {FMNIST_DIR} (apt-get install dataset-fashion-mnist)")
    import batchd
    from deployed import Mapping, running

    compose = load_compose()
    server, trainer = compose["services"]["batchd"], compose["services"]["trainer"]
    paths = {}
    for vol in server["volumes"]:
        source, target = vol.split(":")[:2]
        if source.startswith("."):
            paths[target] = str(REPO / source)
        elif source.startswith("/"):
            paths[target] = source
        else:  # a named volume
            (tmp_path / source).mkdir()
            paths[target] = str(tmp_path / source)
    mapping = Mapping(paths)
    calls = _compose_invocations(COMPOSE_FILE)
    serve = [mapping.arg(a) for a in calls["compose batchd.command"]]
    serve[0] = batchd_exe()
    with running(serve, cwd=REPO, env={"XDG_CACHE_HOME": str(tmp_path / "cache")}) as (proc, log):
        health = [mapping.arg(a) for a in calls["compose batchd.healthcheck"]]
        res = run_batchd(*health[1:])
        assert res.returncode == 0 and "SERVING" in res.stdout, res.stdout + res.stderr
        tcmd = argv(trainer["command"])
        address = mapping.arg(tcmd[tcmd.index("--address") + 1])
        with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=1000, transform="train",
                                     transport=tcmd[tcmd.index("--transport") + 1]) as ld:
            assert sum(len(b["label"]) for b in ld) == 10_000
        proc.terminate()
        assert proc.wait(20) == 0, "".join(log)


# ---- Dockerfiles ----------------------------------------------------------------------------------


def _check_common_dockerfile(path: pathlib.Path) -> list[tuple[str, str]]:
    instructions = dockerfile_instructions(path)
    froms = [a for i, a in instructions if i == "FROM"]
    assert froms, f"{path.name}: no FROM"
    args = dict(a.split("=", 1) for i, a in instructions if i == "ARG" and "=" in a)
    base = froms[-1].split()[0]
    base = re.sub(r"\$\{(\w+)\}", lambda m: args.get(m.group(1), m.group(0)), base)
    assert base == "python:3.11-slim", f"{path.name}: runtime base is {base}"
    if path == TRAINER_DOCKERFILE:  # the client side only: the server image has no torch
        assert args.get("TORCH_SPEC", "").strip('"') == "torch==2.13.0"
        assert "download.pytorch.org/whl/cpu" in args.get("TORCH_PIP_ARGS", "")
    else:
        assert not any("torch" in a or "[client]" in a for i, a in instructions if i in ("ARG", "RUN")), path.name

    users = [a for i, a in final_stage(instructions) if i == "USER"]
    assert users, f"{path.name}: the final stage runs as root (no USER)"
    assert users[-1].split(":")[0] not in ("root", "0"), f"{path.name}: USER {users[-1]}"

    pip_installs = [a for i, a in instructions if i == "RUN" and "pip install" in a]
    assert pip_installs and not any("[test]" in a or "[dev]" in a or " -e " in a for a in pip_installs), (
        f"{path.name}: install the package itself, not editable and without test extras"
    )

    # Everything COPY'd from the build context exists and is not excluded by .dockerignore.
    ignored = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
               if p.strip() and not p.startswith("#")]
    for instr, a in instructions:
        if instr != "COPY" or "--from=" in a:
            continue
        *sources, _dest = [t for t in a.split() if not t.startswith("--")]
        for src in sources:
            assert (REPO / src).exists(), f"{path.name}: COPY {src}: not in the repository"
            first = src.strip("/").split("/")[0]
            assert not any(fnmatch.fnmatch(first, pat) for pat in ignored), f"{path.name}: {src} is .dockerignored"
    return instructions


@pytest.mark.timeout(60)
def test_server_dockerfile():
    instructions = _check_common_dockerfile(DOCKERFILE)
    stage = final_stage(instructions)
    assert [exec_form(a) for i, a in stage if i == "ENTRYPOINT"][-1] == IMAGE_ENTRYPOINT
    cmd = [exec_form(a) for i, a in stage if i == "CMD"][-1]
    assert cmd[:3] == ["serve", "--config", "/etc/batchd/config.yaml"]
    exposed = {p for i, a in stage if i == "EXPOSE" for p in a.split()}
    assert exposed == {str(GRPC_PORT), str(DATA_PORT)}, f"EXPOSE gRPC and the data plane, not {exposed}"
    assert cmd[cmd.index("--address") + 1] == f"0.0.0.0:{GRPC_PORT}"
    # the `docker run` example in the header publishes both, each under its own number
    run_example = re.search(r"^#\s+docker run .*$", DOCKERFILE.read_text(), flags=re.M)
    assert run_example, "the Dockerfile's header shows no `docker run`"
    published = re.findall(r"-p (\d+):(\d+)", run_example.group(0))
    assert sorted(published) == [(str(GRPC_PORT),) * 2, (str(DATA_PORT),) * 2], run_example.group(0)
    health = dockerfile_healthcheck_cmd(instructions)
    assert health[:2] == ["batchd", "health"]


@pytest.mark.timeout(60)
def test_trainer_dockerfile():
    instructions = _check_common_dockerfile(TRAINER_DOCKERFILE)
    cmd = [exec_form(a) for i, a in final_stage(instructions) if i == "CMD"][-1]
    assert cmd[:2] == ["python", "examples/train_fashion_mnist.py"]
    assert cmd[cmd.index("--address") + 1] == "batchd:50051"


@pytest.mark.timeout(60)
def test_dockerignore_keeps_the_context_small():
    patterns = {p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()}
    assert {".git", ".venv"} <= patterns


# ---- the example config ---------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_example_config_validates_and_its_pipeline_works_on_28x28x1():
    import albumentations as A

    from batchd.server.config import load_config

    config = load_config(EXAMPLE_CONFIG)
    assert {n: (d.kind, d.split) for n, d in config.datasets.items()} == {
        "fmnist-train": ("fashion-mnist", "train"),
        "fmnist-test": ("fashion-mnist", "test"),
    }
    assert all(str(d.root) == str(FMNIST_DIR) for d in config.datasets.values())

    spec = config.pipelines["train"]
    transform = A.from_dict(spec)
    # It round-trips: what A.to_dict writes for it is what the file holds.
    assert json.loads(json.dumps(A.to_dict(transform))) == json.loads(config.pipeline_json("train"))

    rng = np.random.default_rng(0)
    image = rng.integers(0, 256, (28, 28, 1), dtype=np.uint8)
    changed = 0
    for _ in range(50):
        out = transform(image=image)["image"]
        assert out.shape == (28, 28, 1) and out.dtype == np.uint8
        changed += not np.array_equal(out, image)
    assert 0 < changed < 50, "p=0.5 augmentations should change some images and leave others"


# ---- Makefile and CI --------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_makefile_installs_torch_first_and_lets_it_be_overridden():
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")

    def dry_run(*extra: str) -> list[str]:
        res = subprocess.run([make, "-n", "-B", "install", *extra], cwd=REPO, capture_output=True,
                             text=True, timeout=30, env={**os.environ, "CI": "true"})
        assert res.returncode == 0, res.stderr
        return res.stdout.splitlines()

    lines = dry_run()
    torch_line = next(i for i, line in enumerate(lines) if "pip install" in line and "torch" in line)
    package_line = next(i for i, line in enumerate(lines) if "pip install -e '.[client,test]'" in line)
    assert torch_line < package_line
    if shutil.which("nvidia-smi") is None:
        assert "'torch==2.13.0'" in lines[torch_line]

    lines = dry_run("TORCH_SPEC=torch==2.99.0", "TORCH_PIP_ARGS=--index-url https://example.invalid/cpu")
    assert any("--index-url https://example.invalid/cpu 'torch==2.99.0'" in line for line in lines)


@pytest.mark.timeout(60)
def test_ci_runs_make_test_then_the_containers():
    script = REPO / ".ci" / "run"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "set -euo pipefail" in text
    commands = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    assert commands[-2:] == ["make test", "make test-containers"]


@pytest.mark.timeout(60)
def test_make_test_containers_runs_the_real_engine_tests():
    """The target installs what it needs, then runs tests/containers with the switch that enables them."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    res = subprocess.run([make, "-n", "test-containers"], cwd=REPO, capture_output=True, text=True, timeout=30,
                         env={**os.environ, "CI": "true"})
    assert res.returncode == 0, res.stderr
    assert "docker.io docker-compose debootstrap" in res.stdout
    assert re.search(r"BATCHD_CONTAINER_TESTS=1 .*pytest .*tests/containers", res.stdout.replace("\\\n", " ")), res.stdout
