"""Locations: local paths and URLs (``s3://``, ``gs://``, ``http(s)://``, ``file://``) told apart,
joined and shown without credentials (``safe_url``), and local files read in few system calls.
"""

from __future__ import annotations

import os
import posixpath
import re
import stat
from urllib.parse import urlsplit, urlunsplit

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: str | os.PathLike[str]) -> bool:
    """True if ``location`` is ``scheme://...`` (``file://`` included)."""
    return isinstance(location, str) and bool(_URL.match(location))


def is_remote(location: str | os.PathLike[str]) -> bool:
    """True for a URL other than ``file://`` (the bytes are not on a local filesystem)."""
    return is_url(location) and not str(location).lower().startswith("file://")


def read_local(path: str, start: int = 0, end: int | None = None) -> bytes:
    """Bytes ``[start, end)`` of a local file (to its end by default), in as few system calls as
    possible: open, fstat, pread until the range is read, close (``open(path, "rb").read()`` makes
    about twice as many); pipes, devices and files of reported size 0 are read to their end. Each
    call releases and retakes the GIL, which costs CPU when a worker's 32 I/O threads contend for
    it on slow storage. Raises OSError (FileNotFoundError for a missing file)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or (end is None and st.st_size == 0):
            # a pipe or device, or a file system that reports no size: read to the end, as open().read() does
            with open(fd, "rb", closefd=False) as f:
                if start:
                    f.seek(start)
                return f.read() if end is None else f.read(end - start)
        stop = st.st_size if end is None else end
        parts, offset = [], start
        while offset < stop:
            chunk = os.pread(fd, stop - offset, offset)
            if not chunk:  # the file is shorter than it said (or than ``end``)
                break
            parts.append(chunk)
            offset += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)
    finally:
        os.close(fd)


def local_path(location: str | os.PathLike[str]) -> str:
    """``file:///a/b`` -> ``/a/b``; a plain path made absolute. Raises ValueError for a remote URL."""
    text = os.fspath(location)
    if is_remote(text):
        raise ValueError(f"{safe_url(text)} is not a local path")
    if is_url(text):
        text = urlsplit(text).path
    return os.path.abspath(text)


def safe_url(url: str) -> str:
    """``url`` without user info, query or fragment (where presigned URLs and passwords hide)."""
    if not is_url(url):
        return url
    parts = urlsplit(url)
    host = parts.hostname or ""
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def join(root: str, rel: str) -> str:
    """``rel`` inside ``root``: a full URL ``rel`` is used as is; a local root joins like
    ``os.path.join`` (an absolute ``rel`` wins); a URL root gets ``root/rel``."""
    if is_url(rel):
        return rel
    if is_url(root):
        return root.rstrip("/") + "/" + rel.lstrip("/")
    return os.path.join(root, rel)


def parent(location: str) -> str:
    """The folder or prefix holding ``location``."""
    if is_url(location):
        return location.rstrip("/").rsplit("/", 1)[0]
    return os.path.dirname(location)


def basename(location: str) -> str:
    return posixpath.basename(location.rstrip("/")) if is_url(location) else os.path.basename(location)
