"""The client side of the shared-memory transport: map the server's slots, lease by lease.

``SharedMemorySession.open`` starts an OpenSession call and reads the probe segment the server
names. If this process sees the same bytes in its own ``/dev/shm``, it shares the server's
shared memory (same host, same IPC namespace) and batches can arrive as slot places instead of
bytes. ``tensors`` then wraps a slot as tensors without copying; when the last tensor on it is
freed, a finalizer sends ReleaseLeases and the server reuses the slot.

The session call stays open while any lease is outstanding, even after ``close``: the server
returns every slot of a session whose call ended, and a tensor the caller still holds must
never see its slot reused.
"""

from __future__ import annotations

import collections
import logging
import mmap
import os
import pathlib
import tempfile
import threading
import uuid
import weakref

import grpc
import numpy as np
import torch

from batchd import wire
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
_MAPPED = 64  # segments kept mapped; a slot is reused for many batches


class SharedMemoryUnavailable(RuntimeError):
    """This process cannot read the server's shared memory (another host or IPC namespace)."""


def _segment_path(name: str) -> pathlib.Path:
    """The file of a segment the server named: a plain name in SHM_DIR, never a path elsewhere."""
    if not name or "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise SharedMemoryUnavailable(f"the server named an invalid shared-memory segment {name[:80]!r}")
    return SHM_DIR / name


def _map(name: str) -> mmap.mmap:
    # Read-write: the slot is the caller's while the lease is held, and DataLoader batches may be
    # modified in place. The server writes to it again only after the lease is released.
    fd = os.open(_segment_path(name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


class SharedMemorySession:
    """One OpenSession call and the leases received under it. Thread-safe."""

    def __init__(self, channel: grpc.Channel, address: str, call, session: str):
        self.address = address
        self.session = session
        self._call = call
        self._release = channel.unary_unary(
            "/batchd.v1.BatchLoader/ReleaseLeases",
            request_serializer=pb.ReleaseLeasesRequest.SerializeToString,
            response_deserializer=pb.ReleaseLeasesResponse.FromString,
        )
        self._lock = threading.Lock()
        self._outstanding: set[int] = set()
        self._pending: set = set()  # ReleaseLeases calls in flight
        self._closing = False
        self._mapped: collections.OrderedDict[str, mmap.mmap] = collections.OrderedDict()

    @classmethod
    def open(cls, channel: grpc.Channel, address: str, timeout: float) -> "SharedMemorySession":
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
        return cls(channel, address, call, session)

    def tensors(self, batch: wire.WireBatch) -> dict[str, torch.Tensor]:
        """CPU tensors on the batch's slot (no copy); its lease is released when they are all freed."""
        mm = self._segment(batch.segment)
        end = max(t.offset + int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize for t in batch.tensors)
        base = np.frombuffer(mm, dtype=np.uint8, count=end)  # every tensor below is a view of this array
        with self._lock:
            self._outstanding.add(batch.lease)
        weakref.finalize(base, self._released, batch.lease)
        out = {}
        for t in batch.tensors:
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            array = base[t.offset : t.offset + nbytes].view(t.dtype).reshape(t.shape)
            out[t.name] = torch.from_numpy(array)
        return out

    def _segment(self, name: str) -> mmap.mmap:
        with self._lock:
            mm = self._mapped.get(name)
            if mm is not None:
                self._mapped.move_to_end(name)
                return mm
        mm = _map(name)
        with self._lock:
            self._mapped[name] = mm
            while len(self._mapped) > _MAPPED:
                self._mapped.popitem(last=False)  # unmapped once no tensor uses it
        return mm

    def _released(self, lease: int) -> None:
        with self._lock:
            self._outstanding.discard(lease)
            finished = self._closing and not self._outstanding
        try:
            future = self._release.future(pb.ReleaseLeasesRequest(session=self.session, leases=[lease]), timeout=30)
        except Exception:  # the channel is gone: the server returns the slot when the session ends
            future = None
        if future is not None:  # grpc cancels a call whose future is garbage-collected: hold it until done
            with self._lock:
                self._pending.add(future)
            future.add_done_callback(self._forget)
        if finished:
            self._call.cancel()

    def _forget(self, future) -> None:
        with self._lock:
            self._pending.discard(future)

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def close(self) -> None:
        """End the session now, or once the last outstanding lease is released."""
        with self._lock:
            self._closing = True
            done = not self._outstanding
        if done:
            self._call.cancel()


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
