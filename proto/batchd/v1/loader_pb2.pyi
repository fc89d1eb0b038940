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

class Compression(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    COMPRESSION_NONE: _ClassVar[Compression]
    COMPRESSION_LZ4: _ClassVar[Compression]
TRANSPORT_INLINE: Transport
TRANSPORT_SHARED_MEMORY: Transport
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
    __slots__ = ("session", "leases")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    LEASES_FIELD_NUMBER: _ClassVar[int]
    session: str
    leases: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, session: _Optional[str] = ..., leases: _Optional[_Iterable[int]] = ...) -> None: ...

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
    __slots__ = ("name",)
    NAME_FIELD_NUMBER: _ClassVar[int]
    name: str
    def __init__(self, name: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("name", "kind", "num_samples", "class_names", "sample")
    NAME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    CLASS_NAMES_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    name: str
    kind: str
    num_samples: int
    class_names: _containers.RepeatedScalarFieldContainer[str]
    sample: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, name: _Optional[str] = ..., kind: _Optional[str] = ..., num_samples: _Optional[int] = ..., class_names: _Optional[_Iterable[str]] = ..., sample: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class Pipeline(_message.Message):
    __slots__ = ("preset", "albumentations_json")
    PRESET_FIELD_NUMBER: _ClassVar[int]
    ALBUMENTATIONS_JSON_FIELD_NUMBER: _ClassVar[int]
    preset: str
    albumentations_json: str
    def __init__(self, preset: _Optional[str] = ..., albumentations_json: _Optional[str] = ...) -> None: ...

class StreamBatchesRequest(_message.Message):
    __slots__ = ("dataset", "pipeline", "batch_size", "shuffle", "seed", "epoch", "drop_last", "rank", "world_size", "start_batch", "prefetch", "transport", "session", "compression")
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
    def __init__(self, dataset: _Optional[str] = ..., pipeline: _Optional[_Union[Pipeline, _Mapping]] = ..., batch_size: _Optional[int] = ..., shuffle: _Optional[bool] = ..., seed: _Optional[int] = ..., epoch: _Optional[int] = ..., drop_last: _Optional[bool] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., start_batch: _Optional[int] = ..., prefetch: _Optional[int] = ..., transport: _Optional[_Union[Transport, str]] = ..., session: _Optional[str] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("name", "dtype", "shape", "data", "offset", "compression")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    COMPRESSION_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    offset: int
    compression: Compression
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ..., offset: _Optional[int] = ..., compression: _Optional[_Union[Compression, str]] = ...) -> None: ...

class Batch(_message.Message):
    __slots__ = ("batch_index", "epoch", "num_batches", "tensors", "segment", "lease", "skipped_indices")
    BATCH_INDEX_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    NUM_BATCHES_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    SEGMENT_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    SKIPPED_INDICES_FIELD_NUMBER: _ClassVar[int]
    batch_index: int
    epoch: int
    num_batches: int
    tensors: _containers.RepeatedCompositeFieldContainer[Tensor]
    segment: str
    lease: int
    skipped_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, batch_index: _Optional[int] = ..., epoch: _Optional[int] = ..., num_batches: _Optional[int] = ..., tensors: _Optional[_Iterable[_Union[Tensor, _Mapping]]] = ..., segment: _Optional[str] = ..., lease: _Optional[int] = ..., skipped_indices: _Optional[_Iterable[int]] = ...) -> None: ...

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
