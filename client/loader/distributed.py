"""This process's shard when the caller does not say: torch.distributed's rank and world size.

``RemoteDataLoader(rank=None, world_size=None)`` (the defaults) asks, in order:

1. an initialised default process group (``torch.distributed.get_rank()/get_world_size()``);
2. the ``RANK`` and ``WORLD_SIZE`` environment variables that ``torchrun`` (and most launchers)
   set for every process, before ``init_process_group`` is called;
3. rank 0 of 1.

An explicit value always wins (for the other one, the same order applies).
"""

from __future__ import annotations

import os

import torch.distributed as dist


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def rank_and_world_size(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """(rank, world_size): the given ones, else torch.distributed's, else RANK/WORLD_SIZE, else 0/1.

    Raises ValueError if RANK or WORLD_SIZE is set but not an integer. Range checks are the
    caller's.
    """
    if rank is not None and world_size is not None:
        return rank, world_size
    if dist.is_available() and dist.is_initialized():
        found_rank, found_size = dist.get_rank(), dist.get_world_size()
    else:
        found_rank, found_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    if rank is None:
        rank = 0 if found_rank is None else found_rank
    if world_size is None:
        world_size = 1 if found_size is None else found_size
    return rank, world_size
