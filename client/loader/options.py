"""What a ``RemoteDataLoader`` was asked for, checked once in the caller's thread: ``LoaderOptions``.

Every server connection of a loader (one, or several built in pool threads) reads the same
options, so the device is resolved here, where the caller's CUDA device is current: in DDP rank
r after ``torch.cuda.set_device(r)``, ``device="cuda"`` means ``cuda:r`` on every connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Generic, TypeVar, overload

import torch

from batchd.client.transport.channel import DEFAULT_MAX_MESSAGE_BYTES, TLS, resolve_token, tls_settings
from batchd.client.loader.distributed import rank_and_world_size
from batchd.client.device.collate import bind_bbox_format
from batchd.client.loader import sampling
from batchd.client.loader.sampling import Mix, WeightedRandomSampler
from batchd.v1 import loader_pb2 as pb

TRANSPORTS = ("auto", "shm", "socket", "inline")

T = TypeVar("T")


def pipeline_of(transform: Any) -> pb.Pipeline | None:
    """None, a preset name, or an albumentations transform (sent as JSON of ``A.to_dict``).

    Raises ValueError for anything else (an empty name, another type).
    """
    if transform is None:
        return None
    if isinstance(transform, str):
        if not transform:
            raise ValueError("transform must be None, a preset name or an albumentations transform, not ''")
        return pb.Pipeline(preset=transform)
    import albumentations as A

    if not isinstance(transform, A.BaseCompose | A.BasicTransform):
        raise ValueError(f"transform must be None, a preset name or an albumentations transform, "
                         f"not {type(transform).__name__}")
    if not isinstance(transform, A.Compose):
        transform = A.Compose([transform])
    return pb.Pipeline(albumentations_json=json.dumps(A.to_dict(transform), sort_keys=True))


def resolve_device(device: Any, current_index: Callable[[], int] | None = None) -> torch.device:
    """The device batches go to, with a CUDA index fixed now.

    device: None or "cpu" (CPU tensors), "cuda", "cuda:N" or a ``torch.device``. "cuda" without
    an index means the calling thread's current CUDA device (``current_index()``, default
    ``torch.cuda.current_device``), as ``torch.device("cuda")`` does for tensors.
    Raises ValueError for another device type, RuntimeError if a CUDA device is asked for and
    CUDA is not available (only checked when the index must be looked up; ``CudaTransfer``
    checks the rest).
    """
    try:
        resolved = torch.device("cpu" if device is None else device)
    except (RuntimeError, TypeError):
        resolved = None
    if resolved is None or resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
    if resolved.type == "cuda" and resolved.index is None:
        if current_index is None:
            if not torch.cuda.is_available():
                raise RuntimeError(f"device={device} requested but CUDA is not available")
            current_index = torch.cuda.current_device
        resolved = torch.device("cuda", current_index())
    return resolved


@dataclass(slots=True, eq=False)
class LoaderOptions:
    """A loader's settings, validated on construction (see ``RemoteDataLoader`` for their meaning).

    Units: ``timeout``, ``connect_timeout``, ``reconnect_timeout``, ``probe_interval`` in
    seconds; ``prefetch`` in batches; ``max_message_bytes`` in bytes. ``pipeline`` is the wire
    form of ``transform``; ``compression`` a ``pb.Compression``; ``device`` has its CUDA index
    resolved; ``hedge``: a stalled server's batches go to the other servers (several servers).
    ``sampler`` (a ``WeightedRandomSampler``) or ``mix`` (a ``Mix``, whose ``name`` is then
    ``dataset``, and ``source_pipelines`` its sources' pipelines in wire form):
    ``batchd.client.loader.sampling``. Raises ValueError naming the bad field.
    """

    dataset: str
    batch_size: int = 1
    shuffle: bool = False
    seed: int = 0
    drop_last: bool = False
    pipeline: pb.Pipeline | None = None
    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    prefetch: int = 2
    timeout: float = 120.0
    connect_timeout: float = 10.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    transport: str = "auto"
    relay: bool | str = "auto"
    compression: int = pb.COMPRESSION_NONE
    reconnect_timeout: float = 60.0
    probe_interval: float = 5.0
    tls: TLS | None = None
    token: str | None = None
    strict: bool = True
    gpu_transform: Callable[..., torch.Tensor] | None = None
    decode_on_client: bool = False
    collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None
    hedge: bool = True
    sampler: WeightedRandomSampler | None = None
    mix: Mix | None = None
    source_pipelines: dict[str, pb.Pipeline | None] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.dataset, str) or not self.dataset:
            raise ValueError(f"dataset must be a non-empty name, got {self.dataset!r}")
        if not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {self.batch_size!r}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {self.world_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, world_size={self.world_size}), got {self.rank!r}")
        if not isinstance(self.prefetch, int) or self.prefetch < 1:
            raise ValueError(f"prefetch must be a positive integer, got {self.prefetch!r}")
        if not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")
        if self.timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {self.timeout!r}")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        if self.relay not in ("auto", True, False):
            raise ValueError(f"relay must be 'auto', True or False, got {self.relay!r}")
        if self.gpu_transform is not None and not callable(self.gpu_transform):
            raise ValueError(f"gpu_transform must be None or a callable, got {type(self.gpu_transform).__name__}")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise ValueError(f"collate_fn must be None or a callable, got {type(self.collate_fn).__name__}")
        self.strict = bool(self.strict)
        if not isinstance(self.decode_on_client, bool):
            raise ValueError(f"decode_on_client must be True or False, got {self.decode_on_client!r}")
        if not isinstance(self.hedge, bool):
            raise ValueError(f"hedge must be True or False, got {self.hedge!r}")
        if self.probe_interval <= 0:
            raise ValueError(f"probe_interval must be positive seconds, got {self.probe_interval!r}")
        if self.mix is not None and self.decode_on_client:
            raise ValueError("decode_on_client is not available for a Mix (its sources' pipelines run on the server)")

    @classmethod
    def from_arguments(cls, dataset: str, *, transform: Any = None, rank: int | None = None,
                       world_size: int | None = None, device: Any = None, compression: str | None = None,
                       tls: Any = None, tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None,
                       token: str | None = None, sampler: Any = None, **rest: Any) -> "LoaderOptions":
        """From ``RemoteDataLoader``'s keyword arguments (``rest``: the fields of the same name).

        Resolves rank and world size (``batchd.client.loader.distributed``), the device's CUDA index,
        TLS, the token and a sampler or mix (``sampling.resolve``); raises ValueError (RuntimeError:
        CUDA asked for but unavailable).
        """
        if compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {compression!r}")
        order = sampling.resolve(dataset, transform, sampler, rest.get("shuffle", False), pipeline_of)
        rank, world_size = rank_and_world_size(rank, world_size)
        rest["collate_fn"] = bind_bbox_format(rest.get("collate_fn"), transform)  # detection_collate: xyxy boxes
        return cls(**order, rank=rank, world_size=world_size,
                   device=resolve_device(device),
                   compression=pb.COMPRESSION_LZ4 if compression == "lz4" else pb.COMPRESSION_NONE,
                   tls=tls_settings(tls, tls_ca, tls_cert, tls_key), token=resolve_token(token), **rest)


class Setting(Generic[T]):
    """A read-only attribute of a loader, the ``LoaderOptions`` field of the same name:
    ``batch_size = Setting[int]()`` in the class body makes ``loader.batch_size`` read
    ``loader.options.batch_size`` (typed ``int`` for type checkers). Setting it raises
    AttributeError: the options were checked once, at construction."""

    def __set_name__(self, owner: type, name: str) -> None:
        if name not in LoaderOptions.__dataclass_fields__:
            raise TypeError(f"{owner.__name__}.{name}: LoaderOptions has no field {name!r}")
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type) -> "Setting[T]": ...

    @overload
    def __get__(self, loader: object, owner: type | None = None) -> T: ...

    def __get__(self, loader: Any, owner: Any = None) -> Any:
        if loader is None:
            return self
        return getattr(loader.options, self.name)

    def __set__(self, loader: Any, value: Any) -> None:
        raise AttributeError(f"{self.name} is read-only: it was checked when the loader was built")


class LoaderSettings:
    """A loader's settings as read-only attributes, each typed: ``loader.batch_size`` is
    ``loader.options.batch_size`` (``RemoteDataLoader`` has them; ``options`` is its
    ``LoaderOptions``, checked once at construction)."""

    options: LoaderOptions

    dataset = Setting[str]()
    """the dataset's name on the server"""
    batch_size = Setting[int]()
    """samples per batch, per rank"""
    shuffle = Setting[bool]()
    """a new permutation each epoch"""
    seed = Setting[int]()
    """the seed of the shuffle and of every sample's augmentation stream"""
    drop_last = Setting[bool]()
    """the last partial batch is dropped (and ranks' shards are not padded)"""
    rank = Setting[int]()
    """this process's shard"""
    world_size = Setting[int]()
    """the number of shards"""
    device = Setting[torch.device]()
    """where batches go, its CUDA index resolved (``cpu`` or ``cuda:N``)"""
    prefetch = Setting[int]()
    """the fewest batches a server is asked to build ahead"""
    timeout = Setting[float]()
    """seconds without a batch before iteration raises ``batchd.TimeoutError``"""
    connect_timeout = Setting[float]()
    """seconds to reach a server before ``batchd.ConnectionError``"""
    max_message_bytes = Setting[int]()
    """the largest gRPC message accepted, bytes"""
    transport = Setting[str]()
    """how batches come: ``"auto"``, ``"shm"``, ``"socket"`` or ``"inline"``"""
    relay = Setting[bool | str]()
    """whether a relay process receives the data plane's batches: ``"auto"``, True or False"""
    compression = Setting[int]()
    """inline batches' compression, a ``pb.Compression`` (``COMPRESSION_NONE`` or ``COMPRESSION_LZ4``)"""
    reconnect_timeout = Setting[float]()
    """seconds to keep reconnecting a broken call (0: do not)"""
    probe_interval = Setting[float]()
    """several servers: seconds between probes and readings of the address"""
    tls = Setting[TLS | None]()
    """the TLS settings (None: plaintext)"""
    token = Setting[str | None]()
    """the bearer token sent (None: none)"""
    strict = Setting[bool]()
    """batches that cannot be the same bytes are refused"""
    gpu_transform = Setting[Callable[..., torch.Tensor] | None]()
    """the function finishing each batch where it lands, or None"""
    decode_on_client = Setting[bool]()
    """JPEG files are decoded here, not on the server"""
    collate_fn = Setting[Callable[[list[dict[str, Any]]], Any] | None]()
    """the function making each batch from its samples, or None (the dict batch)"""
    hedge = Setting[bool]()
    """several servers: a stalled server's batches go to the others (the first copy wins)"""
    pipeline = Setting[pb.Pipeline | None]()
    """the wire form of ``transform`` (None: images as decoded)"""
    sampler = Setting[WeightedRandomSampler | None]()
    """the weighted sampler drawing each epoch (None: the dataset's order, shuffled or not)"""
    mix = Setting[Mix | None]()
    """the datasets mixed, when the dataset is a ``batchd.Mix`` (then ``dataset`` is its name)"""
    source_pipelines = Setting[dict[str, pb.Pipeline | None]]()
    """a mix's pipeline per source, wire form ({} for one dataset)"""
