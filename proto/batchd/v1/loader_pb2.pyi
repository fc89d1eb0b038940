from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Transport(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSPORT_INLINE: _ClassVar[Transport]
    TRANSPORT_SHARED_MEMORY: _ClassVar[Transport]
    TRANSPORT_SOCKET: _ClassVar[Transport]

class ImageEncoding(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    IMAGE_ENCODING_DECODED: _ClassVar[ImageEncoding]
    IMAGE_ENCODING_JPEG: _ClassVar[ImageEncoding]

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_LZ4: _ClassVar[Compression]
TRANSPORT_INLINE: Transport
TRANSPORT_SHARED_MEMORY: Transport
TRANSPORT_SOCKET: Transport
IMAGE_ENCODING_DECODED: ImageEncoding
IMAGE_ENCODING_JPEG: ImageEncoding
COMPRESSION_NONE: Compression
COMPRESSION_LZ4: Compression

class OpenSessionRequest(_message.Message):
    __slots__ = ("session",)
    SESSION_FIELD_NUMBER: _ClassVar[int]
    session: str
    def __init__(self, session: _Optional[str] = ...) -> None: ...

class SessionEvent(_message.Message):
    __slots__ = ("probe_segment", "probe_token")
    PROBE_SEGMENT_FIELD_NUMBER: _ClassVar[int]
    PROBE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    probe_segment: str
    probe_token: bytes
    def __init__(self, probe_segment: _Optional[str] = ..., probe_token: _Optional[bytes] = ...) -> None: ...

class ReleaseLeasesRequest(_message.Message):
    __slots__ = ("session", "leases", "abandoned_stream", "received_leases", "progress")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_STREAM_FIELD_NUMBER: _ClassVar[int]
    RECEIVED_LEASES_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    session: str
    leases: _containers.RepeatedScalarFieldContainer[int]
    abandoned_stream: str
    received_leases: _containers.RepeatedScalarFieldContainer[int]
    progress: _containers.RepeatedCompositeFieldContainer[StreamProgress]
    def __init__(self, session: _Optional[str] = ..., leases: _Optional[_Iterable[int]] = ..., abandoned_stream: _Optional[str] = ..., received_leases: _Optional[_Iterable[int]] = ..., progress: _Optional[_Iterable[_Union[StreamProgress, _Mapping]]] = ...) -> None: ...

class StreamProgress(_message.Message):
    __slots__ = ("stream_tag", "batches_taken", "samples_taken", "wait_ratio", "verdict")
    STREAM_TAG_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    WAIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    stream_tag: str
    batches_taken: int
    samples_taken: int
    wait_ratio: float
    verdict: str
    def __init__(self, stream_tag: _Optional[str] = ..., batches_taken: _Optional[int] = ..., samples_taken: _Optional[int] = ..., wait_ratio: _Optional[float] = ..., verdict: _Optional[str] = ...) -> None: ...

class ReleaseLeasesResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[DatasetInfo]
    def __init__(self, datasets: _Optional[_Iterable[_Union[DatasetInfo, _Mapping]]] = ...) -> None: ...

class DescribeDatasetRequest(_message.Message):
    __slots__ = ("name", "labels")
    NAME_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    labels: bool
    def __init__(self, name: _Optional[str] = ..., labels: _Optional[bool] = ...) -> None: ...

class TensorSpec(_message.Message):
    __slots__ = ("name", "dtype", "shape")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ...) -> None: ...

class DatasetInfo(_message.Message):
    __slots__ = ("name", "kind", "num_samples", "class_names", "sample", "fingerprint", "build_fingerprint", "build", "on_error", "server_id", "weights_digest", "class_counts", "labels")
    class BuildEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUILD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    BUILD_FIELD_NUMBER: _ClassVar[int]
    ON_ERROR_FIELD_NUMBER: _ClassVar[int]
    SERVER_ID_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    CLASS_COUNTS_FIELD_NUMBER: _ClassVar[int]
    LABELS_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    num_samples: int
    class_names: _containers.RepeatedScalarFieldContainer[str]
    sample: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    fingerprint: str
    build_fingerprint: str
    build: _containers.ScalarMap[str, str]
    on_error: str
    server_id: str
    weights_digest: str
    class_counts: _containers.RepeatedScalarFieldContainer[int]
    labels: bytes
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., num_samples: _Optional[int] = ..., class_names: _Optional[_Iterable[str]] = ..., sample: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ..., fingerprint: _Optional[str] = ..., build_fingerprint: _Optional[str] = ..., build: _Optional[_Mapping[str, str]] = ..., on_error: _Optional[str] = ..., server_id: _Optional[str] = ..., weights_digest: _Optional[str] = ..., class_counts: _Optional[_Iterable[int]] = ..., labels: _Optional[bytes] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("preset", "albumentations_json")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    ALBUMENTATIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    preset: str
    albumentations_json: str
    def __init__(self, preset: _Optional[str] = ..., albumentations_json: _Optional[str] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("dataset", "pipeline", "batch_size", "shuffle", "seed", "epoch", "drop_last", "rank", "world_size", "start_batch", "prefetch", "transport", "session", "compression", "batch_stride", "batch_offset", "stream_tag", "image_encoding", "start_position", "end_batch", "hedge", "expect_num_samples", "expect_fingerprint", "expect_build_fingerprint", "data_messages", "sampler", "mix")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHUFFLE_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    DROP_LAST_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    START_BATCH_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SESSION_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    BATCH_STRIDE_FIELD_NUMBER: _ClassVar[int]
    BATCH_OFFSET_FIELD_NUMBER: _ClassVar[int]
    STREAM_TAG_FIELD_NUMBER: _ClassVar[int]
    IMAGE_ENCODING_FIELD_NUMBER: _ClassVar[int]
    START_POSITION_FIELD_NUMBER: _ClassVar[int]
    END_BATCH_FIELD_NUMBER: _ClassVar[int]
    HEDGE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPECT_BUILD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DATA_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_FIELD_NUMBER: _ClassVar[int]
    MIX_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    pipeline: Pipeline
    batch_size: int
    shuffle: bool
    seed: int
    epoch: int
    drop_last: bool
    rank: int
    world_size: int
    start_batch: int
    prefetch: int
    transport: Transport
    session: str
    compression: Compression
    batch_stride: int
    batch_offset: int
    stream_tag: str
    image_encoding: ImageEncoding
    start_position: int
    end_batch: int
    hedge: bool
    expect_num_samples: int
    expect_fingerprint: str
    expect_build_fingerprint: str
    data_messages: bool
    sampler: WeightedSampler
    mix: Mix
    def __init__(self, dataset: _Optional[str] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ..., batch_size: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., drop_last: _Optional[bool] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start_batch: _Optional[int] = ..., prefetch: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., session: _Optional[str] = ..., compression: _Optional[_Union[Compression, str]] = ..., batch_stride: _Optional[int] = ..., batch_offset: _Optional[int] = ..., stream_tag: _Optional[str] = ..., image_encoding: _Optional[_Union[ImageEncoding, str]] = ..., start_position: _Optional[int] = ..., end_batch: _Optional[int] = ..., hedge: _Optional[bool] = ..., expect_num_samples: _Optional[int] = ..., expect_fingerprint: _Optional[str] = ..., expect_build_fingerprint: _Optional[str] = ..., data_messages: _Optional[bool] = ..., sampler: _Optional[_Union[WeightedSampler, _Mapping]] = ..., mix: _Optional[_Union[Mix, _Mapping]] = ...) -> None: ...

class WeightedSampler(_message.Message):
    __slots__ = ("weights_digest", "dataset_weights", "num_samples", "replacement")
    WEIGHTS_DIGEST_FIELD_NUMBER: _ClassVar[int]
    DATASET_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    REPLACEMENT_FIELD_NUMBER: _ClassVar[int]
    weights_digest: str
    dataset_weights: bool
    num_samples: int
    replacement: bool
    def __init__(self, weights_digest: _Optional[str] = ..., dataset_weights: _Optional[bool] = ..., num_samples: _Optional[int] = ..., replacement: _Optional[bool] = ...) -> None: ...

class MixSource(_message.Message):
    __slots__ = ("dataset", "weight", "pipeline", "expect_num_samples", "expect_fingerprint", "expect_build_fingerprint")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    EXPECT_NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    EXPECT_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    EXPECT_BUILD_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    weight: float
    pipeline: Pipeline
    expect_num_samples: int
    expect_fingerprint: str
    expect_build_fingerprint: str
    def __init__(self, dataset: _Optional[str] = ..., weight: _Optional[float] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ..., expect_num_samples: _Optional[int] = ..., expect_fingerprint: _Optional[str] = ..., expect_build_fingerprint: _Optional[str] = ...) -> None: ...

class Mix(_message.Message):
    __slots__ = ("sources", "num_samples")
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    sources: _containers.RepeatedCompositeFieldContainer[MixSource]
    num_samples: int
    def __init__(self, sources: _Optional[_Iterable[_Union[MixSource, _Mapping]]] = ..., num_samples: _Optional[int] = ...) -> None: ...

class WeightsChunk(_message.Message):
    __slots__ = ("digest", "num_weights", "weights")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    NUM_WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    num_weights: int
    weights: bytes
    def __init__(self, digest: _Optional[str] = ..., num_weights: _Optional[int] = ..., weights: _Optional[bytes] = ...) -> None: ...

class PutWeightsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BatchesControl(_message.Message):
    __slots__ = ("open", "grant", "revoke", "release", "progress", "done", "open_seq")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    REVOKE_FIELD_NUMBER: _ClassVar[int]
    RELEASE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQ_FIELD_NUMBER: _ClassVar[int]
    open: StreamBatchesRequest
    grant: _containers.RepeatedScalarFieldContainer[int]
    revoke: _containers.RepeatedScalarFieldContainer[int]
    release: _containers.RepeatedScalarFieldContainer[int]
    progress: StreamProgress
    done: bool
    open_seq: int
    def __init__(self, open: _Optional[_Union[StreamBatchesRequest, _Mapping]] = ..., grant: _Optional[_Iterable[int]] = ..., revoke: _Optional[_Iterable[int]] = ..., release: _Optional[_Iterable[int]] = ..., progress: _Optional[_Union[StreamProgress, _Mapping]] = ..., done: _Optional[bool] = ..., open_seq: _Optional[int] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "offset", "compression", "sample_ndim", "sample_shapes", "sample_offsets")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_NDIM_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_SHAPES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_OFFSETS_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    offset: int
    compression: Compression
    sample_ndim: int
    sample_shapes: _containers.RepeatedScalarFieldContainer[int]
    sample_offsets: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ..., sample_ndim: _Optional[int] = ..., sample_shapes: _Optional[_Iterable[int]] = ..., sample_offsets: _Optional[_Iterable[int]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_index", "epoch", "num_batches", "tensors", "segment", "lease", "skipped_indices", "timings", "open_seq")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_INDICES_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    OPEN_SEQ_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    epoch: int
    num_batches: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    segment: str
    lease: int
    skipped_indices: _containers.RepeatedScalarFieldContainer[int]
    timings: BatchTimings
    open_seq: int
    def __init__(self, batch_index: _Optional[int] = ..., epoch: _Optional[int] = ..., num_batches: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., segment: _Optional[str] = ..., lease: _Optional[int] = ..., skipped_indices: _Optional[_Iterable[int]] = ..., timings: _Optional[_Union[BatchTimings, _Mapping]] = ..., open_seq: _Optional[int] = ...) -> None: ...

class BatchTimings(_message.Message):
    __slots__ = ("queued_seconds", "read_seconds", "decode_seconds", "pipeline_seconds", "cache_seconds", "write_seconds", "reorder_seconds", "send_seconds", "read_io_seconds", "cache_hits", "worker", "workers_busy_ratio", "workers")
    QUEUED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DECODE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    WRITE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    REORDER_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SEND_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READ_IO_SECONDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    WORKER_FIELD_NUMBER: _ClassVar[int]
    WORKERS_BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    queued_seconds: float
    read_seconds: float
    decode_seconds: float
    pipeline_seconds: float
    cache_seconds: float
    write_seconds: float
    reorder_seconds: float
    send_seconds: float
    read_io_seconds: float
    cache_hits: int
    worker: int
    workers_busy_ratio: float
    workers: int
    def __init__(self, queued_seconds: _Optional[float] = ..., read_seconds: _Optional[float] = ..., decode_seconds: _Optional[float] = ..., pipeline_seconds: _Optional[float] = ..., cache_seconds: _Optional[float] = ..., write_seconds: _Optional[float] = ..., reorder_seconds: _Optional[float] = ..., send_seconds: _Optional[float] = ..., read_io_seconds: _Optional[float] = ..., cache_hits: _Optional[int] = ..., worker: _Optional[int] = ..., workers_busy_ratio: _Optional[float] = ..., workers: _Optional[int] = ...) -> None: ...

class ErrorDetail(_message.Message):
    __slots__ = ("type", "message", "dataset", "indices", "paths", "reason")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    PATHS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    type: str
    message: str
    dataset: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    paths: _containers.RepeatedScalarFieldContainer[str]
    reason: str
    def __init__(self, type: _Optional[str] = ..., message: _Optional[str] = ..., dataset: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ..., paths: _Optional[_Iterable[str]] = ..., reason: _Optional[str] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class StreamStats(_message.Message):
    __slots__ = ("id", "peer", "dataset", "pipeline", "batch_size", "epoch", "rank", "world_size", "transport", "shared", "num_batches", "next_batch", "batches_sent", "samples_sent", "bytes_sent", "samples_skipped", "batches_in_flight", "batches_ready", "prefetch", "age_seconds", "images_per_second", "waiting_seconds", "batches_taken", "samples_taken", "bytes_copied", "images_per_second_sent", "wait_ratio", "verdict", "reports_wait", "call", "granted", "data_bytes_sent")
    ID_FIELD_NUMBER: _ClassVar[int]
    PEER_FIELD_NUMBER: _ClassVar[int]
    DATASET_FIELD_NUMBER: _ClassVar[int]
    PIPELINE_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRANSPORT_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    NEXT_BATCH_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    BATCHES_READY_FIELD_NUMBER: _ClassVar[int]
    PREFETCH_FIELD_NUMBER: _ClassVar[int]
    AGE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    IMAGES_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    WAITING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_TAKEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_FIELD_NUMBER: _ClassVar[int]
    IMAGES_PER_SECOND_SENT_FIELD_NUMBER: _ClassVar[int]
    WAIT_RATIO_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    REPORTS_WAIT_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    GRANTED_FIELD_NUMBER: _ClassVar[int]
    DATA_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    id: int
    peer: str
    dataset: str
    pipeline: str
    batch_size: int
    epoch: int
    rank: int
    world_size: int
    transport: str
    shared: bool
    num_batches: int
    next_batch: int
    batches_sent: int
    samples_sent: int
    bytes_sent: int
    samples_skipped: int
    batches_in_flight: int
    batches_ready: int
    prefetch: int
    age_seconds: float
    images_per_second: float
    waiting_seconds: float
    batches_taken: int
    samples_taken: int
    bytes_copied: int
    images_per_second_sent: float
    wait_ratio: float
    verdict: str
    reports_wait: bool
    call: str
    granted: int
    data_bytes_sent: int
    def __init__(self, id: _Optional[int] = ..., peer: _Optional[str] = ..., dataset: _Optional[str] = ..., pipeline: _Optional[str] = ..., batch_size: _Optional[int] = ..., epoch: _Optional[int] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., transport: _Optional[str] = ..., shared: _Optional[bool] = ..., num_batches: _Optional[int] = ..., next_batch: _Optional[int] = ..., batches_sent: _Optional[int] = ..., samples_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., samples_skipped: _Optional[int] = ..., batches_in_flight: _Optional[int] = ..., batches_ready: _Optional[int] = ..., prefetch: _Optional[int] = ..., age_seconds: _Optional[float] = ..., images_per_second: _Optional[float] = ..., waiting_seconds: _Optional[float] = ..., batches_taken: _Optional[int] = ..., samples_taken: _Optional[int] = ..., bytes_copied: _Optional[int] = ..., images_per_second_sent: _Optional[float] = ..., wait_ratio: _Optional[float] = ..., verdict: _Optional[str] = ..., reports_wait: _Optional[bool] = ..., call: _Optional[str] = ..., granted: _Optional[int] = ..., data_bytes_sent: _Optional[int] = ...) -> None: ...

class WorkerStats(_message.Message):
    __slots__ = ("id", "pid", "busy_ratio", "stage", "tasks")
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    BUSY_RATIO_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    TASKS_FIELD_NUMBER: _ClassVar[int]
    id: int
    pid: int
    busy_ratio: float
    stage: str
    tasks: int
    def __init__(self, id: _Optional[int] = ..., pid: _Optional[int] = ..., busy_ratio: _Optional[float] = ..., stage: _Optional[str] = ..., tasks: _Optional[int] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("workers", "ready", "busy", "restarts", "busy_seconds", "utilization", "tasks_in_flight", "slots_in_use", "max_slots", "shm_bytes", "leases_held", "sessions", "batches_rebuilt", "min_workers", "max_workers", "cpu_quota", "scale_ups", "scale_downs", "worker_stats", "scheduler_rounds", "scheduler_waits", "scheduler_timeouts", "scheduler_wakeups", "scheduler_dispatches", "scheduler_passes")
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    BUSY_FIELD_NUMBER: _ClassVar[int]
    RESTARTS_FIELD_NUMBER: _ClassVar[int]
    BUSY_SECONDS_FIELD_NUMBER: _ClassVar[int]
    UTILIZATION_FIELD_NUMBER: _ClassVar[int]
    TASKS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    SLOTS_IN_USE_FIELD_NUMBER: _ClassVar[int]
    MAX_SLOTS_FIELD_NUMBER: _ClassVar[int]
    SHM_BYTES_FIELD_NUMBER: _ClassVar[int]
    LEASES_HELD_FIELD_NUMBER: _ClassVar[int]
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REBUILT_FIELD_NUMBER: _ClassVar[int]
    MIN_WORKERS_FIELD_NUMBER: _ClassVar[int]
    MAX_WORKERS_FIELD_NUMBER: _ClassVar[int]
    CPU_QUOTA_FIELD_NUMBER: _ClassVar[int]
    SCALE_UPS_FIELD_NUMBER: _ClassVar[int]
    SCALE_DOWNS_FIELD_NUMBER: _ClassVar[int]
    WORKER_STATS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_WAITS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_WAKEUPS_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_DISPATCHES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULER_PASSES_FIELD_NUMBER: _ClassVar[int]
    workers: int
    ready: int
    busy: int
    restarts: int
    busy_seconds: float
    utilization: float
    tasks_in_flight: int
    slots_in_use: int
    max_slots: int
    shm_bytes: int
    leases_held: int
    sessions: int
    batches_rebuilt: int
    min_workers: int
    max_workers: int
    cpu_quota: float
    scale_ups: int
    scale_downs: int
    worker_stats: _containers.RepeatedCompositeFieldContainer[WorkerStats]
    scheduler_rounds: int
    scheduler_waits: int
    scheduler_timeouts: int
    scheduler_wakeups: int
    scheduler_dispatches: int
    scheduler_passes: int
    def __init__(self, workers: _Optional[int] = ..., ready: _Optional[int] = ..., busy: _Optional[int] = ..., restarts: _Optional[int] = ..., busy_seconds: _Optional[float] = ..., utilization: _Optional[float] = ..., tasks_in_flight: _Optional[int] = ..., slots_in_use: _Optional[int] = ..., max_slots: _Optional[int] = ..., shm_bytes: _Optional[int] = ..., leases_held: _Optional[int] = ..., sessions: _Optional[int] = ..., batches_rebuilt: _Optional[int] = ..., min_workers: _Optional[int] = ..., max_workers: _Optional[int] = ..., cpu_quota: _Optional[float] = ..., scale_ups: _Optional[int] = ..., scale_downs: _Optional[int] = ..., worker_stats: _Optional[_Iterable[_Union[WorkerStats, _Mapping]]] = ..., scheduler_rounds: _Optional[int] = ..., scheduler_waits: _Optional[int] = ..., scheduler_timeouts: _Optional[int] = ..., scheduler_wakeups: _Optional[int] = ..., scheduler_dispatches: _Optional[int] = ..., scheduler_passes: _Optional[int] = ...) -> None: ...

class StatsTotals(_message.Message):
    __slots__ = ("streams_started", "streams_finished", "streams_failed", "streams_cancelled", "batches_sent", "samples_sent", "bytes_sent", "samples_skipped", "bytes_copied_shm", "bytes_copied_inline", "hedge_streams_started", "hedge_batches_built", "hedge_batches_sent", "describe_dataset_calls", "list_datasets_calls", "release_leases_calls", "stats_calls", "batches_calls_started", "control_messages", "batches_granted", "batches_revoked", "leases_released_on_calls", "leases_released_by_rpc", "control_frames", "data_messages", "put_weights_calls", "weights_bytes_received", "bytes_copied_socket", "data_plane_bytes_sent", "data_connections_accepted", "data_connections_refused")
    STREAMS_STARTED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FINISHED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FAILED_FIELD_NUMBER: _ClassVar[int]
    STREAMS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SENT_FIELD_NUMBER: _ClassVar[int]
    BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    SAMPLES_SKIPPED_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_SHM_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_INLINE_FIELD_NUMBER: _ClassVar[int]
    HEDGE_STREAMS_STARTED_FIELD_NUMBER: _ClassVar[int]
    HEDGE_BATCHES_BUILT_FIELD_NUMBER: _ClassVar[int]
    HEDGE_BATCHES_SENT_FIELD_NUMBER: _ClassVar[int]
    DESCRIBE_DATASET_CALLS_FIELD_NUMBER: _ClassVar[int]
    LIST_DATASETS_CALLS_FIELD_NUMBER: _ClassVar[int]
    RELEASE_LEASES_CALLS_FIELD_NUMBER: _ClassVar[int]
    STATS_CALLS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_CALLS_STARTED_FIELD_NUMBER: _ClassVar[int]
    CONTROL_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    BATCHES_GRANTED_FIELD_NUMBER: _ClassVar[int]
    BATCHES_REVOKED_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_ON_CALLS_FIELD_NUMBER: _ClassVar[int]
    LEASES_RELEASED_BY_RPC_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FRAMES_FIELD_NUMBER: _ClassVar[int]
    DATA_MESSAGES_FIELD_NUMBER: _ClassVar[int]
    PUT_WEIGHTS_CALLS_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    BYTES_COPIED_SOCKET_FIELD_NUMBER: _ClassVar[int]
    DATA_PLANE_BYTES_SENT_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    DATA_CONNECTIONS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    streams_started: int
    streams_finished: int
    streams_failed: int
    streams_cancelled: int
    batches_sent: int
    samples_sent: int
    bytes_sent: int
    samples_skipped: int
    bytes_copied_shm: int
    bytes_copied_inline: int
    hedge_streams_started: int
    hedge_batches_built: int
    hedge_batches_sent: int
    describe_dataset_calls: int
    list_datasets_calls: int
    release_leases_calls: int
    stats_calls: int
    batches_calls_started: int
    control_messages: int
    batches_granted: int
    batches_revoked: int
    leases_released_on_calls: int
    leases_released_by_rpc: int
    control_frames: int
    data_messages: int
    put_weights_calls: int
    weights_bytes_received: int
    bytes_copied_socket: int
    data_plane_bytes_sent: int
    data_connections_accepted: int
    data_connections_refused: int
    def __init__(self, streams_started: _Optional[int] = ..., streams_finished: _Optional[int] = ..., streams_failed: _Optional[int] = ..., streams_cancelled: _Optional[int] = ..., batches_sent: _Optional[int] = ..., samples_sent: _Optional[int] = ..., bytes_sent: _Optional[int] = ..., samples_skipped: _Optional[int] = ..., bytes_copied_shm: _Optional[int] = ..., bytes_copied_inline: _Optional[int] = ..., hedge_streams_started: _Optional[int] = ..., hedge_batches_built: _Optional[int] = ..., hedge_batches_sent: _Optional[int] = ..., describe_dataset_calls: _Optional[int] = ..., list_datasets_calls: _Optional[int] = ..., release_leases_calls: _Optional[int] = ..., stats_calls: _Optional[int] = ..., batches_calls_started: _Optional[int] = ..., control_messages: _Optional[int] = ..., batches_granted: _Optional[int] = ..., batches_revoked: _Optional[int] = ..., leases_released_on_calls: _Optional[int] = ..., leases_released_by_rpc: _Optional[int] = ..., control_frames: _Optional[int] = ..., data_messages: _Optional[int] = ..., put_weights_calls: _Optional[int] = ..., weights_bytes_received: _Optional[int] = ..., bytes_copied_socket: _Optional[int] = ..., data_plane_bytes_sent: _Optional[int] = ..., data_connections_accepted: _Optional[int] = ..., data_connections_refused: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("uptime_seconds", "version", "streams", "pool", "totals", "cache")
    UPTIME_SECONDS_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STREAMS_FIELD_NUMBER: _ClassVar[int]
    POOL_FIELD_NUMBER: _ClassVar[int]
    TOTALS_FIELD_NUMBER: _ClassVar[int]
    CACHE_FIELD_NUMBER: _ClassVar[int]
    uptime_seconds: float
    version: str
    streams: _containers.RepeatedCompositeFieldContainer[StreamStats]
    pool: PoolStats
    totals: StatsTotals
    cache: _containers.RepeatedCompositeFieldContainer[CacheStats]
    def __init__(self, uptime_seconds: _Optional[float] = ..., version: _Optional[str] = ..., streams: _Optional[_Iterable[_Union[StreamStats, _Mapping]]] = ..., pool: _Optional[_Union[PoolStats, _Mapping]] = ..., totals: _Optional[_Union[StatsTotals, _Mapping]] = ..., cache: _Optional[_Iterable[_Union[CacheStats, _Mapping]]] = ...) -> None: ...

class CacheStats(_message.Message):
    __slots__ = ("dataset", "hits", "hits_disk", "misses", "bytes_ram", "bytes_disk", "evictions", "not_admitted", "errors")
    DATASET_FIELD_NUMBER: _ClassVar[int]
    HITS_FIELD_NUMBER: _ClassVar[int]
    HITS_DISK_FIELD_NUMBER: _ClassVar[int]
    MISSES_FIELD_NUMBER: _ClassVar[int]
    BYTES_RAM_FIELD_NUMBER: _ClassVar[int]
    BYTES_DISK_FIELD_NUMBER: _ClassVar[int]
    EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NOT_ADMITTED_FIELD_NUMBER: _ClassVar[int]
    ERRORS_FIELD_NUMBER: _ClassVar[int]
    dataset: str
    hits: int
    hits_disk: int
    misses: int
    bytes_ram: int
    bytes_disk: int
    evictions: int
    not_admitted: int
    errors: int
    def __init__(self, dataset: _Optional[str] = ..., hits: _Optional[int] = ..., hits_disk: _Optional[int] = ..., misses: _Optional[int] = ..., bytes_ram: _Optional[int] = ..., bytes_disk: _Optional[int] = ..., evictions: _Optional[int] = ..., not_admitted: _Optional[int] = ..., errors: _Optional[int] = ...) -> None: ...
