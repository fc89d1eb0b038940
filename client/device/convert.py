"""A received batch as the loader hands it out: ``convert`` (in the pass's order) and ``deliver``
(in the consumer's thread).

``convert`` turns a ``WireBatch`` (its tensors in a lent shared-memory slot, in a buffer the data
connection filled, or in its gRPC message) into the loader's batch: tensors on the device (a
CUDA copy on a side stream, ``batchd.client.device.transfer``), finished by ``gpu_transform``,
JPEGs decoded for ``decode_on_client`` (``batchd.client.device.decode``), ragged fields split
into per-sample views, collated by ``collate_fn``.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from batchd import errors, wire
from batchd.client.device import decode
from batchd.client.device.collate import samples as samples_of
from batchd.client.device.transfer import check_finishable, finish
from batchd.client.transport import fields
from batchd.client.transport.receiver import BatchTimes, Received, delivered, to_tensors


def inline(options: Any, transfer: Any) -> bool:
    """Whether converting a batch is cheap enough for the training loop's own thread, so that the
    pass needs no converter (``batchd.client.iteration.epoch``): CPU tensors over the bytes as they
    came (no device copy, ``gpu_transform``, ``decode_on_client`` or ``collate_fn``)."""
    o = options
    return transfer is None and o.gpu_transform is None and not o.decode_on_client and o.collate_fn is None


def convert(raw: wire.WireBatch, shm: Any, *, options: Any, transfer: Any, stopping: Any, on_error: str,
            address: str, record: Any = None) -> Received:
    """The batch of ``raw`` as the loader hands it out, and its ``BatchTimes`` (unpack here; copy
    and gpu_transform: CUDA events, or the CPU time of gpu_transform).

    shm: the shared-memory session it was lent on (None: its bytes came another way). options:
    the loader's ``LoaderOptions``; transfer: its ``CudaTransfer`` (None for CPU tensors);
    stopping: an Event set when the pass ends (a device copy is then refused); on_error: the
    dataset's (``decode_on_client``); record: the server's pass ``Progress`` (for ``deliver``).
    Raises ConnectionError if its shared-memory slot is gone (the server ended the session),
    ValueError for a malformed batch, and what ``gpu_transform``, decoding or ``collate_fn`` raise.
    """
    times, t0 = BatchTimes(raw.timings), time.perf_counter()
    if raw.segment and shm is None:
        raise RuntimeError(f"{address} sent a shared-memory batch on a call without a session")
    shm = shm if raw.segment else None
    registered, encoded = False, decode.is_encoded(raw)
    try:
        if raw.payload is not None:  # received on the data connection, into a pooled buffer
            batch = raw.payload
            # copied straight from it: asynchronously from a pinned buffer (``buffers.PinnedPool``), at
            # once from an ordinary one (past the pinned budget); held until the copy is done either way
            registered = transfer is not None
        elif transfer is not None and shm is not None and transfer.maps_host_memory and not encoded:
            batch, registered = shm.host_tensors(raw, transfer.register, transfer.unregister)  # copied from the slot
        else:
            batch = shm.tensors(raw) if shm is not None else to_tensors(raw)
    except FileNotFoundError:
        # the server unlinked the slot: it ended the session (shutting down) after gRPC had
        # buffered this message
        if shm is not None:
            shm.release_unused(raw.lease)
        raise errors.ConnectionError(f"batchd server at {address} ended the shared-memory session of batch "
                                     f"{raw.batch_index} (epoch {raw.epoch}) before it was read: the server is "
                                     f"shutting down or restarting") from None
    if raw.skipped:
        batch["skipped"] = torch.tensor(raw.skipped, dtype=torch.int64)
    o, event = options, None
    if encoded:  # JPEG files: decoded here (client/device/decode.py), then as below; all of it is unpack
        batch, event = decode.decode_batch(batch, o, transfer, stopping, raw.epoch, on_error)
        times.unpack = time.perf_counter() - t0
    else:
        t1 = time.perf_counter()
        times.unpack = t1 - t0
        if transfer is not None:
            if o.gpu_transform is not None:
                check_finishable(batch)  # before the copy: a failed finish must not leave one in flight
            marks: list = []
            batch, event = transfer.to_device(batch, stopping, registered=registered,
                                              finish=o.gpu_transform, seed=o.seed, epoch=raw.epoch, marks=marks)
            times.events = (*marks, event) if len(marks) == 2 else None  # (device times from CUDA events)
        elif o.gpu_transform is not None:
            finish(batch, o.gpu_transform, o.seed, raw.epoch)
            times.gpu_transform = time.perf_counter() - t1
    copies = fields.tensors(batch) if event is not None else None
    batch = fields.unpack(batch)  # ragged fields: B views of their one (device) buffer
    # (after decode_on_client, which may leave out files under on_error: skip)
    samples = int(batch["index"].shape[0]) if isinstance(batch.get("index"), torch.Tensor) else 0
    if event is None and o.collate_fn is not None:
        batch = o.collate_fn(samples_of(batch))
        return Received(raw.batch_index, batch, None, samples, times=times, record=record)
    # on the device, collate_fn runs once the consumer's stream waits for the copy (``deliver``)
    return Received(raw.batch_index, batch, event, samples, copies, o.collate_fn, times=times, record=record)


def deliver(item: Received, transfer: Any) -> Any:
    """Consumer's thread: the batch of ``item``, its copy waited for on the current CUDA stream
    (then collated, if ``collate_fn`` is still to run), counted as taken (its ``Progress``), its
    times handed to the loop's timing."""
    batch = item.batch
    if item.event is not None:
        transfer.hand_over(item.copies, item.event)
    if item.collate is not None:
        batch = item.collate(samples_of(batch))
    if item.record is not None:
        item.record.took(item.samples)
    delivered(item.times, item.record, item.samples)  # loader.stats() and profile() (batchd.client.loader.timings)
    return batch
