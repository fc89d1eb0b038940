"""The server's YAML config, validated on load: ``ServerConfig`` and ``load_config``.

Example::

    address: 127.0.0.1:50051
    workers: 2
    datasets:
      fmnist-train: {kind: fashion-mnist, root: /usr/share/datasets/fashion-mnist, split: train}
      photos:       {kind: imagefolder, root: /data/photos}
      pets:         {kind: manifest, path: /data/pets.csv}
    pipelines:
      train: {__version__: 2.0.8, transform: {...}}   # as albumentations' A.to_dict returns
      eval: /etc/batchd/eval.json                     # or a file that A.save wrote
      mine: {python: "mypkg.aug:make_train", args: {size: 224}}   # operator-side Python

Every model forbids unknown fields, so a typo is an error that names the field. The blocks live
one idea a file and are re-exported here, so ``batchd.server.config`` names them all:
datasets.py (the dataset kinds), security.py (tls, auth, pipeline_limits), cache.py (cache),
dataplane.py (data_plane), base.py (the strict model they share).
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from .base import StrictModel
from .cache import CacheConfig
from .dataplane import DataPlaneConfig
from .datasets import (
    CocoConfig,
    FACTORY_PATTERN,
    DatasetConfig,
    FashionMnistConfig,
    ImageFolderConfig,
    Location,
    ManifestConfig,
    PythonConfig,
    SegmentationConfig,
    WebDatasetConfig,
)
from .security import MIN_TOKEN_CHARS, AuthConfig, PipelineLimits, TlsConfig, TokenConfig
from .workers import WorkerRange

__all__ = [
    "AuthConfig",
    "CacheConfig",
    "CocoConfig",
    "ConfigError",
    "DataPlaneConfig",
    "DatasetConfig",
    "FashionMnistConfig",
    "ImageFolderConfig",
    "Location",
    "MIN_TOKEN_CHARS",
    "ManifestConfig",
    "MiB",
    "PipelineLimits",
    "PythonConfig",
    "SegmentationConfig",
    "ServerConfig",
    "TlsConfig",
    "TokenConfig",
    "WebDatasetConfig",
    "WorkerRange",
    "load_config",
]

MiB = 1 << 20


class ServerConfig(StrictModel):
    """Everything ``batchd serve`` needs.

    address: ``HOST:PORT`` (port 0 picks a free one) or ``unix:PATH``; or a list of them: the
        server listens on all (e.g. a unix socket for its sidecar trainer and a TCP port for
        Kubernetes gRPC probes). The first is ``address``, the others ``also_listen``.
    workers: worker processes decoding and augmenting, each building whole batches: a count (a
        fixed pool), or ``{min, max}`` (``WorkerRange``): the server starts workers while clients
        wait for data and retires idle ones, within max and the container's CPU limit.
    datasets: name -> dataset; clients name datasets, never paths.
    pipelines: preset name -> albumentations pipeline (``A.to_dict`` form, or a file path), or
        ``{python: "package.module:factory", args: {...}}``: an operator-side Python pipeline
        (``factory(**args)`` returns ``fn(sample, rng) -> sample``; server/compute/python_pipeline.py).
    python_path: folders put at the front of ``sys.path`` in the server and its workers, where
        ``kind: python`` factories and python pipelines are imported from (besides installed
        packages and PYTHONPATH); ``batchd serve --python-path DIR`` adds more.
    cache_dir: where dataset indexes (e.g. decompressed IDX files) are kept between runs.
    default_prefetch: batches computed ahead per stream when the client sends 0.
    max_prefetch, max_batch_size: requests above these are refused (INVALID_ARGUMENT).
    max_message_bytes: gRPC send/receive limit, bytes; a 256 x 224 x 224 x 3 uint8 batch is 38.5 MB.
    worker_timeout_s: a batch that takes longer than this fails the stream (seconds).
    reads_in_flight: sample reads each worker keeps running at once on its I/O threads, for its
        current batch and the next ones queued for it, while it decodes (hides storage latency:
        NFS, FUSE, object stores); 1 reads one sample at a time. Reads much faster than the work
        per sample (a page-cached local disk) are made on the worker's own thread instead
        (``server/data/reader.py``).
    max_task_retries: times a batch is rebuilt after its worker died before the stream fails.
    grpc_threads: threads serving RPCs; each open stream and shared-memory session holds one, and an
        eighth (at least 2) is kept for short calls (Stats, ReleaseLeases, health): streams and
        sessions beyond the rest are refused (RESOURCE_EXHAUSTED; see server/app.py).
    max_slots: shared-memory batch slots; at most this many batches exist at once (bounds memory).
    max_leases_per_session: slots a same-host client may hold at once over the shared-memory
        transport (on top of max_slots); at the cap a stream waits up to 2 s for one to come back,
        then (and while the client keeps them all) sends inline. 0 disables the transport.
    share_window: streams whose requests agree on everything that fixes the bytes (dataset,
        pipeline, batch_size, shuffle, seed, epoch, drop_last, rank, world_size) share one
        computation while they are within this many batches of each other; a reader further
        behind gets its batches recomputed. 0 disables sharing.
    metrics_port: serve Prometheus metrics over HTTP on this port (``/metrics``; 0 picks a free
        one), on the host of ``address`` (127.0.0.1 for a unix: address). None: no endpoint.
    tls: serve TLS on TCP addresses (and, with ``client_ca``, verify client certificates); None:
        plaintext. A unix: socket stays plaintext, protected by its file mode.
    auth: bearer tokens and the datasets each may read; None: no authentication (every client
        may read every dataset; a warning is logged when listening beyond loopback).
    unix_socket_mode: permissions of a ``unix:`` socket file (no bits for others allowed).
    max_streams: open StreamBatches and Batches calls at once; more are refused (RESOURCE_EXHAUSTED).
    max_grants: batches a Batches call may have granted and not yet received at once (its
        client's window); a grant beyond it fails the call (RESOURCE_EXHAUSTED). Built batches
        waiting to be sent hold shared-memory slots, so max_slots bounds them as well.
    max_batch_bytes: a batch larger than this (all its tensors) fails its stream (RESOURCE_EXHAUSTED).
    max_request_bytes: gRPC receive limit for requests (they are small; batches are only sent).
    max_weights_bytes: weight vectors (weighted sampling) clients sent with PutWeights that the
        server holds, bytes (8 per weight); beyond it those used least recently are dropped (a
        client sends them again when it needs them). Datasets' own weights do not count.
    pipeline_limits: what a client-sent albumentations pipeline may contain (see allowlist.py).
    cache: the decoded-sample cache (``{memory_bytes, disk_dir, disk_bytes}``, see CacheConfig).
    data_plane: the TCP port that carries batch bytes to remote clients beside their calls
        (``{enabled, port, token_ttl_s}`` and its handshake limits, see DataPlaneConfig; by
        default on the gRPC port + 1; TLS whenever ``tls`` is set).
    """

    address: str = "127.0.0.1:50051"
    also_listen: tuple[str, ...] = ()
    workers: int | WorkerRange = Field(default_factory=lambda: max(1, os.cpu_count() or 1))
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict)
    pipelines: dict[str, Any] = Field(default_factory=dict)
    python_path: tuple[pathlib.Path, ...] = ()
    cache_dir: pathlib.Path = Field(
        default_factory=lambda: pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "batchd"
    )
    default_prefetch: int = Field(default=4, ge=1)
    max_prefetch: int = Field(default=64, ge=1)
    max_batch_size: int = Field(default=4096, ge=1)
    max_message_bytes: int = Field(default=512 * MiB, ge=4 * MiB)
    worker_timeout_s: float = Field(default=300.0, gt=0)
    reads_in_flight: int = Field(default=32, ge=1, le=1024)
    max_task_retries: int = Field(default=3, ge=0)
    grpc_threads: int = Field(default=64, ge=2)
    max_slots: int = Field(default=64, ge=2)
    max_leases_per_session: int = Field(default=8, ge=0)
    share_window: int = Field(default=16, ge=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    tls: TlsConfig | None = None
    auth: AuthConfig | None = None
    unix_socket_mode: int = Field(default=0o600, ge=0, le=0o770)
    max_streams: int = Field(default=32, ge=1)
    max_grants: int = Field(default=256, ge=1)
    max_batch_bytes: int = Field(default=1 << 30, ge=MiB)
    max_request_bytes: int = Field(default=MiB, ge=64 * 1024)
    max_weights_bytes: int = Field(default=256 * MiB, ge=MiB)
    pipeline_limits: PipelineLimits = Field(default_factory=PipelineLimits)
    cache: CacheConfig = Field(default_factory=CacheConfig)
    data_plane: DataPlaneConfig = Field(default_factory=DataPlaneConfig)

    @model_validator(mode="before")
    @classmethod
    def _address_list(cls, data: Any) -> Any:
        """``address: [A, B, ...]`` -> address A, also_listen (B, ...)."""
        if isinstance(data, dict) and isinstance(data.get("address"), (list, tuple)):
            addresses = list(data["address"])
            if not addresses:
                raise ValueError("address: give at least one HOST:PORT or unix:PATH")
            if data.get("also_listen"):
                raise ValueError("give either a list of addresses or also_listen, not both")
            data = {**data, "address": addresses[0], "also_listen": tuple(addresses[1:])}
        return data

    @field_validator("workers", mode="before")
    @classmethod
    def _parse_workers(cls, v: Any) -> Any:
        """A mapping is a range (its errors name its fields); anything else must be a count in [1, 512]."""
        if isinstance(v, dict):
            try:
                return WorkerRange.model_validate(v)
            except ValidationError as e:
                raise ValueError("; ".join(
                    ".".join(map(str, err["loc"])) + (": " if err["loc"] else "") + err["msg"].removeprefix("Value error, ")
                    for err in e.errors())) from None
        if isinstance(v, bool) or not isinstance(v, (int, WorkerRange)) or (isinstance(v, int) and not 1 <= v <= 512):
            raise ValueError(f"expected a worker count in [1, 512] or {{min, max}}, got {v!r}")
        return v

    @property
    def min_workers(self) -> int:
        """Workers the pool starts with (and keeps at least): ``workers`` or ``workers.min``."""
        return self.workers if isinstance(self.workers, int) else self.workers.min

    @property
    def max_workers(self) -> int:
        """The most workers the pool may run: ``workers`` or ``workers.max`` (before the CPU limit)."""
        return self.workers if isinstance(self.workers, int) else self.workers.max

    @field_validator("also_listen")
    @classmethod
    def _check_also_listen(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for a in v:
            cls._check_address(a)
        if len(set(v)) != len(v):
            raise ValueError(f"an address is listed twice: {list(v)}")
        return v

    @field_validator("address")
    @classmethod
    def _check_address(cls, v: str) -> str:
        if v.startswith("unix:"):
            if len(v) <= len("unix:"):
                raise ValueError("unix address needs a path, e.g. unix:/run/batchd.sock")
            return v
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
            raise ValueError(f"address {v!r} is neither HOST:PORT nor unix:PATH")
        return v

    @field_validator("unix_socket_mode", mode="before")
    @classmethod
    def _parse_mode(cls, v: Any) -> Any:
        if isinstance(v, str):  # "0660" / "0o660" (YAML 1.1 already reads a bare 0660 as octal)
            try:
                v = int(v, 8)
            except ValueError:
                raise ValueError(f"expected an octal mode such as 0o600 or 0o660, got {v!r}") from None
        if isinstance(v, int) and v & 0o007:
            raise ValueError(f"mode {v:#o} gives others access to the socket; use 0o600 or 0o660")
        return v

    @field_validator("datasets")
    @classmethod
    def _check_dataset_names(cls, v: dict[str, Any]) -> dict[str, Any]:
        for name in v:
            if not name or "/" in name or name.strip() != name:
                raise ValueError(f"dataset name {name!r} must be non-empty, without '/' or surrounding spaces")
        return v

    @field_validator("pipelines")
    @classmethod
    def _load_pipelines(cls, v: dict[str, Any]) -> dict[str, Any]:
        loaded = {}
        for name, spec in v.items():
            if isinstance(spec, (str, pathlib.Path)):
                path = pathlib.Path(spec)
                try:
                    text = path.read_text()
                except OSError as e:
                    raise ValueError(f"pipelines.{name}: cannot read {path}: {e.strerror}") from None
                try:
                    spec = yaml.safe_load(text)  # A.save writes JSON (a subset of YAML) or YAML
                except yaml.YAMLError as e:
                    raise ValueError(f"pipelines.{name}: {path} is not JSON or YAML: {e}") from None
            if spec is not None and not isinstance(spec, dict):
                raise ValueError(f"pipelines.{name}: expected an albumentations dict (A.to_dict), a file path, "
                                 "or {python: 'package.module:factory', args: {...}}")
            if isinstance(spec, dict) and "python" in spec:
                try:
                    spec = PythonPipelineConfig.model_validate(spec).model_dump()
                except ValidationError as e:
                    where = ", ".join(".".join(map(str, err["loc"])) + ": " + err["msg"] for err in e.errors())
                    raise ValueError(f"pipelines.{name}: {where}") from None
            loaded[name] = spec
        return loaded

    @model_validator(mode="after")
    def _check_prefetch(self) -> "ServerConfig":
        if self.default_prefetch > self.max_prefetch:
            raise ValueError(f"default_prefetch ({self.default_prefetch}) exceeds max_prefetch ({self.max_prefetch})")
        if self.auth is not None:
            for t in self.auth.tokens:
                unknown = sorted(set(t.datasets) - set(self.datasets) - {"*"})
                if unknown:
                    raise ValueError(f"auth token {t.name!r} names datasets this server does not have: {unknown}")
        if self.pipeline_limits.max_json_bytes > self.max_request_bytes:
            raise ValueError(f"pipeline_limits.max_json_bytes ({self.pipeline_limits.max_json_bytes}) exceeds "
                             f"max_request_bytes ({self.max_request_bytes})")
        return self

    def python_pipelines(self) -> dict[str, dict[str, Any]]:
        """The python presets: name -> {python, args}."""
        return {name: spec for name, spec in self.pipelines.items() if isinstance(spec, dict) and "python" in spec}

    def pipeline_json(self, name: str) -> str:
        """The preset's albumentations dict as canonical JSON ("" for a null preset)."""
        spec = self.pipelines[name]
        return "" if spec is None else json.dumps(spec, sort_keys=True)


class PythonPipelineConfig(StrictModel):
    """An operator-side Python pipeline: ``python(**args)`` returns ``fn(sample, rng) -> sample``."""

    python: str = Field(pattern=FACTORY_PATTERN)
    args: dict[str, Any] = Field(default_factory=dict)


class ConfigError(ValueError):
    """The config file is missing, not YAML, or invalid; the message names the file and field."""


def load_config(path: str | os.PathLike[str], **overrides: Any) -> ServerConfig:
    """Read and validate a YAML config; ``overrides`` (e.g. address, workers) win over the file.

    Raises ConfigError naming the file and every bad field.
    """
    path = pathlib.Path(path)
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise ConfigError(f"{path}: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level, got {type(raw).__name__}")
    raw.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return ServerConfig.model_validate(raw)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            where = ".".join(str(p) for p in err["loc"]) or "(top level)"
            lines.append(f"  {where}: {err['msg']}")
        raise ConfigError(f"{path}: invalid config:\n" + "\n".join(lines)) from None
