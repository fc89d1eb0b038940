"""What datasets of image files share: the packed path index, reading a file, and decoding it to
RGB (with ``server/data/decode.py``).

The index of a file dataset is three arrays in one ``.bidx`` file (see ``_cache``):

* ``path_bytes``   uint8 [total]: every sample's path, UTF-8 (``os.fsencode``), concatenated;
* ``path_offsets`` int64 [n + 1]: sample ``i``'s path is ``path_bytes[offsets[i]:offsets[i+1]]``;
* ``labels``       int64 [n].

and ``meta["classes"]``. Mapped read-only, it costs a worker only the pages it touches instead
of one Python string per sample.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Sequence

import numpy as np

from batchd.errors import SampleError

from ..decode import DEFAULT_MAX_PIXELS, ImageReadError, decode_rgb, upright_size
from ..storage import Storage, StorageError, StorageOptions, is_remote, join, local_path, safe_url
from .base import Dataset, SampleSpec

# the rule that picks a reduced decode's scale, in the build fingerprint: 2 = the cheapest M/8 for a
# first resize, and a first random crop drawn ahead of a decode at its window's scale
# (server/compute/region.py); 1 (unnamed) was 1/2, 1/4, 1/8 for a first resize only
REDUCED_RULE = "2"


class PackedStrings:
    """A read-only sequence of strings stored as ``data`` uint8 [total] + ``offsets`` int64 [n + 1]."""

    __slots__ = ("data", "offsets")

    def __init__(self, data: np.ndarray, offsets: np.ndarray):
        if offsets.ndim != 1 or len(offsets) < 1 or int(offsets[-1]) != len(data) or int(offsets[0]) != 0:
            raise ValueError(f"packed strings: offsets [{len(offsets)}] do not span data [{len(data)}]")
        self.data, self.offsets = data, offsets

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        start, end = self.offsets[i], self.offsets[i + 1]
        return os.fsdecode(self.data[start:end].tobytes())


def pack_strings(strings: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
    """``(data uint8 [total], offsets int64 [n + 1])`` for ``strings`` (encoded with ``os.fsencode``)."""
    encoded = [os.fsencode(s) for s in strings]
    offsets = np.zeros(len(encoded) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in encoded], out=offsets[1:])
    data = np.frombuffer(b"".join(encoded), dtype=np.uint8)
    return data, offsets


def file_settings(cfg) -> dict:
    """``FileDataset``'s keyword arguments from a dataset config (server/config/datasets.py):
    ``reduced_decode`` and ``storage_options``, their defaults where ``cfg`` has none."""
    return {"reduced_decode": getattr(cfg, "reduced_decode", True),
            "storage_options": getattr(cfg, "storage_options", None) or StorageOptions()}


class FileDataset(Dataset):
    """Base of datasets whose samples are image files named by a packed path index.

    Subclasses build or find the index, then call ``_attach(index, root)``. Samples decode with
    ``read_rgb``: uint8 [H, W, 3] RGB, shapes varying (sample_spec ``(-1, -1, 3)``).
    ``reduced_decode=False``: always decode JPEGs at full size (``min_size`` is ignored).
    ``upright``: ``decode`` applies the EXIF orientation (the kinds without targets); False: the
    stored pixels (coco and segmentation, whose annotations are in that frame).
    """

    upright = True

    def __init__(self, name: str, *, max_pixels: int = DEFAULT_MAX_PIXELS, reduced_decode: bool = True,
                 storage_options: StorageOptions | None = None):
        self.name = name
        self.max_pixels = int(max_pixels)
        self.reduced_decode = bool(reduced_decode)
        self.storage_options = storage_options if storage_options is not None else StorageOptions()

    def _attach(self, index, root: str) -> None:
        """Use ``index`` (an ``_cache.ArrayFile``) with paths relative to ``root`` (a path or URL).
        Its ``labels`` array is optional (kinds whose samples have no single label omit it)."""
        self.storage = Storage(root, self.storage_options)
        self._index = index  # keeps the mapping alive
        self._paths = PackedStrings(index["path_bytes"], index["path_offsets"])
        self._labels = index.arrays.get("labels")
        self._classes = list(index.meta["classes"])
        self.root = root
        if self._labels is not None and len(self._labels) != len(self._paths):
            raise ValueError(f"{index.path}: {len(self._paths)} paths but {len(self._labels)} labels")

    def __len__(self) -> int:
        return len(self._paths)

    @property
    def classes(self) -> list[str]:
        return list(self._classes)

    @property
    def sample_spec(self) -> SampleSpec:
        return SampleSpec(image_shape=(-1, -1, 3))

    def label(self, index: int) -> int:
        return int(self._labels[self._check(index)])

    @property
    def decode_settings(self) -> dict[str, str]:
        """``reduced_decode`` on/off and, when on, the rule that picks the scale (``REDUCED_RULE``):
        servers that decode a first random crop otherwise give other bytes."""
        if not self.reduced_decode:
            return {"reduced_decode": "off"}
        return {"reduced_decode": "on", "reduced_decode_rule": REDUCED_RULE}

    def decoded_size(self, index: int, data) -> tuple[int, int] | None:
        """A JPEG's ``(height, width)`` from its headers (``upright_size``: EXIF orientation
        applied if ``upright``) when ``reduced_decode`` is on; else None. Never raises."""
        if not self.reduced_decode or not isinstance(data, (bytes, bytearray, memoryview, np.ndarray)):
            return None
        return upright_size(data, self.upright)

    def source(self, index: int) -> str:
        """The path as stored in the index (relative to the root unless it was absolute or a URL;
        a URL without user info or query, so never a credential)."""
        try:
            return safe_url(self._paths[self._check(index)])
        except IndexError:
            return f"#{index}"

    def location(self, index: int) -> str:
        """The file or URL of sample ``index``."""
        return join(self.root, self._paths[self._check(index)])

    def path(self, index: int) -> pathlib.Path:
        """The local file of sample ``index`` (raises ValueError for a dataset on remote storage)."""
        return pathlib.Path(local_path(self.location(index)))

    def read_bytes(self, index: int) -> bytes:
        """The encoded bytes of sample ``index`` (I/O only: safe to call from several threads).

        Raises IndexError out of range; SampleError whose reason is ``cannot read file: [Errno N]
        ...`` (local), ``no such object: URL`` or ``cannot read URL: Error: message`` (remote,
        after the storage library's retries; the URL without credentials).
        """
        index = self._check(index)
        return self.read_file(index, self.storage, self.location(index), self.source(index))

    def read_file(self, index: int, storage: Storage, location: str, shown: str) -> bytes:
        """The bytes at ``location`` (read through ``storage``) for sample ``index``; raises
        SampleError naming ``shown`` (a path relative to a root, or a URL without credentials)
        with ``read_bytes``'s reasons."""
        try:
            return storage.read(location)
        except FileNotFoundError as e:
            reason = str(e) if is_remote(location) else f"cannot read file: [Errno 2] {e.strerror or 'No such file or directory'}"
            raise SampleError(dataset=self.name, index=index, path=shown, reason=reason) from None
        except StorageError as e:
            raise SampleError(dataset=self.name, index=index, path=shown, reason=str(e)) from None
        except OSError as e:
            raise SampleError(dataset=self.name, index=index, path=shown,
                              reason=f"cannot read file: [Errno {e.errno}] {e.strerror}") from None

    def decode(self, index: int, data, min_size: tuple[int, int] | None = None,
               eighths: int | None = None, window: tuple[int, int, int, int] | None = None,
               jpeg_index=None) -> np.ndarray:
        """Decode ``data`` (what ``read_bytes(index)`` returned): uint8 [H, W, 3] RGB.

        ``min_size``, ``eighths``, ``window``, ``jpeg_index``: see ``decode_rgb`` (reduced JPEG decoding; all
        ignored with reduced_decode off). EXIF orientation applied if ``upright``. Raises
        SampleError (see ``decode_rgb``'s reasons).
        """
        if not self.reduced_decode:
            min_size = eighths = window = None
        try:
            return decode_rgb(data, self.max_pixels, min_size, self.upright, eighths, window, jpeg_index)
        except ImageReadError as e:
            raise self.sample_error(index, e.reason) from None
