"""The client side of the shared-memory transport: map the server's slots, lease by lease.

``SharedMemorySession.open`` starts an OpenSession call and reads the probe segment the server
names. If this process sees the same bytes in its own ``/dev/shm``, it shares the server's
shared memory (same host, same IPC namespace) and batches can arrive as slot places instead of
bytes. ``tensors`` then maps the slot copy-on-write (``MAP_PRIVATE``) and wraps it as tensors
without copying; when the last tensor on it is freed, a finalizer queues the lease for
ReleaseLeases and the server reuses the slot.

Copy-on-write: the tensors are writable, as DataLoader batches are, but a page the caller writes
becomes this process's own copy; the server's slot, which other readers of a shared computation
(and its history) may hold too, never changes. Each lease gets its own mapping, unmapped with
its last tensor: a long-lived mapping would keep a written page private and show it again when
the slot comes back with another batch.

Copies to a GPU (``host_tensors``) read the slot instead: each segment is mapped once (shared,
read-only) and registered with CUDA once, since registering costs far more than a copy. Such a
mapping goes, unregistered first, once the server has unlinked its segment (it replaced or
retired the slot) and no batch's tensors use it: a batch uses it from ``host_tensors`` until the
link has sent its lease's release (``forget``), and each release round unmaps the idle
mappings of unlinked files. So a session maps at most the server's live segments and the few it
unlinked since the last round, not every segment it ever saw (tests/client/test_shm_mappings.py).

The session call stays open while any lease is outstanding, even after ``close``: the server
returns every slot of a session whose call ended, and a tensor the caller still holds must
never see its slot reused.
"""

from __future__ import annotations

import logging
import mmap
import os
import pathlib
import tempfile
import threading
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Callable

import grpc
import numpy as np

from batchd import errors, wire
from batchd.client.transport import fields
from batchd.client.transport.buffers import payload_length
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())


class SharedMemoryUnavailable(RuntimeError):
    """This process cannot read the server's shared memory (another host or IPC namespace)."""


def _segment_path(name: str) -> str:
    """The file of a segment the server named: a plain name in SHM_DIR, never a path elsewhere."""
    if not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise SharedMemoryUnavailable(f"the server named an invalid shared-memory segment {name[:80]!r}")
    return os.path.join(SHM_DIR, name)  # (a str: pathlib costs more than the mmap per batch)


def map_private(name: str, length: int) -> mmap.mmap:
    """The first ``length`` bytes of segment ``name``, mapped copy-on-write (``MAP_PRIVATE``,
    read-write): writes stay in this process, the segment's bytes never change.

    Raises SharedMemoryUnavailable for an invalid name, OSError if the segment cannot be mapped.
    """
    fd = os.open(_segment_path(name), os.O_RDONLY)  # MAP_PRIVATE writes need no write access
    try:
        return mmap.mmap(fd, length, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


@dataclass(eq=False)
class HostMapping:
    """One segment mapped shared and read-only for copies to a GPU (``SharedMemorySession.host_tensors``).

    file: the mapped file's (st_dev, st_ino), to see it unlinked or replaced. unregister: how to
    undo its registration with CUDA (``register``; None: not registered). leases: the batches whose
    tensors may still use it.
    """

    mm: mmap.mmap
    address: int
    size: int
    file: tuple[int, int]
    unregister: Callable[[int], None] | None = None
    leases: set[int] = field(default_factory=set)

    @classmethod
    def open(cls, name: str) -> "HostMapping":
        """Map segment ``name`` whole. Raises SharedMemoryUnavailable for an invalid name, OSError
        (FileNotFoundError once the server has unlinked it) if it cannot be mapped."""
        fd = os.open(_segment_path(name), os.O_RDONLY)
        try:
            st = os.fstat(fd)
            mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        return cls(mm, np.frombuffer(mm, dtype=np.uint8).ctypes.data, len(mm), (st.st_dev, st.st_ino))

    def droppable(self, name: str) -> bool:
        """No batch uses it, and segment ``name`` is no longer this file."""
        if self.leases:
            return False
        try:
            st = os.stat(_segment_path(name))
        except FileNotFoundError:
            return True
        return (st.st_dev, st.st_ino) != self.file

    def close(self) -> None:
        """Unregister (no copy reads it any more), then unmap."""
        if self.unregister is not None:
            self.unregister(self.address)
        try:
            self.mm.close()
        except BufferError:  # a view still exists somewhere: unmapped when it is collected
            pass


class SharedMemorySession:
    """One OpenSession call and the leases received under it. Thread-safe.

    freed(session, lease): where a lease goes once its batch's tensors are freed (or its batch was
    dropped unread): its server's link (``batchd.client.transport.link``), which sends it with the
    next message on its call, or by ReleaseLeases once the call is over, then calls ``forget``;
    it also calls ``sweep`` now and then and ``end_if_done`` once the loader closed. ``freed``
    runs in finalizers: it must take no lock.
    """

    def __init__(self, address: str, call, session: str, freed: Callable[[str, int], None]):
        self.address = address
        self.session = session
        self._call = call
        self._freed = freed
        self._lock = threading.Lock()
        self._outstanding: set[int] = set()
        self._closing = False
        self._ended = False
        self._maps_lock = threading.Lock()  # _host_maps and _host_leases (the receiving and the releasing threads)
        self._host_maps: dict[str, HostMapping] = {}  # segment name -> its mapping for copies to a GPU
        self._host_leases: dict[int, str] = {}  # lease -> the segment its batch's tensors (may) use

    @classmethod
    def open(cls, channel: grpc.Channel, address: str, timeout: float,
             freed: Callable[[str, int], None]) -> "SharedMemorySession":
        """Raises SharedMemoryUnavailable if the probe segment cannot be read here, ConnectionError
        if the server cannot be reached (nothing is known about its shared memory then)."""
        session = uuid.uuid4().hex
        call = channel.unary_stream(
            "/batchd.v1.BatchLoader/OpenSession",
            request_serializer=pb.OpenSessionRequest.SerializeToString,
            response_deserializer=pb.SessionEvent.FromString,
        )(pb.OpenSessionRequest(session=session))
        try:
            event = _first(call, timeout)
            try:
                with open(_segment_path(event.probe_segment), "rb") as f:
                    seen = f.read(len(event.probe_token))
            except OSError as e:
                raise SharedMemoryUnavailable(f"cannot read the server's probe segment: {e}") from None
            if seen != event.probe_token:
                raise SharedMemoryUnavailable("the probe segment here holds other bytes (another server's /dev/shm)")
        except BaseException:
            call.cancel()
            raise
        return cls(address, call, session, freed)

    def tensors(self, batch: wire.WireBatch) -> dict[str, fields.Field]:
        """Writable CPU tensors on a copy-on-write mapping of the batch's slot (no copy; ragged
        fields one flat tensor each, ``batchd.client.transport.fields``); its lease is released when they are
        all freed."""
        end = payload_length(batch)
        # every tensor below is a view of this array (a zero-length mmap is not allowed)
        base = np.frombuffer(map_private(batch.segment, end), dtype=np.uint8) if end else np.zeros(0, np.uint8)
        return self._wrap(base, batch)

    def host_tensors(self, batch: wire.WireBatch, register: Callable[[int, int], bool],
                     unregister: Callable[[int], None]) -> tuple[dict[str, fields.Field], bool]:
        """Read-only CPU tensors on the batch's slot, for a copy to a GPU straight from it (module
        docstring): these tensors are never handed to the caller, only copied from. A segment's
        mapping is passed once to ``register(address, size) -> bool`` (``CudaTransfer.register``),
        and to ``unregister(address)`` before it is unmapped. Returns the tensors and whether their
        memory is registered. Raises OSError if the segment cannot be mapped (FileNotFoundError: the
        server unlinked it).
        """
        with self._maps_lock:
            entry = self._host_maps.get(batch.segment)
            if entry is None:
                entry = HostMapping.open(batch.segment)
                if register(entry.address, entry.size):
                    entry.unregister = unregister
                self._host_maps[batch.segment] = entry
            entry.leases.add(batch.lease)
            self._host_leases[batch.lease] = batch.segment
        base = np.frombuffer(entry.mm, dtype=np.uint8, count=payload_length(batch))
        return self._wrap(base, batch), entry.unregister is not None

    def _drop_host_maps(self, leases: list[int], every: bool = False) -> None:
        """The batches of ``leases`` are gone (their releases sent): unmap the mappings that no
        batch uses whose segment the server has unlinked (unregistered first); ``every``: the
        session ended with nothing outstanding, so no copy reads any of them any more."""
        with self._maps_lock:
            for lease in list(self._host_leases) if every else leases:
                segment = self._host_leases.pop(lease, None)
                if segment is not None:
                    self._host_maps[segment].leases.discard(lease)
            dropped = [self._host_maps.pop(name) for name, m in list(self._host_maps.items())
                       if every or m.droppable(name)]
        for m in dropped:
            m.close()

    def _wrap(self, base: np.ndarray, batch: wire.WireBatch) -> dict[str, fields.Field]:
        """The batch's fields as views of ``base`` (``fields.views``), holding the batch's lease until
        all are freed. Raises ValueError naming a field the server sent malformed (the caller then
        releases the lease)."""
        out = fields.views(batch, base)
        self.hold(batch.lease)
        weakref.finalize(base, self._freed, self.session, batch.lease)
        return out

    def hold(self, lease: int) -> None:
        """A batch arrived on ``lease`` and waits to be converted (or dropped): the session stays
        open until it is released (``release_unused``, or its tensors' finalizer)."""
        with self._lock:
            self._outstanding.add(lease)

    def release_unused(self, lease: int) -> None:
        """A lease received but never wrapped in tensors (its batch was dropped): release it."""
        self._freed(self.session, lease)

    def forget(self, leases: list[int]) -> None:
        """The server was told about ``leases``: no tensor uses their batches any more; mappings of
        segments the server has unlinked meanwhile go."""
        with self._lock:
            self._outstanding.difference_update(leases)
        if self._host_maps:
            self._drop_host_maps(leases)

    def sweep(self) -> None:
        """Unmap the idle mappings of segments the server unlinked after the last release round
        (called now and then with nothing to send: the server unlinks a segment only once it has
        the release, so the last round's check may come too early)."""
        self.forget([])

    def end_if_done(self) -> bool:
        """Once closing with nothing outstanding: end the session call (the server returns what is
        left). True once ended."""
        with self._lock:
            if self._ended or not self._closing or self._outstanding:
                return self._ended
            self._ended = True
        try:
            self._call.cancel()
        except ValueError:  # the channel is closed already: so is the call
            pass
        self._drop_host_maps([], every=True)
        return True

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def held(self) -> list[int]:
        """The leases received and not yet released (batches waiting here, or tensors alive)."""
        with self._lock:
            return sorted(self._outstanding)

    @property
    def gone(self) -> bool:
        """The session call is over (ended here, or by the server or a broken connection): the
        server has taken every lease of the session back."""
        try:
            return self._call.done()
        except ValueError:
            return True

    def close(self) -> None:
        """End the session once the last outstanding lease is released (``end_if_done``, at once
        if none is). Idempotent."""
        with self._lock:
            self._closing = True
        self.end_if_done()


def _first(call, timeout: float) -> pb.SessionEvent:
    result: list = []

    def read() -> None:
        try:
            result.append(next(call))
        except BaseException as e:  # RpcError, StopIteration
            result.append(e)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout)
    if not result:
        raise SharedMemoryUnavailable(f"no answer to OpenSession within {timeout:g} s")
    if isinstance(result[0], grpc.RpcError) and result[0].code() in _UNREACHABLE:
        raise errors.ConnectionError(f"OpenSession failed: the server is unreachable ({result[0].code().name})")
    if isinstance(result[0], BaseException):
        raise SharedMemoryUnavailable(f"OpenSession failed: {result[0]}")
    return result[0]


_UNREACHABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED)
