"""Tar shards in WebDataset's layout, indexed so that every sample is one range read.

A shard is a tar file whose members are grouped into samples by key, as ``webdataset`` writes
and reads them: a member ``dir/000123.jpg`` has key ``dir/000123`` and extension ``jpg`` (the
key is the name up to the first dot of its last component); consecutive members with the same
key form one sample. A sample has one image (its first member with an image extension) and a
label: ``.cls`` (an integer as text) or ``.json`` (an object whose ``label_field`` is an
integer or a string). Other members (``.txt``, ``.caption``, ...) are ignored.

The index (see ``_cache``) holds per sample: shard number (int32), the image member's data
offset and size in bytes (int64), the label (int64) and the key (packed strings); the shard
URLs are in its meta. The server builds it once, reading each shard through once (sequentially,
16 MiB blocks), and reuses it while every shard keeps its size and version (mtime or ETag);
workers only map it. Reading a sample is then ``read(shard, offset, offset + size)``, so any
order (global shuffle, rank sharding) costs the same as shard order.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import pathlib
import re
import tarfile

import numpy as np

from ..decode import DEFAULT_MAX_PIXELS
from ..storage import Storage, StorageError, is_remote, local_path, safe_url
from ._cache import ArrayFile, ArrayFileWriter, cache_path, legacy_prefix, open_cached, remove_stale
from ._files import FileDataset, PackedStrings, file_settings, pack_strings
from ._fingerprint import FINGERPRINT_CHARS

IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp", "ppm", "bmp", "pgm", "tif", "tiff")
_KEY = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # webdataset.tariterators.base_plus_ext
_SKIP_META = re.compile(r"__[^/]*__($|/)")  # webdataset's skip_meta: shard metadata, not samples
_BLOCK = 16 << 20


def expand_shards(shards: str | list[str]) -> list[str]:
    """The shard list: each entry brace-expanded (``train-{000000..000099}.tar`` gives 100 names,
    in order, as ``braceexpand`` does); plain paths made absolute, URLs kept.

    Raises ValueError if the result is empty or names a shard twice.
    """
    from braceexpand import braceexpand

    entries = [shards] if isinstance(shards, str) else list(shards)
    out = []
    for entry in entries:
        for name in braceexpand(str(entry)):
            out.append(name if is_remote(name) else local_path(name))
    if not out:
        raise ValueError("shards: no shard given")
    seen = set()
    for name in out:
        if name in seen:
            raise ValueError(f"shards: {safe_url(name)} is listed twice")
        seen.add(name)
    return out


def split_name(name: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member name as WebDataset splits it; None if it has no extension."""
    m = _KEY.match(name)
    return (m.group(1), m.group(2)) if m else None


def _parse_label(shard: str, key: str, ext: str, data: bytes, label_field: str):
    try:
        if ext == "cls":
            return int(data.decode().strip())
        value = json.loads(data)
        if not isinstance(value, dict) or label_field not in value:
            raise ValueError(f"no field {label_field!r}")
        value = value[label_field]
        if isinstance(value, bool) or not isinstance(value, (int, str)):
            raise ValueError(f"{label_field!r} is {type(value).__name__}, expected an integer or a string")
        return value
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{safe_url(shard)}: sample {key!r}: bad label in its .{ext}: {e}") from None


def scan_shard(storage: Storage, shard: str, image_exts: tuple[str, ...], label_field: str):
    """Yield ``(key, image data offset, image size, label)`` for each sample of ``shard`` in order.

    Raises FileNotFoundError / StorageError if the shard cannot be read, ValueError (naming shard
    and key) for a sample without an image or a label, or a broken tar file.
    """
    f = storage.open(shard, _BLOCK)
    current: dict | None = None

    def finish(sample: dict):
        if sample["image"] is None:
            raise ValueError(f"{safe_url(shard)}: sample {sample['key']!r} has no image member "
                             f"(extensions {', '.join(image_exts)})")
        if sample["label"] is None:
            raise ValueError(f"{safe_url(shard)}: sample {sample['key']!r} has no .cls or .json label")
        return (sample["key"], *sample["image"], sample["label"])

    try:
        with contextlib.closing(f), tarfile.open(fileobj=f, mode="r:") as tar:
            for member in tar:
                if not member.isfile() or _SKIP_META.match(member.name):
                    continue
                parts = split_name(member.name)
                if parts is None:
                    continue
                key, ext = parts
                ext = ext.lower()
                if current is None or current["key"] != key:
                    if current is not None:
                        yield finish(current)
                    current = {"key": key, "image": None, "label": None}
                if current["image"] is None and ext in image_exts:
                    current["image"] = (member.offset_data, member.size)
                elif current["label"] is None and ext in ("cls", "json"):
                    current["label"] = _parse_label(shard, key, ext, tar.extractfile(member).read(), label_field)
        if current is not None:
            yield finish(current)
    except tarfile.TarError as e:
        raise ValueError(f"{safe_url(shard)}: not a readable tar file: {e}") from None


class WebDataset(FileDataset):
    """Samples of tar shards in WebDataset's layout (see the module docstring).

    ``cfg.shards``: a list of paths or URLs, or one brace pattern. Sample ``i`` is the i-th sample
    in shard order then member order (what ``webdataset.WebDataset(urls, shardshuffle=False)``
    yields). Integer labels are used as they are (classes ``"0".."max"``); string labels (from
    ``.json``) become their position among the sorted distinct values. load_image(i): uint8
    [H, W, 3] RGB; source(i): ``<shard URL or path>#<key>``.

    The constructor raises FileNotFoundError for a missing shard, ValueError (naming shard and
    key) for a sample without image or label, mixed integer and string labels, or no samples,
    and ``_cache.IndexMissingError`` (``build=False``) if the server has not built the index.
    read_bytes raises SampleError naming dataset, index and ``shard#key``.
    """

    kind = "webdataset"

    def __init__(self, name: str, cfg, cache_dir: pathlib.Path, *, build: bool, max_pixels: int = DEFAULT_MAX_PIXELS):
        super().__init__(name, max_pixels=max_pixels, **file_settings(cfg))
        options = self.storage_options
        shards = expand_shards(cfg.shards)
        image_exts = tuple(sorted({e.lower().lstrip(".") for e in cfg.extensions}))
        label_field = cfg.label_field
        storage = Storage(shards[0], options)
        versions = []
        for shard in shards:
            try:
                versions.append(storage.info(shard))
            except FileNotFoundError:
                raise FileNotFoundError(f"dataset {name!r}: shard {safe_url(shard)} not found") from None
            except StorageError as e:
                raise StorageError(f"dataset {name!r}: {e}") from None
        key = {"shards": [safe_url(s) for s in shards], "versions": versions, "extensions": image_exts,
               "label_field": label_field, "storage": options.fingerprint_part()}
        identity = {k: v for k, v in key.items() if k != "versions"}  # versions change with the shards' contents
        out = cache_path(cache_dir, self.kind, safe_url(shards[0]), key, identity=identity)
        index = None
        if build:
            try:
                index = ArrayFile(out)
            except (FileNotFoundError, ValueError):
                self._build(storage, shards, image_exts, label_field, out)
                remove_stale(out, legacy_prefix(self.kind, safe_url(shards[0])))
        if index is None:
            index = open_cached(out, what=f"dataset {name!r} ({self.kind}, {safe_url(shards[0])}, ...)")
        self._shards = shards
        self._attach_shards(index)

    def _build(self, storage: Storage, shards: list[str], image_exts, label_field: str, out: pathlib.Path) -> None:
        keys: list[str] = []
        shard_ids, offsets, sizes, labels = [], [], [], []
        for s, shard in enumerate(shards):
            for key, offset, size, label in scan_shard(storage, shard, image_exts, label_field):
                keys.append(key)
                shard_ids.append(s)
                offsets.append(offset)
                sizes.append(size)
                labels.append(label)
        if not keys:
            raise ValueError(f"dataset {self.name!r}: no samples in {len(shards)} shard(s)")
        kinds = {type(label) for label in labels}
        if kinds == {int}:
            label_array = np.asarray(labels, dtype=np.int64)
            if label_array.min() < 0:
                raise ValueError(f"dataset {self.name!r}: sample {keys[int(np.argmin(label_array))]!r} has a negative label")
            classes = [str(i) for i in range(int(label_array.max()) + 1)]
        elif kinds == {str}:
            classes = sorted(set(labels))
            position = {c: i for i, c in enumerate(classes)}
            label_array = np.asarray([position[label] for label in labels], dtype=np.int64)
        else:
            raise ValueError(f"dataset {self.name!r}: labels are both integers and strings; use one kind")
        arrays = {
            "shard": np.asarray(shard_ids, dtype=np.int32),
            "offset": np.asarray(offsets, dtype=np.int64),
            "size": np.asarray(sizes, dtype=np.int64),
            "labels": label_array,
        }
        key_bytes, key_offsets = pack_strings(keys)
        del keys, shard_ids, offsets, sizes, labels
        h = hashlib.sha256(b"batchd-dataset-fingerprint/1\0webdataset\0")
        h.update(json.dumps(classes).encode())
        for array in (key_bytes, key_offsets, *arrays.values()):
            h.update(np.ascontiguousarray(array).tobytes())
        with ArrayFileWriter(out) as w:
            for array_name, array in arrays.items():
                w.add(array_name, array)
            w.add("path_bytes", key_bytes)
            w.add("path_offsets", key_offsets)
            w.meta.update(kind=self.kind, shards=[safe_url(s) for s in shards], classes=classes,
                          fingerprint=h.hexdigest()[:FINGERPRINT_CHARS])

    def _attach_shards(self, index) -> None:
        self._attach(index, self._shards[0])
        self._shard_of, self._offset, self._size = index["shard"], index["offset"], index["size"]
        self._keys = PackedStrings(index["path_bytes"], index["path_offsets"])
        if not (len(self._shard_of) == len(self._offset) == len(self._size) == len(self)):
            raise ValueError(f"{index.path}: index arrays disagree in length")
        if len(index.meta["shards"]) != len(self._shards):
            raise ValueError(f"{index.path}: index has {len(index.meta['shards'])} shards, config {len(self._shards)}")

    def key(self, index: int) -> str:
        """The sample's key inside its shard (e.g. ``000123``)."""
        return self._keys[self._check(index)]

    def source(self, index: int) -> str:
        """``<shard path or URL>#<key>`` (the URL without credentials)."""
        try:
            index = self._check(index)
        except IndexError:
            return f"#{index}"
        return f"{safe_url(self._shards[int(self._shard_of[index])])}#{self._keys[index]}"

    def location(self, index: int) -> str:
        return self._shards[int(self._shard_of[self._check(index)])]

    def read_bytes(self, index: int) -> bytes:
        """The image member's bytes: one range read of its shard (thread-safe).

        Raises IndexError out of range; SampleError naming ``shard#key`` and the error (after
        the storage library's retries), or a short read (the shard changed since indexing).
        """
        index = self._check(index)
        shard = self.location(index)
        start, size = int(self._offset[index]), int(self._size[index])
        try:
            data = self.storage.read(shard, start, start + size)
        except FileNotFoundError as e:
            raise self.sample_error(index, str(e) if is_remote(shard) else f"cannot read file: {e}") from None
        except (StorageError, OSError) as e:
            raise self.sample_error(index, str(e)) from None
        if len(data) != size:
            raise self.sample_error(index, f"short read: {len(data)} of {size} bytes at offset {start} "
                                           "(the shard changed after it was indexed)")
        return data
