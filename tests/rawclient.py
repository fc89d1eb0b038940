"""A minimal client on the generated gRPC stub (no batchd.client): drives the wire protocol by hand."""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import uuid

import grpc
import numpy as np

from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


class RawSession:
    """One OpenSession call on ``channel``; ``stream`` starts StreamBatches calls under it."""

    def __init__(self, channel: grpc.Channel, session: str | None = None):
        self.stub = loader_pb2_grpc.BatchLoaderStub(channel)
        self.session = session or uuid.uuid4().hex
        self.call = self.stub.OpenSession(pb.OpenSessionRequest(session=self.session))
        self.event = next(self.call)

    def stream(self, tag: str = "", *, transport=pb.TRANSPORT_SHARED_MEMORY, **fields):
        """A StreamBatches call (an iterator of ``pb.Batch``) with this session and ``stream_tag=tag``."""
        request = pb.StreamBatchesRequest(transport=transport, session=self.session, stream_tag=tag, **fields)
        return self.stub.StreamBatches(request, timeout=120)

    def release(self, leases=(), *, abandoned: str = "", received=(), progress=()) -> None:
        self.stub.ReleaseLeases(pb.ReleaseLeasesRequest(
            session=self.session, leases=list(leases), abandoned_stream=abandoned, received_leases=list(received),
            progress=list(progress)), timeout=30)

    def close(self) -> None:
        self.call.cancel()


class RawBatches:
    """One Batches call on ``stub``: the first message opens it with ``open_request`` (a
    ``pb.StreamBatchesRequest``) and grants ``grant``; ``send(...)`` queues one more
    ``BatchesControl``; ``close()`` half-closes. Iterating gives the ``pb.Batch`` messages; ``call``
    is the gRPC call (initial_metadata(), code(), details(), trailing_metadata(), cancel())."""

    def __init__(self, stub: loader_pb2_grpc.BatchLoaderStub, open_request: pb.StreamBatchesRequest, *,
                 grant=(), metadata=(), timeout: float = 120):
        self._queue: queue.Queue = queue.Queue()
        self._queue.put(pb.BatchesControl(open=open_request, grant=list(grant)))
        self.call = stub.Batches(self._requests(), metadata=metadata, timeout=timeout)

    def _requests(self):
        while True:
            try:
                msg = self._queue.get(timeout=0.1)
            except queue.Empty:
                if self.call is not None and self.call.done():  # never outlive the call
                    return
                continue
            if msg is None:
                return
            yield msg

    call = None

    def send(self, **fields) -> None:
        """Queue a BatchesControl(**fields): grant, revoke, release, progress (or a raw message as ``msg``)."""
        self._queue.put(fields["msg"] if "msg" in fields else pb.BatchesControl(**fields))

    def close(self, *, done: bool = True) -> None:
        """Half-close: no more control messages; the last one says ``done`` (the call counts as
        finished) unless ``done=False`` (a request stream that just ends: counted cancelled)."""
        if done:
            self._queue.put(pb.BatchesControl(done=True))
        self._queue.put(None)

    def __iter__(self):
        return iter(self.call)

    def __next__(self) -> pb.Batch:
        return next(self.call)

    def cancel(self) -> None:
        self.call.cancel()


def server_id(call) -> str:
    """The ``batchd-server-id`` initial metadata of a call ("" if none)."""
    return dict(call.initial_metadata() or ()).get("batchd-server-id", "")


def tensors(batch: pb.Batch) -> dict[str, np.ndarray]:
    """The batch's tensors as numpy arrays (copies): from the message, or from its segment mapped
    copy-on-write (``MAP_PRIVATE``), as batchd's client maps it."""
    if not batch.segment:
        return {t.name: np.frombuffer(t.data, dtype=t.dtype).reshape(tuple(t.shape)).copy() for t in batch.tensors}
    fd = os.open(os.path.join(SHM_DIR, batch.segment), os.O_RDONLY)
    try:
        mm = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    try:
        out = {}
        for t in batch.tensors:
            n = int(np.prod(t.shape, dtype=np.int64)) * np.dtype(t.dtype).itemsize
            out[t.name] = np.frombuffer(mm, dtype=np.uint8, count=n, offset=t.offset).view(t.dtype).reshape(
                tuple(t.shape)).copy()
        return out
    finally:
        mm.close()


def digest(arrays: dict[str, np.ndarray]) -> str:
    """SHA-256 over image, label and index: names, dtypes, shapes and bytes."""
    h = hashlib.sha256()
    for name in ("image", "label", "index"):
        a = arrays[name]
        h.update(f"{name}:{a.dtype}:{a.shape}".encode())
        h.update(a.tobytes())
    return h.hexdigest()
