"""Slots lent to same-host clients, the sessions that hold them, and the calls they were sent on.

A client on the server's host opens a session (``OpenSession``, a call that stays open). A
batch sent over the shared-memory transport stays in its slot; the slot is *lent* to the
session under a lease id (one more reference on the slot, ``SlotPool.lend``) until the client
releases it (``ReleaseLeases``, sent when the tensors on it are freed) or the session ends (the
client closed it, crashed, or was disconnected). A session holds at most ``max_held`` leases.
At that cap a stream waits for one to come back (``wait_for_room``: a client that consumes
releases one per training step) rather than copy the batch inline; a session that lets a wait
run out (``hoarding``: e.g. a caller keeping every batch, ``list(loader)``) gets inline batches
without waiting until it releases a lease again, so it neither deadlocks the server nor pins
unbounded shared memory.

Calls. Each lease is recorded under the StreamBatches call it was sent on, named by the
client's ``(session, stream_tag)``. When the client stops reading a call (an early ``break``,
a several-servers re-split), gRPC may have buffered batches it never receives; the client then
says which leases of that call it did receive (``abandon``), and every other lease sent on it
is released, now and any sent on it afterwards. A call's record lives until the call has ended
on the server and none of its leases is outstanding, or until its session ends.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
from dataclasses import dataclass, field

from batchd.server.shm import Segment, SlotPool

log = logging.getLogger(__name__)

_ABANDONED_KEPT = 256  # per session: abandoned tags remembered for calls the server has not seen yet


@dataclass(slots=True)
class Lease:
    """One lent slot: the call it was sent on (stream tag, "" if none; the server's stream id) and
    the samples of its batch."""

    slot: Segment
    tag: str = ""
    samples: int = 0
    stream: int = 0


@dataclass(slots=True)
class _Call:
    outstanding: set[int] = field(default_factory=set)  # leases sent on the call, not released yet
    received: frozenset[int] | None = None  # set once abandoned: what the client said it received
    ended: bool = False  # the call has ended on the server


class LeaseTable:
    """Thread-safe: sessions open and close in RPC threads, leases are taken and released in others."""

    def __init__(self, slots: SlotPool, *, max_held: int, on_return=None):
        self.slots = slots
        self.max_held = max_held
        self._on_return = on_return or (lambda: None)
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)  # notified whenever leases go back
        self._hoarding: set[str] = set()  # sessions that let a wait for room run out (until they release one)
        self._sessions: dict[str, dict[int, Lease]] = {}
        self._calls: dict[tuple[str, str], _Call] = {}
        self._abandoned: dict[str, collections.OrderedDict[str, frozenset[int]]] = {}  # not yet seen calls
        self._ids = itertools.count(1)

    def open(self, session: str) -> None:
        with self._lock:
            self._sessions.setdefault(session, {})

    def close(self, session: str) -> int:
        """End ``session``: every slot it held goes back, its call records go. Returns how many slots."""
        with self._lock:
            held = self._sessions.pop(session, {})
            for key in [k for k in self._calls if k[0] == session]:
                del self._calls[key]
            self._abandoned.pop(session, None)
            self._hoarding.discard(session)
            self._room.notify_all()
        for lease in held.values():
            self.slots.give_back(lease.slot)
        if held:
            self._on_return()
        return len(held)

    def lend(self, session: str, slot: Segment, *, tag: str = "", samples: int = 0, stream: int = 0) -> int | None:
        """A lease id for ``slot`` (held by the caller; the lease adds a reference), or None if the
        session is unknown, holds ``max_held`` already, or the client abandoned call ``tag``."""
        with self._lock:
            held = self._sessions.get(session)
            if held is None or len(held) >= self.max_held:
                return None
            call = None
            if tag:
                call = self._calls.get((session, tag))
                if call is None:
                    call = self._calls[(session, tag)] = _Call()
                    received = self._abandoned.get(session, {}).pop(tag, None)
                    if received is not None:  # the client gave this call up before it started here
                        call.received = received
                if call.received is not None:
                    return None
            self.slots.lend(slot)
            lease = next(self._ids)
            held[lease] = Lease(slot, tag, samples, stream)
            if call is not None:
                call.outstanding.add(lease)
        return lease

    def release(self, session: str, leases) -> list[Lease]:
        """Return the slots of ``leases``; unknown ids are ignored. Returns the leases released."""
        with self._lock:
            held = self._sessions.get(session, {})
            ids = [lease for lease in set(leases) if lease in held]
            released = [held.pop(lease) for lease in ids]
            for lease_id, lease in zip(ids, released):
                call = self._calls.get((session, lease.tag)) if lease.tag else None
                if call is not None:
                    call.outstanding.discard(lease_id)
                    self._drop_if_done(session, lease.tag, call)
            if released:
                self._hoarding.discard(session)
                self._room.notify_all()
        return self._give_back(released)

    def abandon(self, session: str, tag: str, received) -> list[Lease]:
        """The client stopped reading call ``tag`` having received exactly ``received`` of its leases:
        release every other lease sent on it, and lend nothing more on it. Returns the leases released."""
        received = frozenset(received)
        with self._lock:
            held = self._sessions.get(session)
            if held is None or not tag:
                return []
            call = self._calls.get((session, tag))
            if call is None:  # not started here yet (or over and all released): refuse it later
                kept = self._abandoned.setdefault(session, collections.OrderedDict())
                kept[tag] = received
                while len(kept) > _ABANDONED_KEPT:
                    kept.popitem(last=False)
                return []
            call.received = received
            lost = [lease for lease in call.outstanding if lease not in received]
            released = [held.pop(lease) for lease in lost if lease in held]
            call.outstanding.difference_update(lost)
            self._drop_if_done(session, tag, call)
            if released:
                self._room.notify_all()
        return self._give_back(released)

    def full(self, session: str) -> bool:
        """The session holds ``max_held`` leases and has not let a wait for room run out: worth waiting."""
        with self._lock:
            held = self._sessions.get(session)
            return (self.max_held > 0 and held is not None and len(held) >= self.max_held
                    and session not in self._hoarding)

    def wait_for_room(self, session: str, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for ``session`` to hold fewer than ``max_held`` leases (or to end)."""
        with self._room:
            return self._room.wait_for(lambda: len(self._sessions.get(session, ())) < self.max_held, timeout)

    def hoarding(self, session: str) -> None:
        """``session`` let a wait for room run out: lend or go inline without waiting until it releases a lease."""
        with self._lock:
            if session in self._sessions:
                self._hoarding.add(session)

    def is_abandoned(self, session: str, tag: str) -> bool:
        with self._lock:
            call = self._calls.get((session, tag))
            return call is not None and call.received is not None

    def call_ended(self, session: str, tag: str) -> None:
        """The call ``(session, tag)`` ended on the server: its record goes once its leases have."""
        with self._lock:
            call = self._calls.get((session, tag))
            if call is not None:
                call.ended = True
                self._drop_if_done(session, tag, call)

    def _drop_if_done(self, session: str, tag: str, call: _Call) -> None:
        if call.ended and not call.outstanding:
            del self._calls[(session, tag)]

    def _give_back(self, released: list[Lease]) -> list[Lease]:
        for lease in released:
            self.slots.give_back(lease.slot)
        if released:
            self._on_return()
        return released

    def held(self, session: str) -> int:
        with self._lock:
            return len(self._sessions.get(session, ()))

    @property
    def held_total(self) -> int:
        """Leases outstanding, over all sessions."""
        with self._lock:
            return sum(len(held) for held in self._sessions.values())

    @property
    def calls(self) -> int:
        """Call records kept (calls still open, or with leases outstanding)."""
        with self._lock:
            return len(self._calls)

    @property
    def sessions(self) -> int:
        with self._lock:
            return len(self._sessions)

    def close_all(self) -> None:
        with self._lock:
            sessions = list(self._sessions)
        for session in sessions:
            self.close(session)
