"""What a received batch becomes before the loop takes it: ``to_tensors`` (an inline batch's
fields as views of its message) and ``Received`` (a converted batch as the converter thread of
``batchd.client.delivery`` hands it to the consumer)."""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple

import lz4.frame as lz4_frame
import torch

from batchd import wire
from batchd.client.transport import fields
from batchd.v1 import loader_pb2 as pb


class Received(NamedTuple):
    """One batch as the converter thread hands it over: ``batch`` is what the loader hands out (a
    dict of stacked tensors and lists, ``batchd.client.transport.fields.unpack``; or what ``collate_fn``
    returned); ``samples`` its size. On a CUDA device, ``event`` is the CUDA event its copy records and
    ``copies`` the device tensors the copy made (the consumer's stream waits for the event and
    records its use of them, ``CudaTransfer.hand_over``); else both are None. ``collate`` is a
    ``collate_fn`` still to run in the consumer's thread (on a CUDA device), or None. ``times`` its
    ``batchd.client.loader.timings.BatchTimes`` (server and client stages); ``record`` the
    ``CallRecord`` of the call it came on (progress is counted there)."""

    batch_index: int
    batch: Any
    event: Any
    samples: int
    copies: dict[str, torch.Tensor] | None = None
    collate: Callable[[list], Any] | None = None
    times: Any = None
    record: Any = None


def to_tensors(batch: wire.WireBatch) -> dict[str, fields.Field]:
    """The batch's fields on the received message (no copy; LZ4 data once decompressed): stacked
    tensors, ``Ragged`` fields (one flat tensor each), lists of str / bytes (``batchd.client.transport.fields``).

    The message bytes belong to this batch alone, so the tensors are handed out writable, as
    DataLoader batches are (torch.frombuffer warns about read-only buffers; we silence that).
    Raises ValueError naming a field the server sent malformed.
    """
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for t in batch.tensors:
            data = lz4_frame.decompress(t.data) if t.compression == pb.COMPRESSION_LZ4 else t.data
            out[t.name] = fields.field(t, fields.from_bytes(t, data))
    return out
