"""The pool of batch slots: reusable shared-memory segments (``segments.py``), each holding one batch.

Slots are reused across batches and streams: a fresh segment costs a page fault per 4 KiB on
first write; a reused one costs nothing. Their number bounds the memory the server holds.
"""

from __future__ import annotations

import itertools
import threading

from .segments import Segment


class SlotPool:
    """At most ``max_slots`` reusable segments, each holding one batch at a time, counted by references.

    ``acquire`` returns a free slot of at least ``min_capacity`` bytes (or the largest free one,
    which the worker may outgrow), creating one while under the cap; None when all are taken. The
    caller holds the slot's first reference. ``lend`` adds a reference for a lease (a same-host
    client reading the slot in place); ``release`` / ``give_back`` drop one. A slot is free again,
    and may be overwritten, only when every holder has let go: the computation (reorder buffer and
    history) and any number of leases.

    A slot held by leases alone does not count against ``max_slots`` (clients may hold up to
    ``max_leases_per_session`` each on top); when it comes back it is kept if there is room, else
    unlinked. Thread-safe.
    """

    def __init__(self, *, max_slots: int, prefix: str, default_capacity: int = 1 << 20):
        self.prefix = prefix
        self.max_slots = max_slots
        self.default_capacity = default_capacity
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self._free: list[Segment] = []
        self._all: dict[str, Segment] = {}  # every slot: free, held, or lent
        self._refs: dict[str, int] = {}  # name -> holders of a slot in use (the server's and leases)
        self._lent: dict[str, int] = {}  # name -> of those, leases

    def new_name(self) -> str:
        return f"{self.prefix}{next(self._counter)}"

    def _lent_only(self) -> int:
        return sum(1 for name, n in self._lent.items() if self._refs.get(name) == n)

    def _counted(self) -> int:
        """Slots that count against max_slots: all but those only leases hold."""
        return len(self._all) - self._lent_only()

    @property
    def in_use(self) -> int:
        """Slots the server holds (a batch being built, waiting, or kept as history), lent or not."""
        with self._lock:
            return len(self._refs) - self._lent_only()

    @property
    def holding(self) -> int:
        """Slots holding a batch: those the server holds (``in_use``) and those only leases hold."""
        with self._lock:
            return len(self._refs)

    @property
    def lent(self) -> int:
        """Slots with at least one lease on them."""
        with self._lock:
            return len(self._lent)

    @property
    def bytes_mapped(self) -> int:
        """Bytes of every slot: free, held by the server, or lent to clients."""
        with self._lock:
            return sum(s.capacity for s in self._all.values())

    def refs(self, slot: Segment) -> int:
        """How many holders ``slot`` has (0: free or unknown)."""
        with self._lock:
            return self._refs.get(slot.name, 0)

    def acquire(self, min_capacity: int = 0) -> Segment | None:
        with self._lock:
            if self._free:
                fits = [s for s in self._free if s.capacity >= min_capacity]
                if fits:
                    slot = min(fits, key=lambda s: s.capacity)
                    self._free.remove(slot)
                    self._refs[slot.name] = 1
                    return slot
                if self._counted() >= self.max_slots:  # replace the smallest free slot by a bigger one
                    small = min(self._free, key=lambda s: s.capacity)
                    self._free.remove(small)
                    del self._all[small.name]
                    self._drop(small)
            if self._counted() >= self.max_slots:
                return None
            slot = Segment.create(self.new_name(), max(min_capacity, self.default_capacity))
            self._all[slot.name] = slot
            self._refs[slot.name] = 1
            return slot

    def adopt(self, old: Segment, name: str) -> Segment:
        """A worker outgrew ``old`` and wrote into a new segment ``name``: it replaces ``old`` (and takes its holders)."""
        new = Segment.attach(name)
        with self._lock:
            self._all.pop(old.name, None)
            self._all[new.name] = new
            self._refs[new.name] = self._refs.pop(old.name, 1)
            if old.name in self._lent:
                self._lent[new.name] = self._lent.pop(old.name)
        self._drop(old)
        return new

    def lend(self, slot: Segment) -> None:
        """A lease on ``slot`` (held by the caller): one more holder. Raises ValueError if nobody holds it."""
        with self._lock:
            if not self._refs.get(slot.name):
                raise ValueError(f"slot {slot.name} is not held: it cannot be lent")
            self._refs[slot.name] += 1
            self._lent[slot.name] = self._lent.get(slot.name, 0) + 1

    def give_back(self, slot: Segment) -> None:
        """A lease on ``slot`` ended: ``release`` for that lease."""
        with self._lock:
            n = self._lent.get(slot.name, 0)
            if n <= 1:
                self._lent.pop(slot.name, None)
            else:
                self._lent[slot.name] = n - 1
        self.release(slot)

    def release(self, slot: Segment) -> None:
        """One holder lets go; the last one makes the slot free (kept if there is room, else unlinked)."""
        drop = False
        with self._lock:
            n = self._refs.get(slot.name)
            if n is None:
                return  # not ours (the pool was closed), or freed already
            if n > 1:
                self._refs[slot.name] = n - 1
                return
            del self._refs[slot.name]
            if slot.name not in self._all:
                return
            if self._counted() > self.max_slots:  # it was lent only, and the pool is full meanwhile
                del self._all[slot.name]
                drop = True
            else:
                self._free.append(slot)
        if drop:
            self._drop(slot)

    def _drop(self, slot: Segment) -> None:
        slot.unlink()
        try:
            slot.close()
        except BufferError:  # a view still points into it; the mapping goes when that view does
            pass

    def close(self) -> None:
        """Unlink every slot. Views handed out must not be used afterwards."""
        with self._lock:
            for slot in self._all.values():
                self._drop(slot)
            self._all.clear()
            self._free.clear()
            self._refs.clear()
            self._lent.clear()
