"""Fashion-MNIST (or MNIST) from its four IDX ``.gz`` files, decompressed once and memory-mapped.

The server (``build=True``) decompresses the split's two files into one ``.bidx`` file in
``cache_dir`` (streamed, written atomically), keyed by both files' path, size and mtime, so a
changed file is decompressed again. Every process then maps it read-only: N workers share one
copy in the page cache instead of holding 47 MB each. The dataset's ``fingerprint`` is a hash of
the two ``.gz`` files' content, computed when they are decompressed and kept in the index.
"""

from __future__ import annotations

import gzip
import os
import pathlib
import struct
import zlib
from collections.abc import Iterator

import numpy as np

from ..decode import DEFAULT_MAX_PIXELS
from ._cache import ArrayFile, ArrayFileWriter, cache_path, file_fingerprint, open_cached, remove_stale
from ._fingerprint import content_fingerprint
from .base import Dataset, SampleSpec

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]

FILES = {
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}

_IDX_UBYTE = 0x08
_CHUNK = 1 << 20


def _read_exact(f, n: int, path: pathlib.Path, what: str) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise ValueError(f"{path}: truncated: {what} ends after {len(data)} of {n} bytes")
    return data


def _open_idx(path: pathlib.Path, ndim: int):
    """Open an IDX ``.gz`` file of uint8 with ``ndim`` dimensions: (gzip file at the data, dims)."""
    if not path.is_file():
        raise FileNotFoundError(f"{path}: Fashion-MNIST file not found")
    f = gzip.open(path, "rb")
    try:
        magic = _read_exact(f, 4, path, "the IDX magic number")
        if magic[0] != 0 or magic[1] != 0 or magic[2] != _IDX_UBYTE or magic[3] != ndim:
            raise ValueError(
                f"{path}: IDX magic number 0x{magic.hex()} is not 0x0000{_IDX_UBYTE:02x}{ndim:02x} "
                f"(unsigned bytes, {ndim} dimension{'s' if ndim > 1 else ''})"
            )
        dims = struct.unpack(f">{ndim}I", _read_exact(f, 4 * ndim, path, "the IDX dimensions"))
        return f, dims
    except (OSError, EOFError, zlib.error) as e:
        f.close()
        raise ValueError(f"{path}: not a valid gzip file: {e}") from None
    except BaseException:
        f.close()
        raise


def _chunks(f, nbytes: int, path: pathlib.Path) -> Iterator[bytes]:
    """The next ``nbytes`` of ``f`` in chunks; ValueError if it ends early or has bytes left over."""
    left = nbytes
    try:
        while left:
            chunk = f.read(min(_CHUNK, left))
            if not chunk:
                raise ValueError(f"{path}: truncated: {nbytes - left} of {nbytes} data bytes the header promises")
            left -= len(chunk)
            yield chunk
        if f.read(1):
            raise ValueError(f"{path}: more data than the IDX header's dimensions promise")
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path}: corrupt gzip data: {e}") from None


def _build(images_path: pathlib.Path, labels_path: pathlib.Path, out: pathlib.Path, fingerprint) -> None:
    fi, (n, rows, cols) = _open_idx(images_path, 3)
    with fi:
        fl, (n_labels,) = _open_idx(labels_path, 1)
        with fl:
            if n_labels != n:
                raise ValueError(f"{labels_path}: {n_labels} labels, but {images_path.name} has {n} images")
            if rows == 0 or cols == 0:
                raise ValueError(f"{images_path}: images of {rows}x{cols} pixels")
            labels = np.frombuffer(b"".join(_chunks(fl, n, labels_path)), dtype=np.uint8)
            if n and int(labels.max()) >= len(CLASSES):
                bad = int(np.argmax(labels >= len(CLASSES)))
                raise ValueError(f"{labels_path}: label {labels[bad]} at position {bad} is not in 0..{len(CLASSES) - 1}")
            content = content_fingerprint("fashion-mnist", [images_path, labels_path])
            with ArrayFileWriter(out) as w:
                w.add("labels", labels)
                w.add_chunks("images", np.uint8, (n, rows, cols, 1), _chunks(fi, n * rows * cols, images_path))
                w.meta.update(kind="fashion-mnist", sources=fingerprint, fingerprint=content)


class FashionMnist(Dataset):
    """One split of Fashion-MNIST: ``len`` 60,000 (train) or 10,000 (test) for the real files.

    load_image(i): uint8 [28, 28, 1] (a fresh, writable copy), the i-th image of the split's
    image file; label(i): its IDX label in 0..9; source(i): ``"train-images-idx3-ubyte.gz#i"``.

    The constructor raises FileNotFoundError naming a missing file, ValueError naming a file
    whose IDX magic number, dimensions, labels or gzip data are wrong, and (``build=False``)
    ``_cache.IndexMissingError`` if the server has not decompressed the split yet.
    ``max_pixels`` is accepted for a uniform signature and unused.
    """

    kind = "fashion-mnist"

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        self.name = name
        self.split = cfg.split
        root = pathlib.Path(os.path.abspath(cfg.root))
        images_name, labels_name = FILES[cfg.split]
        self.images_file = images_name
        images_path, labels_path = root / images_name, root / labels_name
        fingerprint = []
        for p in (images_path, labels_path):
            try:
                fingerprint.append(file_fingerprint(p))
            except FileNotFoundError:
                raise FileNotFoundError(f"{p}: Fashion-MNIST file not found (dataset {name!r}, split {cfg.split})") from None
        out = cache_path(cache_dir, self.kind, str(images_path), fingerprint)
        index = None
        if build:
            try:
                index = ArrayFile(out)
            except (FileNotFoundError, ValueError):
                _build(images_path, labels_path, out, fingerprint)
                remove_stale(out)
        if index is None:
            index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {cfg.split})")
        self._index = index
        self._images = index["images"]
        self._labels = index["labels"]

    def __len__(self) -> int:
        return len(self._labels)

    @property
    def classes(self) -> list[str]:
        return list(CLASSES)

    @property
    def sample_spec(self) -> SampleSpec:
        _, rows, cols, ch = self._images.shape
        return SampleSpec(image_shape=(rows, cols, ch))

    def label(self, index: int) -> int:
        return int(self._labels[self._check(index)])

    def load_image(self, index: int, min_size: tuple[int, int] | None = None) -> np.ndarray:
        return self._images[self._check(index)].copy()

    def source(self, index: int) -> str:
        return f"{self.images_file}#{index}"
