"""The ``cache:`` block of the server's config: the decoded-sample cache's memory and disk budget.

Example::

    cache: {memory_bytes: 8GiB, disk_dir: /var/cache/batchd/samples, disk_bytes: 200GB}
"""

from __future__ import annotations

import pathlib

from pydantic import ByteSize, Field, model_validator

from .base import StrictModel


class CacheConfig(StrictModel):
    """The server-wide cache of decoded, resized samples (pipeline prefixes; server/data/cache/).

    memory_bytes: shared memory the cache may use, header and table included (0: no cache).
    disk_dir: where entries spill once RAM is full (None: RAM only); entries of another build
        are removed at start. disk_bytes: the most bytes of entry files kept there.
    compress: lz4 each entry that shrinks by 10% or more (more samples fit; each hit decompresses).
    disk_max_idle_s: at server start, disk entries not used for this long are removed (seconds;
        entries are otherwise never evicted, so this returns the room of an abandoned pipeline).
    Sizes are bytes, or strings with units as pydantic's ByteSize reads them ("8GiB", "200GB").
    """

    memory_bytes: ByteSize = ByteSize(0)
    disk_dir: pathlib.Path | None = None
    disk_bytes: ByteSize = ByteSize(0)
    compress: bool = False
    disk_max_idle_s: float = Field(default=7 * 86400.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "CacheConfig":
        if self.memory_bytes and self.memory_bytes < 1 << 16:
            raise ValueError(f"memory_bytes ({int(self.memory_bytes)}) must be 0 or at least 64 KiB")
        if self.disk_bytes and self.disk_dir is None:
            raise ValueError("disk_bytes needs a disk_dir")
        if self.disk_bytes and not self.memory_bytes:
            raise ValueError("a disk tier needs memory_bytes (its index and counters live in shared memory)")
        return self
