"""Where a benchmark's processes run: one core for the training loop, the rest for everything else.

On one machine the server's workers, its main process, batchd's relay and the training loop share
the cores, and the scheduler moves them between cores as it likes: a remote server runs on
another host, and a trainer's host has cores to spare for its relay. ``loop_alone()`` is the
nearest a small machine comes to that: the calling thread (the training loop) on the first CPU
this process may use, every other thread of this process tree (the loop's other threads, the
relay, a server started under it, their workers) on the others. Linux only (``os.sched_setaffinity``
per thread, /proc for the tree).
"""

from __future__ import annotations

import contextlib
import os
import threading

from bench.measure import scan_processes


def tree(root: int) -> list[int]:
    """``root`` and every process under it (pids), from /proc."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in scan_processes().items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def pin(pids: list[int], cpus: set[int]) -> None:
    """Every live thread of each process in ``pids`` on ``cpus`` (threads that end meanwhile are skipped)."""
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):
                os.sched_setaffinity(int(tid), cpus)


def possible() -> bool:
    """Whether there are two CPUs to split (and the calls to split them)."""
    return hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) >= 2


@contextlib.contextmanager
def loop_alone():
    """Within the block, the calling thread alone on the first CPU; this process tree's other threads
    and processes (threads started meanwhile inherit their creator's) on the remaining ones. Every
    thread of the tree gets all the CPUs back at the end. Requires ``possible()``."""
    cpus = sorted(os.sched_getaffinity(0))
    me = threading.get_native_id()
    pin(tree(os.getpid()), set(cpus[1:]))
    os.sched_setaffinity(me, {cpus[0]})
    try:
        yield
    finally:
        pin(tree(os.getpid()), set(cpus))
