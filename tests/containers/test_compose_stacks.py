"""The three Compose stacks, run to the end in a real Docker engine (``make test-containers``).

tests/deploy/test_deploy.py validates the Compose files and runs their commands on this machine;
here the images are built and the stacks run as a user runs them, and each is judged from
outside the code under test:

* the trainer (examples/train_fashion_mnist.py, as the stack runs it) exits 0 with a test
  accuracy of at least ``MIN_ACCURACY`` after its 2 epochs (0.88-0.90 is usual);
* the transport each server used, from both ends: the trainer's own figures (it prints each
  loader's ``bytes_received`` per transport and ``batches_per_server``) and the server's totals
  (``batchd status --json`` inside its container): shared memory for the sidecar (no data
  connection, no byte copied for the socket), the data plane for the TCP and pool servers
  (connections accepted, bytes sent; nothing inline);
* the TCP stack's server is read from this host through its published ports, gRPC 50051 and
  the data plane on 50052 (the gRPC port + 1, the port its log says it listens on), and the
  images it sends equal the Fashion-MNIST test file decoded here with gzip and numpy.

Skipped unless ``BATCHD_CONTAINER_TESTS=1`` (the make target sets it): it needs root, the
Debian mirror and PyPI, and about ten minutes.
"""

from __future__ import annotations

import gzip
import json
import os
import pathlib
import re

import numpy as np
import pytest
import yaml

import compose_stacks
from engine_fixtures import engine, images, logs_dir, run_id  # noqa: F401 (pytest fixtures)

REPO = pathlib.Path(__file__).resolve().parents[2]
COMPOSE_FILE = REPO / "docker-compose.yml"
COMPOSE_POOL_FILE = REPO / "docker-compose.pool.yml"
COMPOSE_TCP_FILE = REPO / "docker-compose.tcp.yml"
FMNIST_TEST_IMAGES = pathlib.Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")
MIN_ACCURACY = 0.85
TRAINER_TIMEOUT_S = 1200  # 2 epochs of 60,000 images: 2 minutes on 2 idle cores, 10 on a loaded machine
GRPC_PORT, DATA_PORT = 50051, 50052  # the data plane's default: the gRPC port + 1

pytestmark = [
    pytest.mark.skipif(os.environ.get("BATCHD_CONTAINER_TESTS") != "1", reason="the real-engine tests run with `make test-containers`"),
    # the first test also waits for debootstrap and the image builds (session fixtures)
    pytest.mark.timeout(3000),
]


# ---- reading the results ------------------------------------------------------------------------


def trainer_result(log: str) -> tuple[float, dict[str, dict]]:
    """The final test accuracy and each loader's transport line (``train``, ``test``) of the
    example trainer's output; fails the test naming what is missing."""
    accuracy = re.findall(r"^test accuracy: ([0-9.]+)$", log, flags=re.M)
    loaders = {m.group(1): json.loads(m.group(2)) for m in re.finditer(r"^(train|test) loader: (\{.*\})$", log, re.M)}
    if not accuracy or set(loaders) != {"train", "test"}:
        pytest.fail(f"the trainer did not print its accuracy and both loaders' figures:\n{log[-3000:]}")
    return float(accuracy[-1]), loaders


def server_address(file: pathlib.Path, service: str) -> str:
    """The address ``service``'s healthcheck probes inside its container (where it listens)."""
    test = yaml.safe_load(file.read_text())["services"][service]["healthcheck"]["test"]
    return test[test.index("health") + 1]


def totals(stack, service: str) -> dict:
    """The server's ``StatsTotals`` (``batchd status --json``, run in its container)."""
    out = stack.exec(service, "batchd", "status", server_address(stack.file, service), "--json", "--timeout", "10")
    return json.loads(out)["totals"]


def finished_trainer(stack, logs_dir: pathlib.Path) -> tuple[float, dict[str, dict], str]:
    """Wait for the trainer; (accuracy, loaders' figures, its log) once it exited 0."""
    code = stack.wait("trainer", timeout=TRAINER_TIMEOUT_S)
    log = stack.logs("trainer")
    assert code == 0, f"the trainer exited {code} (logs in {logs_dir}):\n{log[-3000:]}"
    accuracy, loaders = trainer_result(log)
    assert accuracy >= MIN_ACCURACY, f"test accuracy {accuracy} < {MIN_ACCURACY}:\n{log[-3000:]}"
    return accuracy, loaders, log


def received(loaders: dict[str, dict]) -> dict[str, int]:
    """Bytes received per transport, both loaders together."""
    out = dict.fromkeys(("shm", "socket", "inline"), 0)
    for figures in loaders.values():
        for transport, n in figures["bytes_received"].items():
            out[transport] += n
    return out


def fmnist_test_images() -> np.ndarray:
    """uint8 [10000, 28, 28]: the IDX file's pixels, read without batchd (16-byte header)."""
    with gzip.open(FMNIST_TEST_IMAGES, "rb") as f:
        data = f.read()
    assert int.from_bytes(data[:4], "big") == 0x0803 and int.from_bytes(data[4:8], "big") == 10_000
    return np.frombuffer(data, np.uint8, offset=16).reshape(10_000, 28, 28)


# ---- the stacks ---------------------------------------------------------------------------------


def test_sidecar_stack_trains_over_shared_memory(images, run_id, logs_dir):
    """docker-compose.yml: the trainer in the server's IPC namespace, on its unix socket."""
    with compose_stacks.running(COMPOSE_FILE, f"batchd-test-{run_id}-sidecar", logs_dir / "compose.log") as stack:
        _, loaders, _ = finished_trainer(stack, logs_dir)
        server = totals(stack, "batchd")
    got = received(loaders)
    assert got["shm"] > 0 and got["socket"] == 0 and got["inline"] == 0, got
    assert server["batches_sent"] > 0 and server["data_connections_accepted"] == 0, server
    assert server["bytes_copied_socket"] == 0 and server["bytes_copied_inline"] == 0, server


def test_pool_stack_reads_the_sidecar_over_shared_memory_and_the_remote_over_the_data_plane(images, run_id, logs_dir):
    """docker-compose.pool.yml: one loader over the sidecar's socket and batchd-remote:50051."""
    with compose_stacks.running(COMPOSE_POOL_FILE, f"batchd-test-{run_id}-pool", logs_dir / "compose.log") as stack:
        _, loaders, log = finished_trainer(stack, logs_dir)
        sidecar, remote = totals(stack, "batchd"), totals(stack, "batchd-remote")
    # the remote server by the address its name resolved to (IP:50051), the sidecar by its socket
    socket_address = server_address(COMPOSE_POOL_FILE, "batchd")
    per_server = loaders["train"]["batches_per_server"]
    remote_address = [a for a in per_server if a != socket_address]
    assert len(remote_address) == 1 and remote_address[0].endswith(f":{GRPC_PORT}"), per_server
    assert per_server.get(socket_address, 0) > 0 and per_server[remote_address[0]] > 0, per_server
    got = received(loaders)
    assert got["shm"] > 0 and got["socket"] > 0 and got["inline"] == 0, got
    assert sidecar["data_connections_accepted"] == 0 and sidecar["bytes_copied_socket"] == 0, sidecar
    assert remote["data_connections_accepted"] >= 1 and remote["data_plane_bytes_sent"] > 0, remote
    assert remote["bytes_copied_inline"] == 0, remote
    # the remote server's shared memory is not the trainer's: said once per loader (2), not per epoch
    notices = re.findall(rf"shared memory with {re.escape(remote_address[0])} is unavailable", log)
    assert len(notices) == len(loaders), log[-3000:]


def test_tcp_stack_trains_over_the_data_plane_and_serves_it_on_the_published_port(images, run_id, logs_dir):
    """docker-compose.tcp.yml: the trainer on batchd:50051 (data plane batchd:50052); then this
    host reads the server through the ports the stack publishes."""
    import batchd

    with compose_stacks.running(COMPOSE_TCP_FILE, f"batchd-test-{run_id}-tcp", logs_dir / "compose.log") as stack:
        _, loaders, _ = finished_trainer(stack, logs_dir)
        before = totals(stack, "batchd")
        server_log = stack.logs("batchd")
        listening = set(re.findall(r"data plane on \S*?:(\d+)\b", server_log))
        assert listening == {str(DATA_PORT)}, f"the data plane should listen on {DATA_PORT}:\n{server_log[-3000:]}"
        container = stack.container("batchd")
        for port in (GRPC_PORT, DATA_PORT):
            published = compose_stacks.docker("port", container, f"{port}/tcp").stdout
            assert re.search(rf":{port}$", published, re.M), f"port {port} is not published as {port}: {published!r}"

        expected = fmnist_test_images()
        with batchd.RemoteDataLoader(f"127.0.0.1:{GRPC_PORT}", "fmnist-test", batch_size=1000,
                                     transport="socket", connect_timeout=30) as loader:
            seen = []
            for batch in loader:
                index = batch["index"].numpy()
                assert np.array_equal(batch["image"].numpy()[..., 0], expected[index]), "wrong image bytes"
                seen.append(index.copy())
            mine = loader.stats()["bytes_received"]
        after = totals(stack, "batchd")
    got = received(loaders)
    assert got["socket"] > 0 and got["shm"] == 0 and got["inline"] == 0, got
    assert before["data_connections_accepted"] >= 1 and before["bytes_copied_inline"] == 0, before
    assert np.array_equal(np.concatenate(seen), np.arange(10_000)), "every sample once, in order (no shuffle)"
    assert mine["socket"] > 0 and mine["inline"] == 0 and mine["shm"] == 0, mine
    assert after["data_connections_accepted"] > before["data_connections_accepted"], (before, after)
    assert after["data_plane_bytes_sent"] - before["data_plane_bytes_sent"] >= expected.nbytes, (before, after)
