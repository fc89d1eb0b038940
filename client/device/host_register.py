"""Shared-memory mappings registered with CUDA (``cudaHostRegister``), from one helper thread.

A copy to the GPU straight from a server's slot needs the slot's mapping registered (page-locked
and known to the driver). torch's binding (``torch.cuda.cudart().cudaHostRegister``) returns
CUDA's error code and leaves the error pending in the calling thread: the next kernel launched
there (a receiver thread's first ``gpu_transform``) would raise it as its own error. So every
register and unregister runs in one helper thread of the registry's own; a refusal is logged
with CUDA's text (``cudaGetErrorString``), cleared in that thread (``cudaGetLastError``), and
reported as False: the transfer then copies through pinned buffers.

The mapping stays read-only (``cudaHostRegisterReadOnly``): a writable one would let a copy
write through to the slot that other readers share (client/transport/shm.py). A device without read-only
registration refuses it, which is such a refusal.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from batchd.client import forks

log = logging.getLogger(__name__)

PORTABLE, READ_ONLY = 0x01, 0x08  # cudaHostRegisterPortable, cudaHostRegisterReadOnly
FLAGS = PORTABLE | READ_ONLY
_CUDART_NAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so")


def clear_last_error() -> None:
    """``cudaGetLastError()`` in this thread, through the CUDA runtime this process has loaded
    (``RTLD_NOLOAD``: never a second copy, whose error state would be another). Nothing if none
    is loaded by those names (a torch with the runtime linked in): the error then stays pending in
    the registry's helper thread, which launches no kernel that could raise it."""
    for name in _CUDART_NAMES:
        try:
            runtime = ctypes.CDLL(name, mode=getattr(os, "RTLD_NOLOAD", 0) | ctypes.RTLD_LOCAL)
        except OSError:
            continue
        runtime.cudaGetLastError()
        return


class HostRegistry:
    """Host memory registered with CUDA, every call made from one helper thread. Thread-safe.

    runtime: has ``cudaHostRegister(address, size, flags)``, ``cudaHostUnregister(address)``
    (returning CUDA's error code, 0 for success) and ``cudaGetErrorString(code)``:
    ``torch.cuda.cudart()``. bind: called once in the helper thread before its first call (make
    the loader's device current there, so no context is made on another GPU). clear_error: called
    in the helper thread after a refused call (``clear_last_error``). flags: cudaHostRegister's.
    """

    def __init__(self, runtime: Any, *, bind: Callable[[], None] | None = None,
                 clear_error: Callable[[], None] | None = clear_last_error, flags: int = FLAGS):
        self._runtime = runtime
        self._clear_error = clear_error
        self.flags = flags
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batchd-cuda-register", initializer=bind)
        self._lock = threading.Lock()
        self._registered: dict[int, int] = {}  # address -> bytes
        self._closed = False
        self._owner = forks.owner()  # a forked child has no CUDA context and no helper thread: no calls there

    @property
    def registered(self) -> dict[int, int]:
        """address -> bytes of what is registered now (a copy)."""
        with self._lock:
            return dict(self._registered)

    def register(self, address: int, size: int) -> bool:
        """Register ``size`` bytes at ``address`` (once). False, logged with CUDA's reason, if CUDA
        refuses, the helper thread cannot start, or the registry is closed (False in a forked child)."""
        if forks.forked(self._owner):
            return False
        with self._lock:
            if address in self._registered:
                return True
            if self._closed:
                return False
            refused = self._call("cudaHostRegister", address, size, self.flags)
            if refused is not None:
                log.warning("cudaHostRegister of a shared-memory segment (%d bytes) failed: %s; copying its "
                            "batches through pinned buffers", size, refused)
                return False
            self._registered[address] = size
            return True

    def unregister(self, address: int) -> None:
        """Undo ``register`` (the caller guarantees no copy from it is in flight); nothing if
        ``address`` is not registered (or the registry closed, which unregistered it), or in a
        forked child."""
        if forks.forked(self._owner):
            return
        with self._lock:
            if self._registered.pop(address, None) is None:
                return
            refused = self._call("cudaHostUnregister", address)
        if refused is not None:
            log.warning("cudaHostUnregister of a shared-memory segment failed: %s", refused)

    def close(self) -> None:
        """Unregister everything still registered and end the helper thread. Idempotent. Nothing in
        a forked child."""
        if forks.forked(self._owner):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for address in list(self._registered):
                refused = self._call("cudaHostUnregister", address)
                if refused is not None:
                    log.warning("cudaHostUnregister of a shared-memory segment failed: %s", refused)
            self._registered.clear()
        self._executor.shutdown(wait=True)

    def _call(self, name: str, *args: Any) -> str | None:
        """``runtime.<name>(*args)`` in the helper thread: None, or why it failed."""
        try:
            return self._executor.submit(self._in_helper, name, *args).result()
        except Exception as e:  # the helper thread could not start (bind failed: BrokenThreadPool)
            return f"{type(e).__name__}: {e}"

    def _in_helper(self, name: str, *args: Any) -> str | None:
        code = getattr(self._runtime, name)(*args)
        if int(code) == 0:
            return None
        try:
            return f"{self._runtime.cudaGetErrorString(code)} (CUDA error {int(code)})"
        finally:
            if self._clear_error is not None:
                self._clear_error()
