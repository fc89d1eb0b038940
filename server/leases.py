"""Slots lent to same-host clients, and the sessions that hold them.

A client on the server's host opens a session (``OpenSession``, a call that stays open). A
batch sent over the shared-memory transport stays in its slot; the slot is *lent* to the
session under a lease id until the client releases it (``ReleaseLeases``, sent when the
tensors on it are freed) or the session ends (the client closed it, crashed, or was
disconnected). A session holds at most ``max_held`` leases: past that, batches are sent
inline, so a caller that keeps every batch (``list(loader)``) neither deadlocks the server nor
pins unbounded shared memory.
"""

from __future__ import annotations

import itertools
import logging
import threading

from batchd.server.shm import Segment, SlotPool

log = logging.getLogger(__name__)


class LeaseTable:
    """Thread-safe: sessions open and close in RPC threads, leases are taken and released in others."""

    def __init__(self, slots: SlotPool, *, max_held: int, on_return=None):
        self.slots = slots
        self.max_held = max_held
        self._on_return = on_return or (lambda: None)
        self._lock = threading.Lock()
        self._sessions: dict[str, dict[int, Segment]] = {}
        self._ids = itertools.count(1)

    def open(self, session: str) -> None:
        with self._lock:
            self._sessions.setdefault(session, {})

    def close(self, session: str) -> int:
        """End ``session``: every slot it held goes back. Returns how many."""
        with self._lock:
            held = self._sessions.pop(session, {})
        for slot in held.values():
            self.slots.give_back(slot)
        if held:
            self._on_return()
        return len(held)

    def lend(self, session: str, slot: Segment) -> int | None:
        """A lease id for ``slot``, or None if the session is unknown or holds ``max_held`` already."""
        with self._lock:
            held = self._sessions.get(session)
            if held is None or len(held) >= self.max_held:
                return None
            lease = next(self._ids)
            held[lease] = slot
        self.slots.detach(slot)
        return lease

    def release(self, session: str, leases) -> int:
        """Return the slots of ``leases``; unknown ids are ignored. Returns how many went back."""
        with self._lock:
            held = self._sessions.get(session, {})
            slots = [held.pop(lease) for lease in leases if lease in held]
        for slot in slots:
            self.slots.give_back(slot)
        if slots:
            self._on_return()
        return len(slots)

    def held(self, session: str) -> int:
        with self._lock:
            return len(self._sessions.get(session, ()))

    @property
    def held_total(self) -> int:
        """Slots lent out, over all sessions."""
        with self._lock:
            return sum(len(held) for held in self._sessions.values())

    @property
    def held_bytes(self) -> int:
        """Bytes of the slots lent out."""
        with self._lock:
            return sum(slot.capacity for held in self._sessions.values() for slot in held.values())

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            self.close(session)
