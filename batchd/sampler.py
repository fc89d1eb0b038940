"""Which dataset samples make up each batch: a pure function of the request.

The order of an epoch, for a dataset of ``n`` samples::

    order = arange(n)                                     if not shuffle
    order = Generator(PCG64(SeedSequence([seed, epoch]))).permutation(n)   if shuffle

Sharding follows ``torch.utils.data.DistributedSampler``: without drop_last the order is padded
by wrapping around to ``world_size * ceil(n / world_size)`` samples (every rank gets as many);
with drop_last it is cut to ``world_size * floor(n / world_size)``. Rank ``r`` takes
``order[r::world_size]``. Batches then follow ``DataLoader``: consecutive runs of ``batch_size``
samples of the shard, the last one partial unless drop_last.

Only numpy is imported here; client and server share it so both agree on ``len(loader)``.
"""

from __future__ import annotations

import numpy as np


def shard_size(num_samples: int, world_size: int, drop_last: bool) -> int:
    """Samples per rank in one epoch."""
    if drop_last:
        return num_samples // world_size
    return -(-num_samples // world_size)


def num_batches(num_samples: int, batch_size: int, *, world_size: int = 1, drop_last: bool = False) -> int:
    """Batches per epoch for each rank."""
    per_rank = shard_size(num_samples, world_size, drop_last)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of all samples in one epoch: int64 [num_samples]."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def shard_indices(
    num_samples: int, *, shuffle: bool, seed: int, epoch: int, rank: int, world_size: int, drop_last: bool
) -> np.ndarray:
    """This rank's dataset sample indices for one epoch, in order: int64 [shard_size].

    Raises ValueError if rank is not in [0, world_size) or the dataset is empty.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if num_samples < 1:
        raise ValueError("the dataset has no samples")
    order = epoch_order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch)
    # positions rank, rank + world_size, ... of the order padded by wrapping (as DistributedSampler
    # pads) or cut: computed directly, so memory is O(num_samples + shard), whatever world_size is
    positions = rank + world_size * np.arange(shard_size(num_samples, world_size, drop_last), dtype=np.int64)
    return order[positions % num_samples]


def batch_seed(*, seed: int, epoch: int, batch_index: int, rank: int, world_size: int) -> int:
    """The seed of the pipeline's random state for one batch: a 32-bit int.

    Derived with numpy's SeedSequence from (seed, epoch, rank, world_size, batch_index), so it
    does not depend on which worker builds the batch or when.
    """
    ss = np.random.SeedSequence([seed, epoch, rank, world_size, batch_index])
    return int(ss.generate_state(1, np.uint32)[0])
