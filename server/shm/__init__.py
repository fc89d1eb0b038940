"""Shared memory, beneath every layer of the server: named segments (``segments.py``: the
files in ``/dev/shm``, their owner's lock, cleanup after a server that died) and the pool of
batch slots built from them (``slots.py``). Workers write batches into slots (``compute/``), the
decoded-sample cache keeps its entries in a segment (``data/cache/``), streams lend slots to
same-host clients or copy out of them (``serve/``); ``client/transport/shm.py`` maps them on the other side.
"""

from .segments import SHM_DIR, Owner, Segment, remove_stale
from .slots import SlotPool

__all__ = ["SHM_DIR", "Owner", "Segment", "SlotPool", "remove_stale"]
