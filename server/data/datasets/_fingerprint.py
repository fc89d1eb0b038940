"""Dataset fingerprints: a short hash that changes whenever the samples a dataset serves may.

Computed when the server builds an index and stored in the index's ``meta["fingerprint"]``, so
a server that reuses a cached index (manifest, fashion-mnist) does not compute it again and a
worker that maps the index reads the same value. What each kind hashes:

* imagefolder: its class names, then per sample (in order) the path relative to the root, the
  label, the file's size in bytes and its mtime in nanoseconds (a folder is rescanned on every
  server start anyway; this adds one ``stat`` per image: about 7 us each on a warm local disk,
  so some 9 s for ImageNet's 1.28 million). Copies keep the fingerprint only if
  they keep mtimes (``rsync -a``, ``cp -p``).
* manifest: the table file's content (CSV or Parquet bytes). The image files it names are not
  read: replacing one behind an unchanged table goes unnoticed.
* fashion-mnist: the content of the split's two ``.gz`` files (about 30 MB for train).
* coco: the annotation JSON's content (which lists the images), with the settings that change
  the samples (``masks``, ``skip_empty``). As for a manifest, the image files are not read.
* segmentation: the image list and the mask list, each as imagefolder's (relative path, size,
  mtime; for object stores, size and ETag) in sample order, so a ``split_file``'s choice and
  order of stems are in it too.

A fingerprint is ``FINGERPRINT_CHARS`` lowercase hex characters of a SHA-256.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable, Sequence

FINGERPRINT_CHARS = 32
_READ_CHUNK = 1 << 20
_STAT_BATCH = 4096


def _start(kind: str) -> "hashlib._Hash":
    h = hashlib.sha256()
    h.update(f"batchd-dataset-fingerprint/1\0{kind}\0".encode())
    return h


def content_fingerprint(kind: str, paths: Iterable[str | os.PathLike[str]]) -> str:
    """Fingerprint of the bytes of ``paths`` (read in 1 MiB chunks), in the order given.

    File names are not hashed (a moved copy keeps its fingerprint); each file's length is, so
    the boundary between two files cannot shift unnoticed. Raises OSError naming a file that
    cannot be read.
    """
    h = _start(kind)
    for path in paths:
        h.update(f"{os.path.getsize(path)}\0".encode())
        with open(path, "rb") as f:
            while chunk := f.read(_READ_CHUNK):
                h.update(chunk)
    return h.hexdigest()[:FINGERPRINT_CHARS]


def file_list_fingerprint(kind: str, root: str, classes: Sequence[str], paths: Sequence[str],
                          labels: Sequence[int]) -> str:
    """Fingerprint of a file list: ``classes``, then each (path relative to ``root``, label,
    size in bytes, mtime in ns). ``paths`` and ``labels`` have one entry per sample, in order.

    A file that cannot be stat-ed (e.g. a dangling symlink) counts as size -1, mtime 0: it
    fails when read, and its fingerprint changes once it is fixed.
    """
    def rows(start: int) -> bytes:
        out = []
        for rel, label in zip(paths[start:start + _STAT_BATCH], labels[start:start + _STAT_BATCH]):
            try:
                st = os.stat(os.path.join(root, rel))
                size, mtime = st.st_size, st.st_mtime_ns
            except OSError:
                size, mtime = -1, 0
            out.append(f"{rel}\0{label}\0{size}\0{mtime}\n")
        return "".join(out).encode("utf-8", "surrogateescape")

    h = _start(kind)
    h.update("\0".join(classes).encode("utf-8", "surrogateescape") + b"\0\0")
    for start in range(0, len(paths), _STAT_BATCH):
        h.update(rows(start))
    return h.hexdigest()[:FINGERPRINT_CHARS]


def listing_fingerprint(kind: str, classes: Sequence[str], paths: Sequence[str], labels: Sequence[int],
                        versions: Sequence[tuple[int, str]]) -> str:
    """Fingerprint of an object-store listing: ``classes``, then each (key relative to the root,
    label, size in bytes, version: the ETag or last-modified time the listing gave)."""
    h = _start(kind)
    h.update("\0".join(classes).encode("utf-8", "surrogateescape") + b"\0\0")
    for start in range(0, len(paths), _STAT_BATCH):
        rows = zip(paths[start:start + _STAT_BATCH], labels[start:start + _STAT_BATCH],
                   versions[start:start + _STAT_BATCH])
        h.update("".join(f"{p}\0{l}\0{s}\0{v}\n" for p, l, (s, v) in rows).encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:FINGERPRINT_CHARS]


def with_settings(fingerprint: str, settings: dict) -> str:
    """``fingerprint`` combined with ``settings`` (JSON-serialisable) that change what the samples
    are (e.g. coco's ``masks`` and ``skip_empty``): equal only when both are."""
    h = hashlib.sha256(f"{fingerprint}\0".encode())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:FINGERPRINT_CHARS]
