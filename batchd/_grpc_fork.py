"""gRPC's own fork handlers, turned off before gRPC is imported: training processes fork.

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

So importing batchd sets ``GRPC_ENABLE_FORK_SUPPORT=0`` unless the environment sets it. gRPC reads
it once, when it is imported, so ``batchd/__init__.py`` imports this module before anything
imports grpc. The cost: a process forked from one where gRPC runs cannot use gRPC itself (a new
channel there never connects); ``batchd.client.forks`` says so instead of hanging. A process that
imported grpc before batchd, or sets ``GRPC_ENABLE_FORK_SUPPORT=1``, keeps gRPC's handlers:
``FORK_HANDLERS`` is then True and a loader warns once.

The variable is inherited by subprocesses (the server's included), as any environment variable.
"""

from __future__ import annotations

import os
import sys

ENV = "GRPC_ENABLE_FORK_SUPPORT"
_OFF = ("0", "false", "f", "no", "n")

_imported_before = "grpc" in sys.modules  # then gRPC has read the variable already
_value = os.environ.get(ENV) if _imported_before else os.environ.setdefault(ENV, "0")

FORK_HANDLERS: bool = _value is None or _value.strip().lower() not in _OFF
"""Whether gRPC's fork handlers run in this process (gRPC's default when the variable is unset)."""
