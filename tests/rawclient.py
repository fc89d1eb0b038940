"""A minimal client on the generated gRPC stub (no batchd.client): drives the wire protocol by hand."""

from __future__ import annotations

import hashlib
import mmap
import os
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
