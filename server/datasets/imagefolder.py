"""A folder of images with one subfolder per class (torchvision's ImageFolder layout)."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from ._cache import ArrayFileWriter, cache_path, open_cached, remove_stale
from ._files import DEFAULT_MAX_PIXELS, FileDataset, pack_strings


def _scan(root: str, extensions: tuple[str, ...]) -> tuple[list[str], list[str], list[int]]:
    """(classes, relative paths, labels) of the images under ``root``; see ImageFolder."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: imagefolder root is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"{root}: no class folders (expected one subfolder per class)")
    exts = {e.lower() for e in extensions}
    paths: list[str] = []
    labels: list[int] = []
    for label, cls in enumerate(classes):
        found = []
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, cls), followlinks=True):
            dirnames.sort()
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            for fn in filenames:
                if os.path.splitext(fn)[1].lower() in exts:
                    found.append(f"{rel_dir}/{fn}")
        found.sort()
        paths.extend(found)
        labels.extend([label] * len(found))
    if not paths:
        raise ValueError(f"{root}: no images with extensions {sorted(exts)} in its class folders {classes}")
    return classes, paths, labels


class ImageFolder(FileDataset):
    """``root/<class>/**/<file>``: classes are the sorted subfolder names, label = class position.

    Samples are ordered by class, then by path relative to the root (compared as strings), and
    include files in nested folders of a class folder whose lower-cased extension is in
    ``cfg.extensions``. load_image(i): uint8 [H, W, 3] RGB; source(i): the path relative to the
    root with forward slashes.

    The index (packed paths + labels, see ``_files``) is rebuilt every time the server opens the
    dataset (``build=True``), since the folder may have changed; workers (``build=False``) map
    what the server wrote. The constructor raises FileNotFoundError if the root or its class
    folders are missing, ValueError if there are no images, and ``_cache.IndexMissingError``
    (``build=False``) if the server has not built the index. load_image raises SampleError.
    """

    kind = "imagefolder"

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(name, max_pixels=max_pixels)
        root = os.path.abspath(cfg.root)
        extensions = sorted({e.lower() for e in cfg.extensions})
        out = cache_path(cache_dir, self.kind, root, {"root": root, "extensions": extensions})
        if build:
            classes, paths, labels = _scan(root, tuple(extensions))
            data, offsets = pack_strings(paths)
            del paths
            with ArrayFileWriter(out) as w:
                w.add("path_bytes", data)
                w.add("path_offsets", offsets)
                w.add("labels", np.asarray(labels, dtype=np.int64))
                w.meta.update(kind=self.kind, root=root, classes=classes)
            remove_stale(out)
        self._attach(open_cached(out, what=f"dataset {name!r} ({self.kind}, {root})"), root)
