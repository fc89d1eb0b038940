"""Leases freed, on their way back to the server: ``Releases`` (one per server link).

A shared-memory batch's lease goes back when its tensors are freed (``weakref.finalize``) or when
it is dropped unread. That can happen in any thread, inside a garbage collection or a lock, so
``put`` takes no lock (a ``queue.SimpleQueue``). While the server's call is open, its next message
carries them (``take``, from gRPC's request thread: ``batchd.client.transport.outbox``); after
the call (the loader closed with batches still held), ``drain`` sends them by ReleaseLeases as
they come, until nothing of the session is held. Leases of a session that ended (the server
restarted: it took every slot back) are dropped.
"""

from __future__ import annotations

import queue
from typing import Any

DRAIN_POLL_S = 0.25  # after the call: how often freed leases are looked for and idle mappings swept (seconds)


class Releases:
    """Leases freed and not yet told to the server, as (session, lease)."""

    __slots__ = ("_queue",)

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()

    def put(self, session: str, lease: int) -> None:
        """A lease was freed (any thread; finalizers too: no lock)."""
        self._queue.put((session, lease))

    def pending(self) -> bool:
        """Whether a freed lease waits (no lock)."""
        return not self._queue.empty()

    def take(self, shm: Any) -> list[int]:
        """Every lease waiting that belongs to ``shm`` (the call's ``SharedMemorySession``; those
        of another session are dropped: it ended)."""
        out: list[int] = []
        while True:
            try:
                session, lease = self._queue.get_nowait()
            except queue.Empty:
                return out
            if shm is not None and session == shm.session:
                out.append(lease)

    def drain(self, conn: Any) -> None:
        """After the call: release what is freed by ReleaseLeases (``conn.release``, retried) as it
        comes, until ``conn``'s session holds nothing (or ended), sweeping idle mappings meanwhile."""
        shm = conn.shm
        while shm is not None and shm.outstanding and not shm.gone:
            try:
                first = self._queue.get(timeout=DRAIN_POLL_S)
            except queue.Empty:
                shm.sweep()
                continue
            leases = [first]
            while True:
                try:
                    leases.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            mine = [lease for session, lease in leases if session == shm.session]
            if mine and not conn.release(shm.session, mine):
                return
            shm.forget(mine)
