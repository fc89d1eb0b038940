"""What a received batch becomes before the loop takes it: an inline batch's fields
(``to_tensors``), a converted batch as the pass hands it to the consumer (``Received``), its
``BatchTimes``, and their way to the loop's timing (``delivered``)."""

from __future__ import annotations

import threading
import warnings
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import lz4.frame as lz4_frame
import torch

from batchd import wire
from batchd.client.transport import fields
from batchd.v1 import loader_pb2 as pb
from batchd.wire import WireTimings


class Received(NamedTuple):
    """One batch as the converter thread hands it over: ``batch`` is what the loader hands out (a
    dict of stacked tensors and lists, ``batchd.client.transport.fields.unpack``; or what ``collate_fn``
    returned); ``samples`` its size. On a CUDA device, ``event`` is the CUDA event its copy records and
    ``copies`` the device tensors the copy made (the consumer's stream waits for the event and
    records its use of them, ``CudaTransfer.hand_over``); else both are None. ``collate`` is a
    ``collate_fn`` still to run in the consumer's thread (on a CUDA device), or None. ``times`` its
    ``batchd.client.loader.timings.BatchTimes`` (server and client stages); ``record`` the
    ``Progress`` of the server and pass it came from (what the loop took is counted there)."""

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


@dataclass(slots=True)
class BatchTimes:
    """One batch's timings: the server's (``WireTimings``; None from a server that sends none)
    and this client's, in seconds. ``events``: CUDA events (start, copied, finished) recorded
    with timing on the copy's stream; ``resolve()`` turns them into ``copy`` and
    ``gpu_transform`` once they have completed."""

    server: WireTimings | None = None
    receive: float = 0.0
    unpack: float = 0.0
    copy: float = 0.0
    gpu_transform: float = 0.0
    events: tuple[Any, Any, Any] | None = None

    def resolve(self, wait: bool = False) -> bool:
        """Read the CUDA events' times if they have completed (``wait``: synchronize first).
        True once nothing is pending."""
        if self.events is None:
            return True
        start, copied, finished = self.events
        if not wait and not finished.query():
            return False
        finished.synchronize()
        self.copy = start.elapsed_time(copied) / 1000.0  # ms -> s
        self.gpu_transform = copied.elapsed_time(finished) / 1000.0
        self.events = None
        return True


_delivered = threading.local()


def delivered(times: BatchTimes | None, record: Any, samples: int | None = None) -> None:
    """The consumer's thread hands the training loop a batch of ``samples`` samples: remember its
    timings and its server's pass ``Progress`` for ``timed`` (``take_delivered``), in the same thread,
    right after."""
    _delivered.item = (times, record, samples)


def take_delivered() -> tuple[BatchTimes | None, Any, int | None]:
    """The (timings, progress, samples) of the batch delivered last in this thread; (None,
    None, None) if none."""
    item = getattr(_delivered, "item", None)
    _delivered.item = None
    return item if item is not None else (None, None, None)
