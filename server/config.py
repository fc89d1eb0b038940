"""The server's YAML config, validated on load.

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

Every model forbids unknown fields, so a typo is an error that names the field.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MiB = 1 << 20


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _DatasetBase(_Strict):
    """What every dataset kind accepts.

    on_error: "raise" (default) fails the stream at a sample that cannot be read or decoded,
        naming dataset, index and file; "skip" leaves it out of its batch (the batch lists it
        in ``skipped``) and logs it.
    max_skipped_fraction: with "skip", the stream fails once more than this fraction of the
        epoch's samples (of this shard) were skipped.
    max_pixels: decoded images larger than this (width x height) are bad samples.
    """

    on_error: Literal["raise", "skip"] = "raise"
    max_skipped_fraction: float = Field(default=0.01, ge=0.0, le=1.0)
    max_pixels: int = Field(default=1 << 28, ge=1)


class FashionMnistConfig(_DatasetBase):
    """The four IDX ``.gz`` files of Fashion-MNIST (or MNIST) in ``root``."""

    kind: Literal["fashion-mnist"]
    root: pathlib.Path
    split: Literal["train", "test"] = "train"


class ImageFolderConfig(_DatasetBase):
    """One subfolder of ``root`` per class; classes are the sorted folder names."""

    kind: Literal["imagefolder"]
    root: pathlib.Path
    extensions: tuple[str, ...] = (".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff")


class ManifestConfig(_DatasetBase):
    """A CSV or Parquet table with columns ``path`` and ``label``; paths relative to its folder."""

    kind: Literal["manifest"]
    path: pathlib.Path
    root: pathlib.Path | None = Field(default=None, description="where relative paths start; default: the table's folder")


DatasetConfig = Annotated[
    Union[FashionMnistConfig, ImageFolderConfig, ManifestConfig], Field(discriminator="kind")
]


class ServerConfig(_Strict):
    """Everything ``batchd serve`` needs.

    address: ``HOST:PORT`` (port 0 picks a free one) or ``unix:PATH``.
    workers: worker processes decoding and augmenting, each building whole batches.
    datasets: name -> dataset; clients name datasets, never paths.
    pipelines: preset name -> albumentations pipeline (``A.to_dict`` form, or a file path).
    cache_dir: where dataset indexes (e.g. decompressed IDX files) are kept between runs.
    default_prefetch: batches computed ahead per stream when the client sends 0.
    max_prefetch, max_batch_size: requests above these are refused (INVALID_ARGUMENT).
    max_message_bytes: gRPC send/receive limit, bytes; a 256 x 224 x 224 x 3 uint8 batch is 38.5 MB.
    worker_timeout_s: a batch that takes longer than this fails the stream (seconds).
    max_task_retries: times a batch is rebuilt after its worker died before the stream fails.
    grpc_threads: threads serving RPCs; each open stream holds one.
    max_slots: shared-memory batch slots; at most this many batches exist at once (bounds memory).
    max_leases_per_session: slots a same-host client may hold at once over the shared-memory
        transport (on top of max_slots); further batches are sent inline. 0 disables the transport.
    share_window: streams whose requests agree on everything that fixes the bytes (dataset,
        pipeline, batch_size, shuffle, seed, epoch, drop_last, rank, world_size) share one
        computation while they are within this many batches of each other; a reader further
        behind gets its batches recomputed. 0 disables sharing.
    metrics_port: serve Prometheus metrics over HTTP on this port (``/metrics``; 0 picks a free
        one), on the host of ``address`` (127.0.0.1 for a unix: address). None: no endpoint.
    """

    address: str = "127.0.0.1:50051"
    workers: int = Field(default_factory=lambda: max(1, os.cpu_count() or 1), ge=1, le=512)
    datasets: dict[str, DatasetConfig] = Field(default_factory=dict)
    pipelines: dict[str, Any] = Field(default_factory=dict)
    cache_dir: pathlib.Path = Field(
        default_factory=lambda: pathlib.Path(os.environ.get("XDG_CACHE_HOME", pathlib.Path.home() / ".cache")) / "batchd"
    )
    default_prefetch: int = Field(default=4, ge=1)
    max_prefetch: int = Field(default=64, ge=1)
    max_batch_size: int = Field(default=4096, ge=1)
    max_message_bytes: int = Field(default=512 * MiB, ge=4 * MiB)
    worker_timeout_s: float = Field(default=300.0, gt=0)
    max_task_retries: int = Field(default=3, ge=0)
    grpc_threads: int = Field(default=64, ge=2)
    max_slots: int = Field(default=64, ge=2)
    max_leases_per_session: int = Field(default=8, ge=0)
    share_window: int = Field(default=16, ge=0)
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

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
                raise ValueError(f"pipelines.{name}: expected an albumentations dict (A.to_dict) or a file path")
            loaded[name] = spec
        return loaded

    @model_validator(mode="after")
    def _check_prefetch(self) -> "ServerConfig":
        if self.default_prefetch > self.max_prefetch:
            raise ValueError(f"default_prefetch ({self.default_prefetch}) exceeds max_prefetch ({self.max_prefetch})")
        return self

    def pipeline_json(self, name: str) -> str:
        """The preset's albumentations dict as canonical JSON ("" for a null preset)."""
        spec = self.pipelines[name]
        return "" if spec is None else json.dumps(spec, sort_keys=True)


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
