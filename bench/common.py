"""Shared set-up of the tables: the photo dataset config, opened datasets, loaders over a server."""

from __future__ import annotations

import inspect
import itertools

import batchd
from batchd.server.config import ImageFolderConfig, ManifestConfig
from batchd.server.data.datasets import open_dataset

from bench import data


def photos_config() -> ImageFolderConfig:
    return ImageFolderConfig(kind="imagefolder", root=data.PHOTOS)


def photos_x4_config() -> ManifestConfig:
    return ManifestConfig(kind="manifest", path=data.ensure_repeated_manifest(4))


def server_datasets(**cfgs) -> dict:
    """name -> config as a YAML-ready dict."""
    return {name: cfg.model_dump(mode="json", exclude_defaults=True) | {"kind": cfg.kind} for name, cfg in cfgs.items()}


def open_local(name: str, cfg):
    """The dataset opened in this process (own index cache), for the sequential loop."""
    return open_dataset(name, cfg, data.LOCAL_CACHE, build=True)


_unique = itertools.count(1)


def decode_min_size(compose):
    """What batchd's workers pass to ``load_image`` for this pipeline (reduced JPEG decoding), or None."""
    from batchd.server.compute import pipeline as server_pipeline

    fn = getattr(server_pipeline, "decode_min_size", None)
    return fn(compose) if fn is not None else None


def load_image(ds, index: int, min_size):
    """``ds.load_image`` as batchd's worker calls it (with min_size where this version has it)."""
    if min_size is not None and "min_size" in inspect.signature(ds.load_image).parameters:
        return ds.load_image(index, min_size)
    return ds.load_image(index)


def remote(address: str, dataset: str, *, batch_size: int, pipeline: str, workers: int, transport: str,
           seed: int = 0, compression: str | None = None, **kw) -> "batchd.RemoteDataLoader":
    """A RemoteDataLoader as the tables use it: shuffled, drop_last, prefetch 2 x workers.

    prefetch = 2 x workers matches DataLoader's default prefetch_factor=2 per worker (and keeps
    every server worker busy: a stream never has more than ``prefetch`` batches in flight).

    Every loader gets a seed of its own (``seed`` is mixed with a counter): the server shares one
    computation between streams whose requests agree on everything that fixes the bytes, so a
    second stream with the same seed would read batches already built for the first one.
    ``kw``: other RemoteDataLoader arguments (e.g. ``collate_fn``).
    """
    seed = seed * 1_000_003 + next(_unique)
    return batchd.RemoteDataLoader(
        address, dataset, batch_size=batch_size, shuffle=True, seed=seed, drop_last=True, transform=pipeline,
        prefetch=max(2, 2 * workers), transport=transport, compression=compression, timeout=300, **kw,
    )
