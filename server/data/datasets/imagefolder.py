"""A folder of images with one subfolder per class, listed exactly as torchvision's ImageFolder."""

from __future__ import annotations

import os
import pathlib

import numpy as np

from ..decode import DEFAULT_MAX_PIXELS
from ..storage import Storage, is_remote, local_path, safe_url
from ._cache import ArrayFileWriter, cache_path, legacy_prefix, open_cached, remove_stale
from ._files import FileDataset, file_settings, pack_strings
from ._fingerprint import file_list_fingerprint, listing_fingerprint

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
ORDER = "torchvision"  # part of the index's cache key: an index listed in another order is never reused


def _walk(class_dir: str) -> list[tuple[str, list[str], list[str]]]:
    """``sorted(os.walk(class_dir, followlinks=True))``, refusing symlink loops.

    torchvision would follow a link to a folder's own ancestor until the path grows too long,
    listing the same files over and over; here that is a ValueError naming the link.
    """
    seen: dict[str, tuple[int, int]] = {}
    walked = []
    for dirpath, dirnames, filenames in os.walk(class_dir, followlinks=True):
        try:
            st = os.stat(dirpath)
        except OSError:
            continue
        key = (st.st_dev, st.st_ino)
        parent = os.path.dirname(dirpath)
        while parent in seen:
            if seen[parent] == key:
                raise ValueError(f"{dirpath}: a symlink loop (this folder is its own ancestor {parent}); "
                                 "imagefolder follows symlinks, as torchvision does")
            parent = os.path.dirname(parent)
        seen[dirpath] = key
        walked.append((dirpath, dirnames, filenames))
    return sorted(walked)


def _check_found(root: str, exts: tuple[str, ...], classes: list[str], paths: list[str], empty: list[str],
                 allow_empty: bool) -> None:
    """What ``scan`` and ``scan_listing`` found is a dataset: FileNotFoundError naming the class
    folders in ``empty`` (unless ``allow_empty``), ValueError if ``paths`` is empty."""
    if empty and not allow_empty:
        raise FileNotFoundError(
            f"{root}: no images with extensions {', '.join(exts)} in the class folder(s) {', '.join(empty)} "
            "(torchvision's ImageFolder refuses this too); add images, remove the folder(s), or set "
            "allow_empty: true to keep them as classes without samples"
        )
    if not paths:
        raise ValueError(f"{root}: no images with extensions {', '.join(exts)} in its class folders {classes}")


def scan(root: str, extensions: tuple[str, ...], allow_empty: bool = False) -> tuple[list[str], list[str], list[int]]:
    """(classes, paths relative to ``root``, labels) as torchvision's ``ImageFolder`` lists them.

    Transcribes ``find_classes`` + ``make_dataset`` (torchvision/datasets/folder.py, 0.18+):
    classes are the sorted names of ``root``'s subfolders (symlinks to folders and hidden folders
    included); a class's samples are, for ``root, _, fnames in sorted(os.walk(class_dir,
    followlinks=True))``, each ``fname in sorted(fnames)`` whose lower-cased name ends with one of
    ``extensions`` (lower-case). So a folder's own files come before its subfolders', and
    folders are ordered by their path as a string. Paths use ``/``.

    Raises FileNotFoundError if ``root`` is not a folder, has no class folders, or (unless
    ``allow_empty``) a class folder holds no image, naming the folder(s); ValueError if there
    is no image at all, or a symlink loop.
    """
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: imagefolder root is not a folder")
    classes = sorted(e.name for e in os.scandir(root) if e.is_dir())
    if not classes:
        raise FileNotFoundError(f"{root}: no class folders (expected one subfolder per class)")
    exts = tuple(e.lower() for e in extensions)
    paths: list[str] = []
    labels: list[int] = []
    empty = []
    for label, cls in enumerate(classes):
        class_dir = os.path.join(root, cls)
        n = len(paths)
        for dirpath, _, fnames in _walk(class_dir):
            rel_dir = os.path.relpath(dirpath, root).replace(os.sep, "/")
            paths.extend(f"{rel_dir}/{f}" for f in sorted(fnames) if f.lower().endswith(exts))
        labels.extend([label] * (len(paths) - n))
        if len(paths) == n:
            empty.append(class_dir)
    _check_found(root, exts, classes, paths, empty, allow_empty)
    return classes, paths, labels


def scan_listing(root: str, files: dict[str, dict], extensions: tuple[str, ...],
                 allow_empty: bool = False) -> tuple[list[str], list[str], list[int]]:
    """(classes, keys relative to ``root``, labels) for an object-store prefix, in ``scan``'s order.

    ``files``: every object under ``root`` (key relative to it -> info), listed once. Object
    stores have no folders: a class is the first component of keys that have at least two
    (objects directly under ``root`` are ignored, as files next to class folders are); a
    class's samples sort by (folder path, file name) as ``sorted(os.walk(...))`` then
    ``sorted(fnames)`` order them. A class "folder" holding only non-images is empty (an error
    unless ``allow_empty``, as in ``scan``).

    Raises FileNotFoundError if there are no class folders or (unless ``allow_empty``) a class
    has no image; ValueError if there is no image at all.
    """
    exts = tuple(e.lower() for e in extensions)
    by_class: dict[str, list[tuple[str, str]]] = {}
    for key in files:
        cls, sep, rest = key.partition("/")
        if not sep or not rest:
            continue
        folder, _, fname = key.rpartition("/")
        entries = by_class.setdefault(cls, [])
        if fname.lower().endswith(exts):
            entries.append((folder, fname))
    classes = sorted(by_class)
    if not classes:
        raise FileNotFoundError(f"{root}: no class folders (expected one prefix per class, e.g. {root}/cat/1.jpg)")
    paths: list[str] = []
    labels: list[int] = []
    empty = []
    for label, cls in enumerate(classes):
        entries = sorted(by_class[cls])
        if not entries:
            empty.append(f"{root}/{cls}")
        paths.extend(f"{folder}/{fname}" for folder, fname in entries)
        labels.extend([label] * len(entries))
    _check_found(root, exts, classes, paths, empty, allow_empty)
    return classes, paths, labels


class ImageFolder(FileDataset):
    """``root/<class>/**/<file>``, listed exactly as ``torchvision.datasets.ImageFolder`` lists it.

    Classes are the sorted subfolder names, label = class position; samples as ``scan`` says
    (torchvision's order and, by default, its extensions ``IMG_EXTENSIONS``, any case).
    load_image(i): uint8 [H, W, 3] RGB; source(i): the path relative to the root with ``/``.
    ``fingerprint``: see ``_fingerprint`` (paths, labels, sizes, mtimes).

    The index (packed paths + labels, see ``_files``) is rebuilt every time the server opens the
    dataset (``build=True``), since the folder may have changed; workers (``build=False``) map
    what the server wrote. The constructor raises FileNotFoundError if the root or its class
    folders are missing or a class folder has no image (unless ``cfg.allow_empty``), ValueError
    if there are no images, and ``_cache.IndexMissingError`` (``build=False``) if the server has
    not built the index. load_image raises SampleError.
    """

    kind = "imagefolder"

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(name, max_pixels=max_pixels, **file_settings(cfg))
        options = self.storage_options
        remote = is_remote(str(cfg.root))
        root = str(cfg.root).rstrip("/") if remote else local_path(cfg.root)
        extensions = sorted({e.lower() for e in cfg.extensions})
        allow_empty = bool(getattr(cfg, "allow_empty", False))
        key = {"root": root, "extensions": extensions, "allow_empty": allow_empty, "order": ORDER}
        if remote:
            key["storage"] = options.fingerprint_part()
        out = cache_path(cache_dir, self.kind, root, key, identity=key)
        if build:
            if remote:  # listed once, here; the index keeps the listing
                files = Storage(root, options).list_files(root)
                classes, paths, labels = scan_listing(safe_url(root), files, tuple(extensions), allow_empty)
                versions = [(files[p].get("size", -1), files[p].get("ETag") or files[p].get("LastModified") or "")
                            for p in paths]
                fingerprint = listing_fingerprint(self.kind, classes, paths, labels, versions)
                del files
            else:
                classes, paths, labels = scan(root, tuple(extensions), allow_empty)
                fingerprint = file_list_fingerprint(self.kind, root, classes, paths, labels)
            data, offsets = pack_strings(paths)
            del paths
            with ArrayFileWriter(out) as w:
                w.add("path_bytes", data)
                w.add("path_offsets", offsets)
                w.add("labels", np.asarray(labels, dtype=np.int64))
                w.meta.update(kind=self.kind, root=safe_url(root), classes=classes, fingerprint=fingerprint)
            remove_stale(out, legacy_prefix(self.kind, root))
        self._attach(open_cached(out, what=f"dataset {name!r} ({self.kind}, {safe_url(root)})"), root)
