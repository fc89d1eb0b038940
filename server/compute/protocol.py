"""The server's messages: a stream request as the loader sees it, and those to and from workers.

A StreamBatches request is reshaped once: ``StreamRequest.from_proto`` decodes the protobuf
message (the only place that reads it), ``Loader.open_stream`` validates it and fills in the
resolved fields (``dataclasses.replace``, same type), and the computation turns each batch of it
into a ``Task``.

Each worker has one duplex pipe. Down it go ``Task`` and ``Shutdown``; up it come ``Ready``,
``BatchDone`` and ``TaskFailed``. Workers never raise across the pipe: a failure is a
``TaskFailed`` carrying the exception (pickled when possible) and the worker's formatted
traceback, which the server re-raises with that traceback attached. Pixels never cross the pipe:
a worker writes the batch into a shared-memory slot and sends only its layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from batchd.v1 import loader_pb2 as pb

TRANSPORTS = {pb.TRANSPORT_INLINE: "inline", pb.TRANSPORT_SHARED_MEMORY: "shm", pb.TRANSPORT_SOCKET: "socket"}
COMPRESSIONS = {pb.COMPRESSION_NONE: "none", pb.COMPRESSION_LZ4: "lz4"}
ENCODINGS = {pb.IMAGE_ENCODING_DECODED: "decoded", pb.IMAGE_ENCODING_JPEG: "jpeg"}


@dataclass(frozen=True, slots=True)
class WeightedSpec:
    """A request's weighted sampler (``WeightedSampler`` in loader.proto): the weights by digest
    (``weights_digest``, sent with PutWeights) or the dataset's own (``dataset_weights``),
    ``num_samples`` draws per epoch, with or without ``replacement``."""

    weights_digest: str = ""
    dataset_weights: bool = False
    num_samples: int = 0
    replacement: bool = True


@dataclass(frozen=True, slots=True)
class MixSourceSpec:
    """One source of a request's mix (``MixSource``): its dataset, weight, pipeline (preset name or
    albumentations JSON, as the request's own) and expectations. ``pipeline_name``,
    ``pipeline_key`` and ``pipeline_json`` are resolved by ``Loader.open_stream``."""

    dataset: str
    weight: float = 0.0
    preset: str = ""
    albumentations_json: str = ""
    expect_num_samples: int = 0
    expect_fingerprint: str = ""
    expect_build_fingerprint: str = ""
    pipeline_name: str = ""
    pipeline_key: str = ""
    pipeline_json: str = ""


@dataclass(frozen=True, slots=True)
class MixSpec:
    """A request's mix (``Mix``): its sources, in order (a batch's ``source`` k is ``sources[k]``),
    and ``num_samples`` positions per epoch."""

    sources: tuple[MixSourceSpec, ...] = ()
    num_samples: int = 0

    @property
    def name(self) -> str:
        """How logs and stats name the mix: ``mix(a,b,c)``."""
        return "mix(" + ",".join(s.dataset for s in self.sources) + ")"


def _pipeline_fields(msg: pb.Pipeline | None) -> tuple[str, str]:
    """(preset, albumentations_json) of a Pipeline message (unset: both empty)."""
    which = msg.WhichOneof("source") if msg is not None else None
    return (msg.preset if which == "preset" else "",
            msg.albumentations_json if which == "albumentations_json" else "")


@dataclass(frozen=True, slots=True)
class StreamRequest:
    """One StreamBatches call's request (see ``loader.proto`` for every field).

    As decoded, 0 still means "default" where the proto says so (world_size, prefetch,
    batch_stride); ``Loader.open_stream`` returns a validated copy with those resolved and the
    pipeline fields (``pipeline_name``, ``pipeline_key``, ``pipeline_json``) filled in.
    transport: "shm" (shared memory: asked for, with a ``session``), "socket" (the data plane, asked
        for: a Batches call on a server with one; the servicer makes it "inline" otherwise) or
        "inline"; compression: "none" or "lz4".
    session: the client's shared-memory session ("" for none); with ``stream_tag`` it names this call.
    stream_tag: the client's name for this call (ReleaseLeases: abandoned_stream, progress).
    image_encoding: "decoded" (pixels) or "jpeg" (the files' bytes, decoded by the client: ``server/compute/encoded.py``).
    start_position: the epoch's remainder from this global position on (elastic resume; ``batchd.sampler``).
    end_batch: stop before this batch index (0: the epoch's end). hedge: a hedged request (counted apart).
    peer: the client, as gRPC names it (logs and stats).
    granted: a Batches call (the client grants the batch indices; start_batch, batch_stride,
    batch_offset, end_batch and prefetch are 0 and unused), not a StreamBatches call.
    sampler: a weighted epoch (``WeightedSpec``), or None. mix: a mixed epoch (``MixSpec``; then
    ``dataset`` is the mix's name, ``MixSpec.name``, and the pipeline fields are unused), or None.
    order_key: what the epoch's order depends on beyond (dataset, shuffle, seed, epoch): the
    sampler's weights digest, num_samples and replacement, or the mix's sources, weights,
    pipelines and num_samples, hashed ("" for a plain epoch); resolved by ``Loader.open_stream``.
    """

    dataset: str
    preset: str = ""
    albumentations_json: str = ""
    batch_size: int = 1
    shuffle: bool = False
    seed: int = 0
    epoch: int = 0
    drop_last: bool = False
    rank: int = 0
    world_size: int = 1
    start_batch: int = 0
    prefetch: int = 0
    batch_stride: int = 0  # 0 or 1: every batch; else b with (b - start_batch) % batch_stride == batch_offset
    batch_offset: int = 0
    transport: str = "inline"
    session: str = ""
    compression: str = "none"
    stream_tag: str = ""
    image_encoding: str = "decoded"
    start_position: int = 0
    end_batch: int = 0  # 0: the epoch's end
    hedge: bool = False
    peer: str = ""
    granted: bool = False  # a Batches call (not part of the key: it shares with StreamBatches)
    sampler: WeightedSpec | None = None
    mix: MixSpec | None = None
    # resolved by Loader.open_stream
    pipeline_name: str = ""  # preset name, "none", or "custom:<key prefix>"
    pipeline_key: str = ""
    pipeline_json: str = ""
    order_key: str = ""

    @classmethod
    def from_proto(cls, msg: pb.StreamBatchesRequest, peer: str = "") -> "StreamRequest":
        """Decode a ``StreamBatchesRequest``. Raises ValueError naming an unknown enum value
        (``transport``, ``compression``, ``image_encoding``); the other fields are checked by ``Loader.open_stream``."""
        if msg.transport not in TRANSPORTS:
            raise ValueError(f"transport: unknown value {msg.transport} (known: "
                             + ", ".join(f"{pb.Transport.Name(v)}={v}" for v in TRANSPORTS) + ")")
        if msg.compression not in COMPRESSIONS:
            raise ValueError(f"compression: unknown value {msg.compression} (known: "
                             + ", ".join(f"{pb.Compression.Name(v)}={v}" for v in COMPRESSIONS) + ")")
        if msg.image_encoding not in ENCODINGS:
            raise ValueError(f"image_encoding: unknown value {msg.image_encoding} (known: "
                             + ", ".join(f"{pb.ImageEncoding.Name(v)}={v}" for v in ENCODINGS) + ")")
        preset, albumentations_json = _pipeline_fields(msg.pipeline if msg.HasField("pipeline") else None)
        shared = msg.transport == pb.TRANSPORT_SHARED_MEMORY and bool(msg.session)
        sampler = mix = None
        if msg.HasField("sampler"):
            w = msg.sampler
            sampler = WeightedSpec(w.weights_digest, w.dataset_weights, w.num_samples, w.replacement)
        if msg.HasField("mix"):
            mix = MixSpec(tuple(
                MixSourceSpec(m.dataset, m.weight, *_pipeline_fields(m.pipeline if m.HasField("pipeline") else None),
                              m.expect_num_samples, m.expect_fingerprint, m.expect_build_fingerprint)
                for m in msg.mix.sources), msg.mix.num_samples)
        return cls(
            dataset=mix.name if mix is not None and not msg.dataset else msg.dataset,
            preset=preset, albumentations_json=albumentations_json,
            batch_size=msg.batch_size, shuffle=msg.shuffle, seed=msg.seed, epoch=msg.epoch, drop_last=msg.drop_last,
            rank=msg.rank, world_size=msg.world_size, start_batch=msg.start_batch, prefetch=msg.prefetch,
            batch_stride=msg.batch_stride, batch_offset=msg.batch_offset,
            transport="shm" if shared else "socket" if msg.transport == pb.TRANSPORT_SOCKET else "inline",
            session=msg.session,
            compression=COMPRESSIONS[msg.compression], stream_tag=msg.stream_tag,
            image_encoding=ENCODINGS[msg.image_encoding], start_position=msg.start_position,
            end_batch=msg.end_batch, hedge=msg.hedge, peer=peer, sampler=sampler, mix=mix,
        )

    @property
    def stride(self) -> int:
        """Positions step by this (``batch_stride``, 0 meaning 1)."""
        return self.batch_stride or 1

    @property
    def first_batch(self) -> int:
        return self.start_batch + self.batch_offset

    @property
    def key(self) -> tuple:
        """What determines the batches' bytes (and, for a strided stream, which batches): streams with
        equal keys can share a computation. Meaningful once validated (pipeline_key resolved)."""
        return (self.dataset, self.pipeline_key, self.batch_size, self.shuffle, self.seed, self.epoch,
                self.drop_last, self.rank, self.world_size or 1, self.stride, self.first_batch % self.stride,
                self.image_encoding, self.start_position, self.end_batch, self.order_key)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The datasets this request reads: its mix's sources, or its dataset."""
        return tuple(s.dataset for s in self.mix.sources) if self.mix is not None else (self.dataset,)

    @property
    def drawn(self) -> bool:
        """A weighted or mixed epoch: a sample may come twice, so its own randomness is keyed to its
        position (``batchd.sampler.draw_key``)."""
        return self.sampler is not None or self.mix is not None


@dataclass(frozen=True, slots=True)
class TensorLayout:
    """Where one field of a batch lies in its slot: ``nbytes`` bytes at ``offset``, C order.

    Stacked (``sample_shapes`` None): ``shape`` is [B, ...]. Ragged (the samples' shapes differ):
    ``shape`` is (total elements,), the samples' values back to back, and ``sample_shapes`` gives
    each sample's shape (B tuples of one length; an empty tuple for B = 0); see ``Tensor`` in
    loader.proto. dtype "str" (UTF-8) and "bytes" are always ragged, stored as uint8 of shape
    (length,) per sample.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    sample_shapes: tuple[tuple[int, ...], ...] | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)

    def __reduce__(self):
        # a batch's layouts cross the worker pipe once per batch: rebuilt by one constructor call,
        # not by the dataclass's generic __setstate__ (which lists the fields each time)
        return (TensorLayout, (self.name, self.dtype, self.shape, self.offset, self.sample_shapes))

    @property
    def ragged(self) -> bool:
        return self.sample_shapes is not None

    @property
    def samples(self) -> int:
        """The batch's number of samples as this tensor holds them (B)."""
        return len(self.sample_shapes) if self.sample_shapes is not None else self.shape[0]


def storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a tensor's bytes are stored as: uint8 for "str" (UTF-8) and "bytes", else ``dtype``."""
    return _UINT8 if dtype in ("str", "bytes") else np.dtype(dtype)


def itemsize(dtype: str) -> int:
    """Bytes per element of ``storage_dtype(dtype)``, looked up once per dtype name (the pool reads
    every finished batch's size: no numpy call per field and batch)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = storage_dtype(dtype).itemsize
    return size


_UINT8 = np.dtype(np.uint8)
_ITEMSIZES: dict[str, int] = {}


@dataclass(frozen=True, slots=True)
class Task:
    """Build one batch: load ``indices``, run the pipeline on each, stack into a slot.

    task_id: unique per server. dataset: config name. pipeline_key/pipeline_json: the
    albumentations pipeline ("" = none), cached per worker by key. indices: int64 [B].
    random_key: uint64 [2], the epoch's key (``batchd.sampler.sample_key``). positions: int64 [B],
    each sample's global position (``batchd.sampler.global_positions``): sample ``j`` is
    augmented with the stream ``sample_stream(random_key, positions[j])``.
    slot_name/slot_capacity: the shared-memory slot to write, bytes.
    skip_bad_samples: leave out samples that raise SampleError instead of failing.
    max_batch_bytes: fail with ResourceExhaustedError before writing a batch larger than this (0: no limit).
    encoding: "decoded" (pixels through the pipeline) or "jpeg" (the files' bytes, ``server/compute/encoded.py``).
    sources: a mix's (dataset, pipeline_key, pipeline_json) per source (empty: every sample is of
    ``dataset`` through the task's pipeline); source_ids: int64 [B], sample j's source (a mix only).
    drawn: the epoch is weighted or mixed: a dataset's own randomness (kind python) is keyed to the
    sample's position (``batchd.sampler.draw_key``), not its index.
    """

    task_id: int
    dataset: str
    pipeline_key: str
    pipeline_json: str
    indices: np.ndarray
    random_key: np.ndarray
    positions: np.ndarray
    slot_name: str
    slot_capacity: int
    skip_bad_samples: bool = False
    max_batch_bytes: int = 0
    encoding: str = "decoded"
    sources: tuple[tuple[str, str, str], ...] = ()
    source_ids: np.ndarray | None = None
    drawn: bool = False

    def __reduce__(self):
        # pickled once per batch by the scheduler: the arrays go as their raw bytes (numpy's own
        # reduction costs a few microseconds per array, each way); the worker gets read-only views
        ids = None if self.source_ids is None else np.ascontiguousarray(self.source_ids, np.int64).tobytes()
        return (_task, (self.task_id, self.dataset, self.pipeline_key, self.pipeline_json,
                        np.ascontiguousarray(self.indices, np.int64).tobytes(),
                        np.ascontiguousarray(self.random_key, np.uint64).tobytes(),
                        np.ascontiguousarray(self.positions, np.int64).tobytes(),
                        self.slot_name, self.slot_capacity, self.skip_bad_samples, self.max_batch_bytes, self.encoding,
                        self.sources, ids, self.drawn))


def _task(task_id, dataset, pipeline_key, pipeline_json, indices: bytes, random_key: bytes, positions: bytes,
          slot_name, slot_capacity, skip_bad_samples, max_batch_bytes, encoding, sources=(), source_ids=None,
          drawn=False) -> Task:
    """A ``Task`` as ``Task.__reduce__`` pickled it."""
    return Task(task_id, dataset, pipeline_key, pipeline_json, np.frombuffer(indices, np.int64),
                np.frombuffer(random_key, np.uint64), np.frombuffer(positions, np.int64), slot_name, slot_capacity,
                skip_bad_samples, max_batch_bytes, encoding, sources,
                None if source_ids is None else np.frombuffer(source_ids, np.int64), drawn)


@dataclass(frozen=True, slots=True)
class Shutdown:
    """Finish and exit."""


@dataclass(frozen=True, slots=True)
class Ready:
    """Worker ``worker_id`` (process ``pid``) has started and takes tasks."""

    worker_id: int
    pid: int


@dataclass(frozen=True, slots=True)
class BatchDone:
    """The batch is in ``slot_name`` (a new, larger segment when ``grown``), laid out as ``tensors``.

    timings: seconds per stage (``server/compute/stages.py``: read, decode, pipeline, cache, write; their
    sum is the worker's time on the batch), plus read_io (the I/O threads' read seconds, overlapping),
    started (``time.monotonic()`` when the worker began the batch) and cache_hits (samples).
    skipped: (index, file, reason) of samples left out under on_error: skip.
    """

    task_id: int
    worker_id: int
    slot_name: str
    slot_capacity: int
    grown: bool
    tensors: tuple[TensorLayout, ...]
    timings: dict[str, float] = field(default_factory=dict)
    skipped: tuple[tuple[int, str, str], ...] = ()

    def __reduce__(self):  # (as TensorLayout's: once per batch, read by the scheduler)
        return (BatchDone, (self.task_id, self.worker_id, self.slot_name, self.slot_capacity, self.grown, self.tensors,
                            self.timings, self.skipped))


@dataclass(frozen=True, slots=True)
class TaskFailed:
    """Building the batch raised. ``error`` is the exception if it pickles, else None."""

    task_id: int
    worker_id: int
    error: BaseException | None
    error_type: str
    message: str
    traceback: str
