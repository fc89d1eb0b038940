"""HostRegistry: cudaHostRegister and cudaHostUnregister from one helper thread, a refusal logged
and cleared there, never left pending in a receiver thread.

CUDA cannot run here, so a small model of its runtime stands in, with the semantics that matter:
each host thread has its own last error; a failed call sets it; ``cudaGetLastError`` returns and
clears it; a kernel launch (torch's launch check) raises it as the launch's own error. The real
runtime is tests/cuda/test_cuda_transfer.py's (a forced refusal through the loader).
"""

from __future__ import annotations

import logging
import threading

import pytest

from batchd.client.device.host_register import FLAGS, HostRegistry, clear_last_error

pytestmark = pytest.mark.timeout(60)

INVALID_VALUE = 1  # cudaErrorInvalidValue


class ModelRuntime:
    """The registration calls of CUDA's runtime, with its per-thread last error. Refuses the
    addresses in ``refuse``."""

    def __init__(self, refuse: set[int] = frozenset()):
        self.refuse = set(refuse)
        self.last_error: dict[int, int] = {}  # thread id -> pending error
        self.threads: list[tuple[str, int]] = []  # (call, thread id)
        self.registered: dict[int, int] = {}

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.threads.append(("register", threading.get_ident()))
        if address in self.refuse or flags != FLAGS:
            self.last_error[threading.get_ident()] = INVALID_VALUE
            return INVALID_VALUE
        self.registered[address] = size
        return 0

    def cudaHostUnregister(self, address: int) -> int:
        self.threads.append(("unregister", threading.get_ident()))
        self.registered.pop(address)
        return 0

    def cudaGetErrorString(self, code: int) -> str:
        return {INVALID_VALUE: "invalid argument"}[code]

    def cudaGetLastError(self) -> int:
        return self.last_error.pop(threading.get_ident(), 0)

    def launch_kernel(self) -> None:
        """What torch's launch check does after a kernel launch in this thread."""
        code = self.cudaGetLastError()
        if code:
            raise RuntimeError(f"CUDA error: {self.cudaGetErrorString(code)}")


def test_a_refused_registration_leaves_no_error_in_the_receivers_thread(caplog):
    runtime = ModelRuntime(refuse={0x2000})
    registry = HostRegistry(runtime, clear_error=runtime.cudaGetLastError)
    with caplog.at_level(logging.WARNING, logger="batchd.client.device.host_register"):
        assert registry.register(0x1000, 4096) is True
        assert registry.register(0x2000, 8192) is False
    runtime.launch_kernel()  # this (the receiver's) thread launches its next kernel: no inherited error
    assert runtime.last_error == {}, "the refusal is still pending in the helper thread"
    assert "cudaHostRegister of a shared-memory segment (8192 bytes) failed: invalid argument (CUDA error 1)" \
        in caplog.text
    assert registry.registered == {0x1000: 4096}
    registry.close()


def test_every_call_runs_in_one_helper_thread_bound_first():
    runtime = ModelRuntime()
    bound: list[int] = []
    registry = HostRegistry(runtime, bind=lambda: bound.append(threading.get_ident()))
    callers = [threading.Thread(target=lambda k=k: [registry.register(0x1000 * (4 * k + i + 1), 64) for i in range(4)])
               for k in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    registry.unregister(0x1000)
    helpers = {ident for _, ident in runtime.threads}
    assert len(bound) == 1 and helpers == set(bound)
    assert not helpers & ({t.ident for t in callers} | {threading.get_ident()})
    assert len(runtime.registered) == 11
    registry.close()
    assert runtime.registered == {}, "close leaves memory registered"


def test_after_close_nothing_registers_and_unregister_is_a_no_op():
    runtime = ModelRuntime()
    registry = HostRegistry(runtime)
    assert registry.register(0x1000, 64)
    registry.close()
    registry.close()
    assert runtime.registered == {} and registry.registered == {}
    assert registry.register(0x2000, 64) is False
    registry.unregister(0x1000)
    assert [call for call, _ in runtime.threads] == ["register", "unregister"]


def test_a_helper_thread_that_cannot_bind_is_a_refusal(caplog):
    def bind():
        raise RuntimeError("CUDA error: invalid device ordinal")

    registry = HostRegistry(ModelRuntime(), bind=bind)
    with caplog.at_level(logging.WARNING, logger="batchd.client.device.host_register"):
        assert registry.register(0x1000, 64) is False
    assert "failed: BrokenThreadPool" in caplog.text
    registry.close()


def test_clearing_without_a_loaded_cuda_runtime_does_nothing():
    clear_last_error()  # no libcudart in this process: nothing loaded, nothing raised
