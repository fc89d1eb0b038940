"""Write a dataset's samples as tar shards in WebDataset's layout (``batchd shards``).

Sample ``i`` becomes the members ``{i:09d}.{ext}`` (the encoded image's bytes as stored, not
re-encoded; ``ext`` from the source file's name), ``{i:09d}.cls`` (the integer label) and
``{i:09d}.json`` (``{"label": int, "class": name, "source": path}``), in dataset order, so a
``webdataset`` dataset over the shards serves the same images with the same labels in the same
order as the source (an ``imagefolder`` or a ``manifest``, local or on object storage).
"""

from __future__ import annotations

import io
import json
import os
import tarfile
import time
from collections.abc import Callable

from .base import Dataset


def _add(tar: tarfile.TarFile, name: str, data: bytes, mtime: float) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), mtime, 0o444
    info.uname = info.gname = "batchd"
    tar.addfile(info, io.BytesIO(data))


def write_shards(dataset: Dataset, pattern: str, *, samples_per_shard: int = 1000,
                 progress: Callable[[int, int], None] | None = None) -> list[str]:
    """Write every sample of ``dataset`` (a kind with ``read_bytes``) into tar files named
    ``pattern % shard_number`` (e.g. ``out/train-%06d.tar``), ``samples_per_shard`` per file.

    Returns the paths written. ``progress(done, total)`` is called after each shard. Raises
    ValueError for a pattern without one ``%d``-style field or samples_per_shard < 1, and
    SampleError for a sample that cannot be read (nothing is skipped: shards are a copy).
    """
    if samples_per_shard < 1:
        raise ValueError(f"samples_per_shard must be at least 1, got {samples_per_shard}")
    try:
        if pattern % 0 == pattern % 1:
            raise TypeError
    except (TypeError, ValueError):
        raise ValueError(f"shard name pattern {pattern!r} needs one %d field, e.g. out/train-%06d.tar") from None
    n = len(dataset)
    classes = dataset.classes
    mtime = time.time()
    written = []
    for shard, start in enumerate(range(0, n, samples_per_shard)):
        path = pattern % shard
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        tmp = f"{path}.tmp"
        with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
            for i in range(start, min(n, start + samples_per_shard)):
                source = dataset.source(i)
                ext = os.path.splitext(source.split("#")[-1])[1].lstrip(".").lower() or "jpg"
                label = dataset.label(i)
                key = f"{i:09d}"
                _add(tar, f"{key}.{ext}", bytes(dataset.read_bytes(i)), mtime)
                _add(tar, f"{key}.cls", str(label).encode(), mtime)
                meta = {"label": label, "class": classes[label] if label < len(classes) else str(label), "source": source}
                _add(tar, f"{key}.json", json.dumps(meta).encode(), mtime)
        os.replace(tmp, path)
        written.append(path)
        if progress is not None:
            progress(min(n, start + samples_per_shard), n)
    return written
