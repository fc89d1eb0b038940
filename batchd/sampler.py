"""Which dataset samples make up each batch: a pure function of the request.

The order of an epoch, for a dataset of ``n`` samples::

    order = arange(n)                                     if not shuffle
    order = Generator(PCG64(SeedSequence([seed, epoch]))).permutation(n)   if shuffle

Sharding follows ``torch.utils.data.DistributedSampler``: without drop_last the order is padded
by wrapping around to ``world_size * ceil(n / world_size)`` samples (every rank gets as many);
with drop_last it is cut to ``world_size * floor(n / world_size)``. Rank ``r`` takes
``order[r::world_size]``. Batches then follow ``DataLoader``: consecutive runs of ``batch_size``
samples of the shard, the last one partial unless drop_last.

Global positions. The order, padded by wrapping, is one sequence: position ``p`` holds sample
``order[p % n]`` and keys its random stream (``sample_stream``), whatever the world size. An
epoch may also be served from position ``start_position`` on (an elastic resume: another
world size or batch size continuing an epoch): the remaining positions ``start_position ..
n - 1`` are sharded as above, as if they were the whole epoch (``m = n - start_position``
samples, padded by wrapping to ``world_size * ceil(m / world_size)``, or cut to ``world_size *
floor(m / world_size)`` with drop_last), and every sample keeps its position: rank ``r``'s shard
position ``i`` is ``start_position + r + world_size * i``. Padding positions are ``>= n`` and hold
the samples at the start of the order, as DistributedSampler pads.

Only numpy is imported here; client and server share it so both agree on ``len(loader)``.
"""

from __future__ import annotations

import numpy as np


def shard_size(num_samples: int, world_size: int, drop_last: bool, start_position: int = 0) -> int:
    """Samples per rank in one epoch (from ``start_position`` on: see the module docstring)."""
    remaining = num_samples - start_position
    if drop_last:
        return remaining // world_size
    return -(-remaining // world_size)


def num_batches(num_samples: int, batch_size: int, *, world_size: int = 1, drop_last: bool = False,
                start_position: int = 0) -> int:
    """Batches per epoch for each rank (of the epoch's remainder from ``start_position`` on)."""
    per_rank = shard_size(num_samples, world_size, drop_last, start_position)
    return per_rank // batch_size if drop_last else -(-per_rank // batch_size)


def epoch_order(num_samples: int, *, shuffle: bool, seed: int, epoch: int) -> np.ndarray:
    """The order of all samples in one epoch: int64 [num_samples]."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples).astype(np.int64, copy=False)


def shard_indices(
    num_samples: int, *, shuffle: bool, seed: int, epoch: int, rank: int, world_size: int, drop_last: bool,
    start_position: int = 0,
) -> np.ndarray:
    """This rank's dataset sample indices for one epoch (from ``start_position`` on), in order:
    int64 [shard_size].

    Raises ValueError if rank is not in [0, world_size), the dataset is empty or start_position
    is not in [0, num_samples).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if num_samples < 1:
        raise ValueError("the dataset has no samples")
    if not 0 <= start_position < num_samples:
        raise ValueError(f"start_position {start_position} is not in [0, {num_samples}) (the epoch's samples)")
    order = epoch_order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch)
    # positions rank, rank + world_size, ... of the order padded by wrapping (as DistributedSampler
    # pads) or cut: computed directly, so memory is O(num_samples + shard), whatever world_size is
    size = shard_size(num_samples, world_size, drop_last, start_position)
    positions = global_positions(0, size, rank=rank, world_size=world_size, start_position=start_position)
    return order[positions % num_samples]


def global_positions(start: int, stop: int, *, rank: int, world_size: int, start_position: int = 0) -> np.ndarray:
    """Where shard positions ``start .. stop-1`` of rank ``rank`` lie in the epoch's global order.

    Returns int64 [stop - start]: ``start_position + rank + world_size * i`` for shard position
    ``i``, a position in the order padded by wrapping (so the padding's repeated samples get
    positions of their own, ``>= num_samples``). ``start_position`` (default 0) is where the
    sharded part of the order begins (an epoch resumed at another world size; module docstring).
    Every (rank, shard position) pair has a different global position, and a sample's global
    position does not depend on ``batch_size``, nor, resumed, on the world sizes before and after.
    Raises ValueError if rank is not in [0, world_size), ``0 <= start <= stop`` does not hold or
    start_position is negative.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if not 0 <= start <= stop:
        raise ValueError(f"shard positions [{start}, {stop}) are not a range of non-negative positions")
    if start_position < 0:
        raise ValueError(f"start_position must be non-negative, got {start_position}")
    return start_position + rank + world_size * np.arange(start, stop, dtype=np.int64)


def sample_key(*, seed: int, epoch: int) -> np.ndarray:
    """The Philox key of one epoch's augmentation streams: uint64 [2].

    ``SeedSequence([seed, epoch], spawn_key=(1,))``: a child of the sequence that shuffles the
    epoch (``epoch_order``), so the two share no state. Raises ValueError if seed or epoch is
    negative.
    """
    if seed < 0 or epoch < 0:
        raise ValueError(f"seed ({seed}) and epoch ({epoch}) must be non-negative")
    return np.random.SeedSequence([seed, epoch], spawn_key=(1,)).generate_state(2, np.uint64)


def sample_stream(key: np.ndarray, position: int) -> np.random.Generator:
    """The random stream of the sample at global ``position`` (see ``global_positions``).

    ``Generator(Philox(key=key).jumped(position))``: Philox's counter starts at
    ``[0, 0, position, 0]``, so the streams of different positions are disjoint blocks of
    2**128 draws under the epoch's key (numpy: random/parallel.rst, "Jumping the BitGenerator
    state"). Each sample's transforms draw from its stream in turn; nothing else (batch_size,
    rank, world_size, which worker, skipped neighbours) enters it.

    This is the reference definition; a worker re-keys one Philox in place with
    ``sample_stream_state`` (a few microseconds less per sample). key: uint64 [2] from
    ``sample_key``. Raises ValueError if position is not in [0, 2**63).
    """
    bit_generator = np.random.Philox(key=np.asarray(key, np.uint64))
    bit_generator.state = sample_stream_state(key, position)
    return np.random.Generator(bit_generator)


def sample_stream_state(key: np.ndarray, position: int) -> dict:
    """``Philox.state`` of ``sample_stream(key, position)`` before its first draw (a new dict).

    Assigning it to a ``numpy.random.Philox``'s ``state`` makes that bit generator the sample's
    stream. key: uint64 [2]. Raises ValueError if position is not in [0, 2**63).
    """
    if not 0 <= position < 1 << 63:
        raise ValueError(f"sample position {position} is not in [0, 2**63)")
    return {
        "bit_generator": "Philox",
        "state": {"counter": np.array([0, 0, position, 0], np.uint64), "key": np.array(key, np.uint64)},
        "buffer": np.zeros(4, np.uint64),
        "buffer_pos": 4,  # empty: the first draw computes block [0, 0, position, 0]
        "has_uint32": 0,
        "uinteger": 0,
    }

