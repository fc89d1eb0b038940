"""gRPC's own fork handlers, turned off for this process: training processes fork.

With its fork support on (the grpcio wheels' default), gRPC core installs ``pthread_atfork``
handlers that restart its threads (event engine, timers, executor) in every child, on a copy of the
parent's state: the parent's calls, and its epoll set and sockets, which the two processes then
share. Measured with grpcio 1.85 while a ``RemoteDataLoader`` read (``tests/client/test_fork.py``):
2 to 7 of 20 ``DataLoader(num_workers=2)`` lost a worker to SIGSEGV, about 1 ``subprocess`` with
``preexec_fn`` in 12 died (SIGSEGV, or SIGABRT on a gRPC check) before its ``exec``, and once
the parent's own stream went wrong ("the server sent batch 40 where batch 38 was due").
gRPC's documented setting, ``GRPC_ENABLE_FORK_SUPPORT=1`` with ``GRPC_POLL_STRATEGY=poll`` or
``epoll1`` (grpc ``doc/fork_support.md``; its Python handler then closes every channel in the
child and waits for gRPC to shut down), left 2 to 4 DataLoaders of 20 waiting for a worker until
their timeout instead. With the handlers off, a child starts no gRPC thread and never touches the
parent's sockets: 100 DataLoaders of 100 lived.

So importing batchd imports grpc with ``GRPC_ENABLE_FORK_SUPPORT=0`` in the environment, unless
the environment sets the variable, and then puts the environment back as it was: the effect stays
in this process. gRPC reads the variable while it is imported (grpcio 1.85: its core and its Cython
layer both; ``tests/client/test_fork.py`` checks that a process whose variable is gone again still
starts no gRPC thread in a forked child), so ``batchd/__init__.py`` imports this module before
anything imports grpc, and importing batchd costs grpc's import (about 30 ms) where it did not
import it before.

What remains:

* a process forked from this one (no ``exec``: ``DataLoader`` workers, ``multiprocessing``'s fork)
  inherits the handlers off, which is the point, and so cannot start gRPC itself if gRPC's
  threads ran here at the fork (this process had a channel or a server open, batchd's or its
  own): ``batchd.client.forks`` says so (RuntimeError) before any gRPC call, which would hang or
  abort the child;
* a subprocess that runs a new program (``subprocess``, ``spawn``, ``forkserver``) gets the
  user's environment, not batchd's setting: if it imports batchd it turns the handlers off itself,
  if it uses grpc without batchd it gets grpc's default (on);
* a process that imported grpc before batchd, or sets ``GRPC_ENABLE_FORK_SUPPORT=1``, keeps
  gRPC's handlers: ``FORK_HANDLERS`` is then True and a loader warns once.
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_ENABLE_FORK_SUPPORT"
_OFF = ("0", "false", "f", "no", "n")

_imported_before = "grpc" in sys.modules  # then gRPC has read the variable already
_value = os.environ.get(ENV)
if not _imported_before and _value is None:
    _value = os.environ[ENV] = "0"
    try:
        import grpc  # noqa: F401  (it reads the variable now)
    except ImportError:  # no grpcio: nothing here uses gRPC
        pass
    finally:
        os.environ.pop(ENV, None)  # the user's environment again, for every subprocess

FORK_HANDLERS: bool = _value is None or _value.strip().lower() not in _OFF
"""Whether gRPC's fork handlers run in this process (gRPC's default when the variable is unset)."""

GRPC_THREADS = ("grpc_", "event_engine", "lifeguard")
"""How gRPC core's threads begin their names in ``/proc/self/task/*/comm`` (grpcio 1.85:
``grpc_global_tim``, ``event_engine``, ``lifeguard``). They run from a process's first channel or
server until its last is closed."""

FORKED_FROM_GRPC: int | None = None
"""In a process forked (without exec) from one where gRPC's threads ran at the fork, or from a
descendant of such a process: that process's pid. gRPC cannot start here (``batchd.client.forks``):
its state is a copy of one that threads were using, and its first call hangs or aborts the process
(an absl mutex check, ``Mutex::Fer with pending CondVar queueing``, 13 children in 40 with grpcio
1.85). None elsewhere. Kept here, imported with batchd, so that every fork after ``import batchd``
is seen."""

FORKED_WITH_GRPC_LOADED: int | None = None
"""In a process forked (without exec) from one that had imported gRPC (running or not): the
nearest such ancestor's pid. Where gRPC's threads ran under names ``GRPC_THREADS`` does not know,
only this says why a call outlived its deadline (``batchd.client.forks.grpc_stalled``)."""

_pid = os.getpid()
_running_at_fork = False


def grpc_running() -> bool:
    """Whether one of gRPC core's threads (``GRPC_THREADS``) runs in this process now."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # no /proc: unknown, as if none ran
        return False
    for tid in tids:
        if tid == str(_pid):  # the main thread carries the program's name, which the user may set
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().startswith(GRPC_THREADS):
                    return True
        except OSError:  # the thread ended meanwhile
            continue
    return False


def _before_fork() -> None:
    global _running_at_fork
    _running_at_fork = "grpc._cython.cygrpc" in sys.modules and grpc_running()


def _after_in_child() -> None:
    global FORKED_FROM_GRPC, FORKED_WITH_GRPC_LOADED, _pid
    if _running_at_fork:
        FORKED_FROM_GRPC = _pid
    if "grpc._cython.cygrpc" in sys.modules:
        FORKED_WITH_GRPC_LOADED = _pid
    _pid = os.getpid()


os.register_at_fork(before=_before_fork, after_in_child=_after_in_child)
