"""A process that forks while a loader reads: the children live, the loader reads on, and a child
that touches the loader gets a RuntimeError saying where to create one (``batchd.client.forks``,
``batchd._grpc_fork``).

The server is a ``batchd serve`` subprocess: the forking process holds a client's gRPC state only,
as a training script does (an in-process server would fork a ``grpc.server`` too, which gRPC
never supports). Before the fix, gRPC's fork handlers restarted its threads in every child on the
parent's calls and sockets: about 1 DataLoader in 4 lost a worker to SIGSEGV, 1 ``preexec_fn``
child in 10 died of it, and a child could read the parent's stream.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import select
import signal
import subprocess
import sys

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import batchd
from helpers import free_port
from procs import ServerProcess, write_server_config

pytestmark = pytest.mark.timeout(120)

BATCH = 64  # fmnist-test, not shuffled: batch k holds samples k*64 .. k*64+63


class Numbers(Dataset):
    """A trivial map-style dataset: item i is tensor(i)."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


@pytest.fixture(scope="module")
def address(fmnist_root, tmp_path_factory):
    assert not batchd._grpc_fork.FORK_HANDLERS, "gRPC's fork handlers are on in the test process"
    server = ServerProcess(write_server_config(tmp_path_factory.mktemp("fork"), fmnist_root),
                           f"127.0.0.1:{free_port()}").start()
    try:
        yield server.address
    finally:
        server.kill()


def open_loader(address: str) -> batchd.RemoteDataLoader:
    return batchd.RemoteDataLoader(address, "fmnist-test", batch_size=BATCH, timeout=30, connect_timeout=10,
                                   reconnect_timeout=0)  # a stream the child broke would raise, not resume


def check_batch(batch: dict, k: int) -> None:
    assert torch.equal(batch["index"], torch.arange(k * BATCH, (k + 1) * BATCH)), f"batch {k} is not the one due"


def test_dataloader_workers_live_while_a_loader_reads(address):
    """20 times: a new loader, one batch read, then DataLoader(num_workers=2) forks its workers and
    is iterated while the loader reads a batch per DataLoader batch. 20 of 20 must complete."""
    failures = []
    for attempt in range(20):
        with open_loader(address) as loader:
            it = iter(loader)
            check_batch(next(it), 0)
            try:
                total, k = 0, 1
                for numbers in DataLoader(Numbers(), batch_size=4, num_workers=2, timeout=2):
                    total += int(numbers.sum())
                    check_batch(next(it), k)
                    k += 1
                assert total == sum(range(16))
            except (RuntimeError, AssertionError) as e:  # "DataLoader worker (pid N) exited unexpectedly"
                failures.append(f"attempt {attempt}: {type(e).__name__}: {e}")
            assert loader.stats()["reconnects"] == 0
    assert not failures, f"{len(failures)} of 20 DataLoaders failed:\n" + "\n".join(failures)


def test_a_loader_used_in_a_forked_child_raises(address):
    """The child: the parent's iterator and a new iteration raise RuntimeError saying to create the
    loader in the process that uses it; so does a new loader (gRPC cannot start there); close,
    dropping the iterator and the finalizers do nothing. The parent then reads on, same batches."""
    loader = open_loader(address)
    it = iter(loader)
    check_batch(next(it), 0)
    check_batch(next(it), 1)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report through the pipe, never return into pytest
        code = 1
        try:
            os.close(read)
            report = {}
            for name, use in (("next", lambda: next(it)), ("iter", lambda: next(iter(loader))),
                              ("new", lambda: open_loader(address))):
                try:
                    use()
                    report[name] = "no error"
                except Exception as e:
                    report[name] = f"{type(e).__name__}: {e}"
            loader.close()
            it.close()
            gc.collect()
            loader.servers.links[0].conn._finalizer()  # as at interpreter exit (weakref.finalize's atexit)
            report["stats"] = loader.stats()["batches"]
            os.write(write, json.dumps(report).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write)
    try:
        ready, _, _ = select.select([read], [], [], 30)
        data = os.read(read, 1 << 16) if ready else b""
        if not ready:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(read)
        status = os.waitpid(pid, 0)[1]
    assert os.waitstatus_to_exitcode(status) == 0, f"the child ended with {os.waitstatus_to_exitcode(status)}"
    report = json.loads(data)
    for name in ("next", "iter"):
        assert report[name].startswith("RuntimeError: this RemoteDataLoader was created in process"), report[name]
        assert "worker_init_fn" in report[name] and f"process {os.getpid()}" in report[name], report[name]
    assert report["new"].startswith("RuntimeError: cannot open a gRPC channel"), report["new"]
    assert "forked from process" in report["new"] and "spawn" in report["new"], report["new"]
    assert report["stats"] == 2
    for k in range(2, 12):  # the child's close and finalizers did not touch the parent's stream
        check_batch(next(it), k)
    assert loader.stats()["reconnects"] == 0
    loader.close()


def test_subprocess_with_preexec_fn_while_a_loader_reads(address):
    """20 subprocesses with a ``preexec_fn`` (Python code in the forked child before exec), each
    started while the loader reads: all exit 0 and the loader's batches are the ones due."""
    with open_loader(address) as loader:
        it = iter(loader)
        check_batch(next(it), 0)
        codes = []
        for k in range(1, 21):
            child = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=os.setpgrp)
            check_batch(next(it), k)
            codes.append(child.wait(30))
        assert codes == [0] * 20, codes
        assert loader.stats()["reconnects"] == 0


@pytest.mark.parametrize("code, env, expected", [
    ("import batchd", None, "None False"),  # off, and the environment as it was
    ("import batchd", "1", "1 True"),
    ("import grpc, batchd", None, "None True"),  # too late to turn the handlers off: the loader warns
])
def test_importing_batchd_turns_grpcs_fork_handlers_off(code, env, expected):
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    if env is not None:
        clean["GRPC_ENABLE_FORK_SUPPORT"] = env
    out = subprocess.run(
        [sys.executable, "-c", code + "; import os; print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'), "
                                      "batchd._grpc_fork.FORK_HANDLERS)"],
        env=clean, capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == expected


def test_a_loader_warns_once_where_grpcs_fork_handlers_are_on(monkeypatch, caplog):
    from batchd.client import forks

    monkeypatch.setattr(batchd._grpc_fork, "FORK_HANDLERS", True)
    monkeypatch.setattr(forks, "_warned_handlers", False)
    caplog.set_level(logging.WARNING, logger="batchd.client.loader")
    forks.warn_if_handlers()
    forks.warn_if_handlers()
    warnings = [r.getMessage() for r in caplog.records if "fork handlers are on" in r.getMessage()]
    assert len(warnings) == 1 and "GRPC_ENABLE_FORK_SUPPORT=0" in warnings[0], warnings


# what the processes below run: a fresh interpreter, so that nothing of this test process (its
# loaders, its channels) is in it
_SETTING_STAYS = """
import json, os, subprocess, sys, time
import batchd, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
report = {"environ": os.environ.get("GRPC_ENABLE_FORK_SUPPORT"), "handlers": batchd._grpc_fork.FORK_HANDLERS}
report["subprocess"] = subprocess.run(
    [sys.executable, "-c", "import os; print(os.environ.get('GRPC_ENABLE_FORK_SUPPORT'))"],
    capture_output=True, text=True, check=True).stdout.strip()
channel = grpc.insecure_channel(sys.argv[1])  # gRPC runs in this process: its threads are up
health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # with gRPC's fork handlers on, its threads would be restarted here
    time.sleep(0.5)
    os.write(write, str(len(os.listdir("/proc/self/task"))).encode())
    os._exit(0)
os.waitpid(pid, 0)
report["child_threads"] = int(os.read(read, 64))
report["parent_threads"] = len(os.listdir("/proc/self/task"))
print(json.dumps(report))
"""


def test_the_setting_stays_in_this_process(address):
    """The environment is the user's again once gRPC has read it: a subprocess does not inherit the
    setting, and the handlers are still off in this process (a forked child starts no gRPC thread)."""
    clean = {k: v for k, v in os.environ.items() if k != "GRPC_ENABLE_FORK_SUPPORT"}
    out = subprocess.run([sys.executable, "-c", _SETTING_STAYS, address], env=clean, capture_output=True, text=True,
                         timeout=60, check=True)
    report = json.loads(out.stdout)
    assert report["environ"] is None and report["subprocess"] == "None", report
    assert report["handlers"] is False, report
    assert report["parent_threads"] > 1 and report["child_threads"] == 1, report


_FORKED_CHILD_CONNECTS = """
import json, os, select, signal, sys, time
import batchd, grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
address, case = sys.argv[1:]
channel = grpc.insecure_channel(address)  # this process uses gRPC itself, outside batchd
health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=30, wait_for_ready=True)
if case == "closed":  # the parent's last channel closed: gRPC's threads end
    channel.close()
    deadline = time.monotonic() + 10
    while batchd._grpc_fork.grpc_running() and time.monotonic() < deadline:
        time.sleep(0.01)


def child():
    try:
        with batchd.RemoteDataLoader(address, "fmnist-test", batch_size=64, connect_timeout=2) as loader:
            result = f"read {len(next(iter(loader))['index'])}"
    except Exception as e:
        result = f"{type(e).__name__}: {e}"
    return json.dumps({"result": result})


read, write = os.pipe()
pid = os.fork()
if pid == 0:
    if case == "grandchild":  # a child that never used gRPC forks again
        inner = os.fork()
        if inner:
            os._exit(os.waitstatus_to_exitcode(os.waitpid(inner, 0)[1]))
    os.write(write, child().encode())
    os._exit(0)
os.close(write)  # a child that dies leaves the pipe at its end
ready, _, _ = select.select([read], [], [], 60)  # connect_timeout is 2 s: 60 s means it hung
if not ready:
    os.kill(pid, signal.SIGKILL)
status = os.waitpid(pid, 0)[1]
data = os.read(read, 1 << 16).decode() if ready else json.dumps({"result": "hung"})
print(data or json.dumps({"result": f"died: {os.waitstatus_to_exitcode(status)}"}))
"""


@pytest.mark.parametrize("case", ["child", "grandchild"])
def test_a_child_forked_from_a_process_using_grpc_raises_at_once(address, case):
    """The parent used gRPC itself (its own channel, not batchd's), then forked: in the child (or a
    child of that child) a new loader cannot connect, as gRPC cannot start there. It raises a
    RuntimeError naming the cause and what to do before any gRPC call (``check_grpc``'s, raised
    before the channel is made; not ``grpc_stalled``'s, raised once a call outlived its deadline):
    such a call hung past its deadline, or aborted the child (an absl mutex check in gRPC core; 13
    children in 40 died so with grpcio 1.85)."""
    out = subprocess.run([sys.executable, "-c", _FORKED_CHILD_CONNECTS, address, case], capture_output=True,
                         text=True, timeout=120, check=True)
    child = json.loads(out.stdout)
    result = child["result"]
    assert result.startswith("RuntimeError: cannot open a gRPC channel to 127.0.0.1:"), (result, out.stderr)
    assert "forked from process" in result and "a forked child of a gRPC-using process cannot start gRPC" in result
    assert "'spawn' or 'forkserver'" in result, result


def test_a_child_forked_after_the_parents_last_channel_closed_reads(address):
    """gRPC's threads ended with the parent's last channel: a child forked then starts gRPC afresh
    and reads."""
    out = subprocess.run([sys.executable, "-c", _FORKED_CHILD_CONNECTS, address, "closed"], capture_output=True,
                         text=True, timeout=120, check=True)
    assert json.loads(out.stdout)["result"] == f"read {BATCH}", out.stderr
