"""Dataset kinds, opened by their config: ``open_dataset(name, cfg, cache_dir, build=...)``.

The server opens each dataset with ``build=True`` (building or refreshing its index in
``cache_dir``); every worker process opens it again itself with ``build=False`` (only mapping
that index). Dataset objects are never pickled between processes.
"""

from __future__ import annotations

import pathlib

from ..decode import DEFAULT_MAX_PIXELS
from .base import PER_OBJECT_FIELDS, Dataset, FieldSpec, SampleSpec

__all__ = ["Dataset", "FieldSpec", "PER_OBJECT_FIELDS", "SampleSpec", "open_dataset"]


def open_dataset(name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int | None = None) -> Dataset:
    """Open dataset ``name`` described by ``cfg`` (a FashionMnistConfig, ImageFolderConfig,
    ManifestConfig, WebDatasetConfig, CocoConfig, SegmentationConfig or PythonConfig), keeping its index in ``cache_dir``.

    build=True (the server): build the index, or refresh it if its source changed (an
    imagefolder is rescanned every time). build=False (workers): map the index the server
    built; raises ``IndexMissingError`` (a FileNotFoundError) if there is none.
    ``max_pixels``: images with more pixels fail to load with SampleError (file kinds only);
    default: ``cfg.max_pixels``.

    Raises ValueError for an unknown ``cfg.kind``, and whatever the kind's constructor raises
    (FileNotFoundError / ValueError naming the file and what is wrong; for kind python, what
    importing or calling the factory raised).
    """
    kind = getattr(cfg, "kind", None)
    if kind == "fashion-mnist":
        from .fashion_mnist import FashionMnist as cls
    elif kind == "imagefolder":
        from .imagefolder import ImageFolder as cls
    elif kind == "manifest":
        from .manifest import Manifest as cls
    elif kind == "webdataset":
        from .webdataset import WebDataset as cls
    elif kind == "coco":
        from .coco import Coco as cls
    elif kind == "segmentation":
        from .segmentation import Segmentation as cls
    elif kind == "python":
        from .python import PythonDataset as cls
    else:
        raise ValueError(f"dataset {name!r}: unknown kind {kind!r} "
                         "(expected fashion-mnist, imagefolder, manifest, webdataset, coco, segmentation or python)")
    if max_pixels is None:
        max_pixels = getattr(cfg, "max_pixels", DEFAULT_MAX_PIXELS)
    return cls(name, cfg, pathlib.Path(cache_dir), build=build, max_pixels=max_pixels)
