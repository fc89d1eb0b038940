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
import queue
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
        self._freed: queue.SimpleQueue[int] = queue.SimpleQueue()  # leases whose tensors were freed
        self._releaser = threading.Thread(target=self._release_loop, name="batchd-shm-release", daemon=True)
        self._releaser.start()
        self._closing = False

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
        """Writable CPU tensors on a copy-on-write mapping of the batch's slot (no copy); its lease
        is released when they are all freed."""
        end = max((t.offset + int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
                   for t in batch.tensors), default=0)
        # every tensor below is a view of this array (a zero-length mmap is not allowed)
        base = np.frombuffer(map_private(batch.segment, end), dtype=np.uint8) if end else np.zeros(0, np.uint8)
        with self._lock:
            self._outstanding.add(batch.lease)
        weakref.finalize(base, self._released, batch.lease)
        out = {}
        for t in batch.tensors:
            nbytes = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            array = base[t.offset : t.offset + nbytes].view(t.dtype).reshape(t.shape)
            out[t.name] = torch.from_numpy(array)
        return out

    def _released(self, lease: int) -> None:
        """weakref.finalize callback: runs wherever the garbage collector frees a batch, possibly
        inside a gRPC call or while this thread holds a lock, so it only queues the lease
        (SimpleQueue.put is reentrant); the releaser thread tells the server."""
        self._freed.put(lease)

    def _release_loop(self) -> None:
        """Send ReleaseLeases for freed batches, a call for all that are waiting; end the session
        once it is closing and nothing is outstanding."""
        while True:
            try:
                leases = [self._freed.get(timeout=0.5)]
            except queue.Empty:
                with self._lock:
                    if self._closing and not self._outstanding:
                        break
                continue
            while True:
                try:
                    leases.append(self._freed.get_nowait())
                except queue.Empty:
                    break
            with self._lock:
                self._outstanding.difference_update(leases)
                finished = self._closing and not self._outstanding
            try:
                self._release(pb.ReleaseLeasesRequest(session=self.session, leases=leases), timeout=10)
            except (grpc.RpcError, ValueError):  # server or channel gone: the slots go back with the session
                pass
            if finished:
                break
        try:
            self._call.cancel()
        except ValueError:  # the channel is closed already: so is the call
            pass

    @property
    def outstanding(self) -> int:
        with self._lock:
            return len(self._outstanding)

    def close(self) -> None:
        """End the session now, or once the last outstanding lease is released (the releaser
        thread cancels the session call then)."""
        with self._lock:
            self._closing = True


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
