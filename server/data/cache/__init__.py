"""A server-wide cache of pipeline prefix outputs (decoded, resized samples): RAM, then disk.

See ``shared.py`` (the shared-memory RAM tier, policy, concurrency), ``disk.py`` (the disk
tier) and ``entry.py`` (the checksummed entry format); ``batchd.server.compute.prefix`` splits a
pipeline into the cached prefix and its random rest.
"""

from .entry import CorruptEntry
from .shared import Field, SharedCache, sample_key

__all__ = ["CorruptEntry", "Field", "SharedCache", "sample_key"]
