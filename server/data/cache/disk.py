"""The cache's disk tier: one checksummed entry file per sample under ``disk_dir``, read by mmap.

Layout: ``disk_dir/BUILD`` (the server build fingerprint that wrote the entries),
``disk_dir/lock`` (flock-ed by the server using the directory) and
``disk_dir/entries/<dataset>/<kk>/<key hex>``. A file is written to a temporary name and renamed,
so readers see a whole entry or none; its checksum (``entry.py``) catches the rest. The temporary
name is fixed (``<key hex>.tmp-writing``) and created exclusively (``claim``): of several workers
missing one key, one writes it.

``prepare`` (the server, once, before workers start): takes the directory's lock (a directory
in use by another server is not used: None), wipes the entries when ``BUILD`` names another
build (they were made by other code and are not trusted), removes temporary files a crash left
and entries unused for ``max_idle_s`` (a hit sets a file's mtime: entries of a pipeline prefix no
longer used give their room back at the next start), deletes entries beyond ``disk_bytes`` if the
limit shrank, and returns the bytes per dataset directory found.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import mmap
import os
import pathlib
import re
import shutil
import time

import numpy as np

from . import entry

log = logging.getLogger(__name__)


def dataset_dir(name: str) -> str:
    """A file-system-safe directory name for dataset ``name`` (distinct names stay distinct)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", name)[:64]
    return f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def entry_path(root: pathlib.Path, dataset: str, key: bytes) -> pathlib.Path:
    h = key.hex()
    return root / "entries" / dataset_dir(dataset) / h[:2] / h


def prepare(root: pathlib.Path, build: str, disk_bytes: int,
            max_idle_s: float = float("inf")) -> tuple[int, dict[str, int]] | None:
    """Make ``root`` ready for this server (see module docstring); returns (lock fd to keep
    open while the server lives, bytes per dataset directory), or None if another server holds
    the directory. Raises OSError if it cannot be created or read."""
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        log.warning("cache.disk_dir %s is used by another server: this server's cache stays in RAM", root)
        return None
    stamp = root / "BUILD"
    try:
        trusted = stamp.read_text().strip() == build
    except FileNotFoundError:
        trusted = False
    entries = root / "entries"
    if not trusted:
        if entries.exists():
            log.warning("cache.disk_dir %s was written by another build: its entries are removed", root)
        shutil.rmtree(entries, ignore_errors=True)
        stamp.write_text(build + "\n")
    entries.mkdir(exist_ok=True)
    files: list[tuple[float, int, pathlib.Path, str]] = []
    oldest = time.time() - max_idle_s
    for ds in entries.iterdir():
        for p in ds.glob("*/*"):
            st = p.stat()
            if ".tmp-" in p.name or st.st_mtime < oldest:
                p.unlink(missing_ok=True)
                continue
            files.append((st.st_mtime, st.st_size, p, ds.name))
    files.sort(reverse=True)  # newest kept when the limit shrank
    per_dataset: dict[str, int] = {}
    total = 0
    for _, size, p, ds in files:
        if total + size > disk_bytes:
            p.unlink(missing_ok=True)
            continue
        total += size
        per_dataset[ds] = per_dataset.get(ds, 0) + size
    return fd, per_dataset


def read(path: pathlib.Path, key: bytes) -> np.ndarray | None:
    """The image in entry file ``path``, or None if there is none. Raises CorruptEntry if the
    file fails a check, OSError if it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size < entry.HEADER_BYTES:
            raise entry.CorruptEntry("truncated file")
        with mmap.mmap(fd, size, prot=mmap.PROT_READ) as m:
            mv = memoryview(m)
            try:
                image = entry.decode(mv, key)
            finally:
                mv.release()
        try:
            os.utime(fd)  # last used: entries idle for cache.disk_max_idle_s go at the next start
        except OSError:
            pass
        return image
    finally:
        os.close(fd)


def _temporary(path: pathlib.Path) -> pathlib.Path:
    return path.with_name(f"{path.name}.tmp-writing")


def claim(path: pathlib.Path) -> int | None:
    """Claim the writing of entry ``path``: an open descriptor of its temporary file, created
    exclusively, or None if the entry exists or another process is writing it. Call it under the
    cache's lock, with the bytes reserved by the same holder, so an entry is reserved once.
    A writer that crashes leaves the file: that entry is not written again until the next start
    (``prepare`` removes it), and its bytes stay reserved. Raises OSError."""
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(_temporary(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return None  # being written
    if path.exists():  # written (and renamed) before the claim: it is there already
        os.close(fd)
        _temporary(path).unlink(missing_ok=True)
        return None
    return fd


def write(fd: int, path: pathlib.Path, *parts) -> None:
    """Write ``parts`` (bytes-like) one after the other through ``fd`` (from ``claim(path)``,
    closed here), then rename the temporary file to ``path``: readers see a whole entry or none.
    Raises OSError (the temporary file is removed)."""
    try:
        with open(fd, "wb") as f:
            for part in parts:
                f.write(part)
        os.replace(_temporary(path), path)
    except BaseException:
        _temporary(path).unlink(missing_ok=True)
        raise
