"""Dataset indexes on disk: one file of named numpy arrays, written atomically, read by mmap.

Layout of a ``.bidx`` file (all integers little-endian)::

    b"BATCHDX1" + zero padding to 64 bytes
    array 0 bytes, array 1 bytes, ...        each starting at a multiple of 64
    footer: UTF-8 JSON {"meta": {...}, "arrays": {name: {"dtype", "shape", "offset"}}}
    trailer: uint64 footer length, b"BATCHDX1"

The footer is at the end so arrays can be streamed in (e.g. decompressing a 47 MB IDX file
without holding it in memory). A writer writes to a temporary name in the same folder and
``os.replace``-s it into place, so a reader sees either the old complete file or the new one;
processes that mapped the old file keep it until they close it.

Readers map the whole file once (``mmap.ACCESS_READ``) and view the arrays with
``np.ndarray(..., buffer=the_mmap)`` (so ``array.base`` is the ``mmap.mmap``): the arrays are read-only and each process pays only for the pages it
touches, shared through the page cache.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import pathlib
import re
import struct
import uuid
from collections.abc import Iterable
from typing import Any

import numpy as np

MAGIC = b"BATCHDX1"
# 2: meta["fingerprint"] in every index; imagefolder lists in torchvision's order. A file of
# another version is never read (ArrayFile refuses it) and its name differs (cache_path).
FORMAT_VERSION = 2
SUFFIX = ".bidx"
_ALIGN = 64
_TRAILER = struct.Struct("<Q8s")


class IndexMissingError(FileNotFoundError):
    """A worker (``build=False``) found no index in the cache: the server has not built it."""


def file_fingerprint(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Absolute path, size and mtime of ``path``: what a cached copy of it is keyed by.

    Raises FileNotFoundError (or another OSError) naming the file.
    """
    path = os.path.abspath(os.fspath(path))
    st = os.stat(path)
    return {"path": path, "size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cache_path(cache_dir: str | os.PathLike[str], kind: str, source: str, fingerprint: Any,
               identity: Any = None) -> pathlib.Path:
    """Where the index of ``source`` (a path or URL) lives:
    ``{kind}-{basename}-{hash(kind, source, identity)}-{hash(fingerprint)}.bidx``.

    ``identity``: what else tells this dataset from another on the same source (the storage
    endpoint, extensions, label field...: settings, not contents); ``fingerprint``: its contents'
    version. Files sharing the first three parts are older versions of the same index (see
    remove_stale), so two datasets on one source with other settings never remove each other's.
    """
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", os.path.basename(source.rstrip("/\\")) or "root")[:40]
    prefix = f"{kind}-{slug}-{_digest([kind, source] if identity is None else [kind, source, identity])}"
    return pathlib.Path(cache_dir) / f"{prefix}-{_digest([FORMAT_VERSION, fingerprint])}{SUFFIX}"


def legacy_prefix(kind: str, source: str) -> str:
    """The name prefix indexes of ``source`` had before ``cache_path`` took an ``identity`` (the
    source alone): what ``remove_stale`` also deletes, as an older batchd's versions."""
    return cache_path(".", kind, source, None).name.rsplit("-", 1)[0] + "-"


def remove_stale(path: pathlib.Path, legacy: str | None = None) -> None:
    """Delete older versions of the index at ``path`` (same source and settings, other
    fingerprint), and indexes named with the ``legacy`` prefix (``legacy_prefix``; pass it where
    ``cache_path`` was given an identity).

    Processes that still map one keep reading it: unlinking does not invalidate a mapping.
    """
    prefixes = (path.name[: path.name.rfind("-") + 1],) + ((legacy,) if legacy else ())
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return
    for entry in entries:
        if entry.name != path.name and entry.name.startswith(prefixes) and entry.name.endswith(SUFFIX):
            try:
                os.unlink(entry.path)
            except OSError:
                pass


class ArrayFileWriter:
    """Writes a ``.bidx`` file atomically. Use as a context manager::

        with ArrayFileWriter(path) as w:
            w.add("labels", labels)
            w.add_chunks("images", np.uint8, (n, 28, 28, 1), chunks)
            w.meta["classes"] = [...]

    On a clean exit the file appears at ``path`` complete; on an exception nothing appears
    (the temporary file is removed) and the exception propagates.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = pathlib.Path(path)
        self.meta: dict[str, Any] = {}
        self._arrays: dict[str, dict[str, Any]] = {}
        self._tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
        self._f = None

    def __enter__(self) -> "ArrayFileWriter":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self._tmp, "wb")
        self._f.write(MAGIC.ljust(_ALIGN, b"\0"))
        return self

    def _start(self, name: str, dtype: Any, shape: tuple[int, ...]) -> int:
        if name in self._arrays:
            raise ValueError(f"array {name!r} written twice")
        pos = self._f.tell()
        pad = -pos % _ALIGN
        self._f.write(b"\0" * pad)
        offset = pos + pad
        self._arrays[name] = {"dtype": np.dtype(dtype).str, "shape": [int(s) for s in shape], "offset": offset}
        return offset

    def add(self, name: str, array: np.ndarray) -> None:
        """Append a whole array (any layout; stored C-contiguous)."""
        array = np.ascontiguousarray(array)
        self._start(name, array.dtype, array.shape)
        self._f.write(memoryview(array).cast("B"))

    def add_chunks(self, name: str, dtype: Any, shape: tuple[int, ...], chunks: Iterable[Any]) -> None:
        """Append an array given as consecutive byte chunks (bytes-like or numpy arrays).

        Raises ValueError if the chunks do not add up to exactly ``prod(shape) * itemsize`` bytes.
        """
        self._start(name, dtype, shape)
        expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        written = 0
        for chunk in chunks:
            if isinstance(chunk, np.ndarray):
                chunk = np.ascontiguousarray(chunk)
            mv = memoryview(chunk).cast("B")
            written += mv.nbytes
            if written > expected:
                raise ValueError(f"array {name!r}: more data than its shape {tuple(shape)} holds")
            self._f.write(mv)
        if written != expected:
            raise ValueError(f"array {name!r}: got {written} bytes, shape {tuple(shape)} needs {expected}")

    def __exit__(self, exc_type, exc, tb) -> None:
        f, self._f = self._f, None
        try:
            if exc_type is None:
                footer = json.dumps({"version": FORMAT_VERSION, "meta": self.meta, "arrays": self._arrays}).encode()
                f.write(footer)
                f.write(_TRAILER.pack(len(footer), MAGIC))
                f.close()
                os.replace(self._tmp, self.path)
        finally:
            if not f.closed:
                f.close()
            if exc_type is not None or self._tmp.exists():
                try:
                    os.unlink(self._tmp)
                except FileNotFoundError:
                    pass


class ArrayFile:
    """A ``.bidx`` file mapped read-only: ``arrays`` (name -> read-only ndarray view of the map)
    and ``meta`` (the JSON dict the writer stored).

    Raises FileNotFoundError if there is no file, ValueError if it is not a complete ``.bidx``
    file of this format version.
    """

    def __init__(self, path: str | os.PathLike[str]):
        self.path = pathlib.Path(path)
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _ALIGN + _TRAILER.size:
                raise ValueError(f"{self.path}: index file is truncated ({size} bytes)")
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = self._mmap
        footer_len, magic = _TRAILER.unpack_from(buf, size - _TRAILER.size)
        if buf[: len(MAGIC)] != MAGIC or magic != MAGIC or footer_len > size - _ALIGN - _TRAILER.size:
            raise ValueError(f"{self.path}: not a batchd index file, or an incomplete one")
        footer_start = size - _TRAILER.size - footer_len
        try:
            footer = json.loads(bytes(buf[footer_start : size - _TRAILER.size]))
        except ValueError:
            raise ValueError(f"{self.path}: index footer is not valid JSON") from None
        if footer.get("version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: index format version {footer.get('version')}, expected {FORMAT_VERSION}")
        self.meta: dict[str, Any] = footer["meta"]
        self.arrays: dict[str, np.ndarray] = {}
        for name, spec in footer["arrays"].items():
            dtype, shape, offset = np.dtype(spec["dtype"]), tuple(spec["shape"]), spec["offset"]
            count = int(np.prod(shape, dtype=np.int64))
            if offset + count * dtype.itemsize > footer_start:
                raise ValueError(f"{self.path}: array {name!r} runs past the end of the data")
            # .base is the mmap itself (read-only: ACCESS_READ), so the map stays alive with it
            self.arrays[name] = np.ndarray(shape, dtype=dtype, buffer=buf, offset=offset)

    def __getitem__(self, name: str) -> np.ndarray:
        try:
            return self.arrays[name]
        except KeyError:
            raise ValueError(f"{self.path}: index has no array {name!r}") from None


def open_cached(path: pathlib.Path, *, what: str) -> ArrayFile:
    """Map the index at ``path``, which the server should have built.

    Raises IndexMissingError (a FileNotFoundError) naming ``what`` (the dataset) and the path.
    """
    try:
        return ArrayFile(path)
    except FileNotFoundError:
        raise IndexMissingError(
            f"{what}: no index at {path}; the server builds it (open_dataset(..., build=True)) before "
            "workers open the dataset with build=False — is cache_dir the same, and did the source "
            "change since the server started?"
        ) from None
