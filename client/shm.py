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
import warnings
import weakref

import grpc
import numpy as np
import torch

from batchd import wire
from batchd.client import fields
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())


class SharedMemoryUnavailable(RuntimeError):
    """This process cannot read the server's shared memory (another host or IPC namespace)."""


def _segment_path(name: str) -> pathlib.Path:
    """The file of a segment the server named: a plain name in SHM_DIR, never a path elsewhere."""
    if not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise SharedMemoryUnavailable(f"the server named an invalid shared-memory segment {name[:80]!r}")
    return SHM_DIR / name


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


class SharedMemorySession:
    """One OpenSession call and the leases received under it. Thread-safe.

    Freed batches are queued on ``reporter`` (``batchd.client.leases.Reporter``), whose thread
    sends ReleaseLeases, calls ``forget`` with what it sent and ``end_if_done`` each round.
    """

    def __init__(self, address: str, call, session: str, reporter):
        self.address = address
        self.session = session
        self._call = call
        self._reporter = reporter
        self._lock = threading.Lock()
        self._outstanding: set[int] = set()
        self._closing = False
        self._ended = False
        self._host_maps: dict[str, tuple[mmap.mmap, int, bool]] = {}  # segment -> (mapping, address, registered)
        self._unregister = None
        reporter.add_session(self)

    @classmethod
    def open(cls, channel: grpc.Channel, address: str, timeout: float, reporter) -> "SharedMemorySession":
        """Raises SharedMemoryUnavailable if the probe segment cannot be read here."""
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
        return cls(address, call, session, reporter)

    def tensors(self, batch: wire.WireBatch) -> dict[str, fields.Field]:
        """Writable CPU tensors on a copy-on-write mapping of the batch's slot (no copy; ragged
        fields one flat tensor each, ``batchd.client.fields``); its lease is released when they are
        all freed."""
        end = _end(batch)
        # every tensor below is a view of this array (a zero-length mmap is not allowed)
        base = np.frombuffer(map_private(batch.segment, end), dtype=np.uint8) if end else np.zeros(0, np.uint8)
        return self._wrap(base, batch)

    def host_tensors(self, batch: wire.WireBatch, register) -> tuple[dict[str, fields.Field], bool]:
        """Read-only CPU tensors on the batch's slot, for a copy to a GPU straight from it.

        Each segment is mapped once (shared, read-only: these tensors are never handed to the
        caller, only copied from) and passed once to ``register(address, size) -> bool`` (a
        ``CudaTransfer.register``). Returns the tensors and whether their memory is registered.
        """
        entry = self._host_maps.get(batch.segment)
        if entry is None:
            fd = os.open(_segment_path(batch.segment), os.O_RDONLY)
            try:
                mm = mmap.mmap(fd, 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            finally:
                os.close(fd)
            address = np.frombuffer(mm, dtype=np.uint8).ctypes.data
            entry = self._host_maps[batch.segment] = (mm, address, bool(register(address, len(mm))))
            if entry[2]:
                self._unregister = getattr(register, "__self__", None)
        mm, _, registered = entry
        return self._wrap(np.frombuffer(mm, dtype=np.uint8, count=_end(batch)), batch), registered

    def _unmap_host(self) -> None:
        """Session ended, nothing outstanding: no copy reads these mappings any more."""
        for mm, address, registered in self._host_maps.values():
            if registered and self._unregister is not None:
                self._unregister.unregister(address)
            try:
                mm.close()
            except BufferError:  # a view still exists somewhere: unmapped when it is collected
                pass
        self._host_maps.clear()

    def _wrap(self, base: np.ndarray, batch: wire.WireBatch) -> dict[str, fields.Field]:
        """The batch's fields as views of ``base`` (stacked tensors, ``Ragged`` flat values; str and
        bytes are copies), holding the batch's lease until all are freed. Raises ValueError naming a
        field the server sent malformed (the caller then releases the lease)."""
        out = {}
        with warnings.catch_warnings():  # a read-only base (host_tensors) is never written: see there
            warnings.simplefilter("ignore", UserWarning)
            for t in batch.tensors:
                values = base[t.offset : t.offset + fields.nbytes(t)].view(fields.numpy_dtype(t.dtype))
                out[t.name] = fields.field(t, torch.from_numpy(values))
        with self._lock:
            self._outstanding.add(batch.lease)
        weakref.finalize(base, self._reporter.freed, self.session, batch.lease)
        return out

    def release_unused(self, lease: int) -> None:
        """A lease received but never wrapped in tensors (its batch was dropped): release it."""
        self._reporter.freed(self.session, lease)

    def forget(self, leases: list[int]) -> None:
        """The reporter told the server about ``leases`` (reporter thread)."""
        with self._lock:
            self._outstanding.difference_update(leases)

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
        self._unmap_host()
        return True

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    @property
    def gone(self) -> bool:
        """The session call is over (ended here, or by the server or a broken connection): the
        server has taken every lease of the session back."""
        try:
            return self._call.done()
        except ValueError:
            return True

    @property
    def ended(self) -> bool:
        with self._lock:
            return self._ended

    def close(self) -> None:
        """End the session once the last outstanding lease is released (at once if none is):
        the reporter thread cancels the session call then. Idempotent."""
        with self._lock:
            self._closing = True
        self._reporter.wake()


def _end(batch: wire.WireBatch) -> int:
    """Bytes of the batch's slot its tensors span."""
    return max((t.offset + fields.nbytes(t) for t in batch.tensors), default=0)


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
    if isinstance(result[0], BaseException):
        raise SharedMemoryUnavailable(f"OpenSession failed: {result[0]}")
    return result[0]
