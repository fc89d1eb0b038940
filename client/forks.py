"""A loader belongs to the process that made it: what the client does in a forked child.

Training scripts fork while a loader reads: ``DataLoader`` workers (``num_workers > 0``), a
multiprocessing pool, ``subprocess`` with ``preexec_fn``. The child is a copy of the parent made
by one thread: the loader's threads (receivers, the lease reporter, the prober, the CUDA register
helper) do not exist there, the locks they held stay held, and its gRPC channels and calls are
the parent's sockets. gRPC's own fork handlers are off (``batchd._grpc_fork``), so in a child:

* nothing of the client calls into gRPC, CUDA, or waits on a thread or a lock. The finalizers,
  ``close`` and ``Receiver.stop`` of objects made in another process do nothing (``owner``,
  ``in_owner``): they must neither cancel the parent's calls nor close its channels, nor
  unregister its memory from CUDA. Without this guard a child that stopped the parent's stream
  hung in each of 5 tries, in grpc's ``cancel``, on the lock of a call object that the parent's
  receiver thread held at the fork.
* every object holding gRPC or CUDA state that the parent made (``keep``: connections,
  receivers, transfers) is held for the child's whole life (``hold``), so none is freed there:
  grpc's ``__del__`` takes that same lock to cancel a call, and closes channels. What is held is
  the parent's memory, copied; a child that exits through ``os._exit`` (multiprocessing,
  DataLoader workers) or ``exec`` (subprocess) never frees it anyway.
* using the parent's loader raises RuntimeError (``check``), and so does opening a channel
  (``check_grpc``) where gRPC's threads ran in the parent at the fork (any channel or server,
  batchd's or the program's own: ``batchd._grpc_fork.FORKED_FROM_GRPC``): gRPC cannot start in
  such a child, whose first call would hang or abort the process. That is the price of the
  handlers being off. A child forked before the parent's first channel, or after its last was
  closed, may use gRPC.
* should gRPC's threads ever run under names ``_grpc_fork`` does not know, the connection's
  first call never ends, not even at its own deadline (gRPC's timers do not run in the child):
  ``channel.wait_for_server`` gives up on it and raises ``grpc_stalled``'s RuntimeError.

Nothing runs before a fork: the parent's streams go on undisturbed, and pausing them at every
fork (DataLoader forks its workers each epoch) would buy nothing once a child never enters gRPC.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from typing import Any, Callable

from batchd import _grpc_fork

log = logging.getLogger("batchd.client.loader")

_pid = os.getpid()  # this process; reset in each child
_kept: weakref.WeakSet = weakref.WeakSet()  # objects holding gRPC or CUDA state made in this process
_HELD: list = []  # in a child: what the parent's loaders left here, never freed
ctypes.pythonapi.Py_IncRef(ctypes.py_object(_HELD))  # (not even at interpreter exit, when modules are cleared)
_warned_handlers = False

ADVICE = ("Create the loader in the process that uses it, after that process started: e.g. in a DataLoader's "
          "worker_init_fn, with workers started by multiprocessing_context='spawn' or 'forkserver' "
          "(batchd.client.forks)")


def owner() -> int:
    """The pid to remember as an object's owner: this process's."""
    return _pid


def forked(pid: int) -> bool:
    """Whether this process is a fork of process ``pid`` (an object's ``owner()``), not ``pid`` itself."""
    return pid != _pid


def check(pid: int, what: str = "this RemoteDataLoader") -> None:
    """Raises RuntimeError if this process is not ``pid``, the one that made ``what``."""
    if forked(pid):
        raise RuntimeError(f"{what} was created in process {pid}, and this is process {os.getpid()}, a fork of it, "
                           f"where its gRPC channels and threads do not exist. {ADVICE}.")


def in_owner(pid: int, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn``, called only in process ``pid`` (a finalizer's or an atexit hook's callback); elsewhere a no-op."""
    def call(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, **kwargs) if pid == _pid else None
    return call


def keep(obj: Any) -> None:
    """``obj`` holds gRPC or CUDA state: a child forked while it lives holds it until it exits."""
    _kept.add(obj)


def hold(obj: Any) -> None:
    """Never free ``obj`` in this process (a forked child: e.g. the parent's stream generators)."""
    _HELD.append(obj)


def check_grpc(what: str) -> None:
    """Before opening a channel to ``what``: raises RuntimeError where gRPC cannot start (a fork of
    a process where gRPC's threads ran, with gRPC's fork handlers off)."""
    parent = _grpc_fork.FORKED_FROM_GRPC
    if parent is not None and not _grpc_fork.FORK_HANDLERS:
        raise RuntimeError(f"cannot open a gRPC channel to {what} in process {os.getpid()}: " + _cause(parent))


def grpc_stalled(what: str, deadline: float) -> RuntimeError | None:
    """The error for a gRPC call that its own deadline (``deadline`` seconds) did not end, in a
    process forked from one that had loaded gRPC (whose threads ``check_grpc`` did not recognise).
    None in any other process (the caller reports what it would report for a call that timed out)."""
    parent = _grpc_fork.FORKED_WITH_GRPC_LOADED
    if _grpc_fork.FORK_HANDLERS or parent is None:
        return None
    return RuntimeError(f"cannot use gRPC in process {os.getpid()} (a call to {what} did not end even at its own "
                        f"deadline, {deadline:g} s): " + _cause(parent))


def _cause(parent: int) -> str:
    return (f"this process was forked from process {parent} while gRPC ran there, and a forked child of a gRPC-using "
            f"process cannot start gRPC (its fork handlers are off: GRPC_ENABLE_FORK_SUPPORT=0, batchd._grpc_fork). "
            f"Start this process with the 'spawn' or 'forkserver' method instead (multiprocessing.get_context('spawn'), "
            f"DataLoader(multiprocessing_context='spawn')) and create the loader in it, e.g. in worker_init_fn; or fork "
            f"while the parent has no gRPC channel or server open.")


def warn_if_handlers() -> None:
    """Once per process: say that forks may crash where gRPC's fork handlers are on."""
    global _warned_handlers
    if _grpc_fork.FORK_HANDLERS and not _warned_handlers:
        _warned_handlers = True
        log.warning("gRPC's fork handlers are on in this process (grpc was imported before batchd, or %s is set): a "
                    "process forked while a loader reads (DataLoader workers, subprocess with preexec_fn) may crash; "
                    "import batchd before grpc, or set %s=0", _grpc_fork.ENV, _grpc_fork.ENV)


def _after_in_child() -> None:
    global _pid, _kept
    _pid = os.getpid()
    _HELD.extend(_kept)
    _kept = weakref.WeakSet()


os.register_at_fork(after_in_child=_after_in_child)
