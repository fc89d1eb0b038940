"""What a ``RemoteDataLoader`` was asked for, checked once in the caller's thread: ``LoaderOptions``.

Every server connection of a loader (one, or several built in pool threads) reads the same
options, so the device is resolved here, where the caller's CUDA device is current: in DDP rank
r after ``torch.cuda.set_device(r)``, ``device="cuda"`` means ``cuda:r`` on every connection.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from batchd.client.channel import DEFAULT_MAX_MESSAGE_BYTES, TLS, resolve_token, tls_settings
from batchd.client.distributed import rank_and_world_size
from batchd.client.hedge import HedgePolicy, hedge_policy
from batchd.v1 import loader_pb2 as pb

TRANSPORTS = ("auto", "shm", "socket", "inline")


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
    if device is None:
        return torch.device("cpu")
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}") from None
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
    if resolved.index is None:
        if current_index is None:
            if not torch.cuda.is_available():
                raise RuntimeError(f"device={device} requested but CUDA is not available")
            current_index = torch.cuda.current_device
        resolved = torch.device("cuda", current_index())
    return resolved


@dataclass(slots=True, eq=False)
class LoaderOptions:
    """A loader's settings, validated on construction (see ``RemoteDataLoader`` for their meaning).

    Units: ``timeout``, ``connect_timeout``, ``reconnect_timeout``, ``failover_timeout``,
    ``probe_interval`` in seconds; ``prefetch`` in batches; ``max_message_bytes`` in bytes.
    ``pipeline`` is the wire form of ``transform``; ``compression`` a ``pb.Compression``;
    ``device`` has its CUDA index resolved; ``hedge`` is the hedging policy of a several-servers
    loader (None: no hedging). Raises ValueError naming the bad field.
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
    compression: int = pb.COMPRESSION_NONE
    reconnect_timeout: float = 60.0
    failover_timeout: float = 5.0
    probe_interval: float = 5.0
    tls: TLS | None = None
    token: str | None = None
    strict: bool = True
    gpu_transform: Callable[..., torch.Tensor] | None = None
    decode_on_client: bool = False
    collate_fn: Callable[[list[dict[str, Any]]], Any] | None = None
    hedge: HedgePolicy | None = None

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
        if self.gpu_transform is not None and not callable(self.gpu_transform):
            raise ValueError(f"gpu_transform must be None or a callable, got {type(self.gpu_transform).__name__}")
        if self.collate_fn is not None and not callable(self.collate_fn):
            raise ValueError(f"collate_fn must be None or a callable, got {type(self.collate_fn).__name__}")
        self.strict = bool(self.strict)
        if not isinstance(self.decode_on_client, bool):
            raise ValueError(f"decode_on_client must be True or False, got {self.decode_on_client!r}")

    @classmethod
    def from_arguments(cls, dataset: str, *, transform: Any = None, rank: int | None = None,
                       world_size: int | None = None, device: Any = None, compression: str | None = None,
                       tls: Any = None, tls_ca: Any = None, tls_cert: Any = None, tls_key: Any = None,
                       token: str | None = None, hedge: Any = True, **rest: Any) -> "LoaderOptions":
        """From ``RemoteDataLoader``'s keyword arguments (``rest``: the fields of the same name).

        Resolves rank and world size (``batchd.client.distributed``), the device's CUDA index,
        TLS, the token and the hedging policy (``hedge_policy``); raises ValueError (RuntimeError:
        CUDA asked for but unavailable).
        """
        if compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {compression!r}")
        rank, world_size = rank_and_world_size(rank, world_size)
        return cls(dataset, pipeline=pipeline_of(transform), rank=rank, world_size=world_size,
                   device=resolve_device(device),
                   compression=pb.COMPRESSION_LZ4 if compression == "lz4" else pb.COMPRESSION_NONE,
                   tls=tls_settings(tls, tls_ca, tls_cert, tls_key), token=resolve_token(token),
                   hedge=hedge_policy(hedge), **rest)
