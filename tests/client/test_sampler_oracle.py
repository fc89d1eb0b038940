"""batchd's sharding against the reference: ``torch.utils.data.DistributedSampler``.

``shard_indices`` claims DistributedSampler's rule (pad by wrapping, or cut with drop_last; rank r
takes positions r, r + world_size, ...) applied to the epoch's order. The order itself is
batchd's (numpy's PCG64 permutation, not torch's randperm), so the sampler is asked for the
positions (``shuffle=False`` over a dataset of the epoch's length) and they index batchd's order.
``tests/serve/test_core.py::test_ranks_partition_the_epoch`` checks that a real server serves
``shard_indices``.
"""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data.distributed import DistributedSampler

from batchd.sampler import epoch_order, global_positions, num_batches, shard_indices


@pytest.mark.parametrize("num_samples", [1, 2, 7, 10, 100, 101, 1000])
@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_shards_are_distributed_samplers(num_samples, world_size, drop_last, shuffle):
    order = epoch_order(num_samples, shuffle=shuffle, seed=7, epoch=3)
    for rank in range(world_size):
        sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=rank, shuffle=False,
                                     drop_last=drop_last)
        want = order[np.asarray(list(sampler), dtype=np.int64)]
        got = shard_indices(num_samples, shuffle=shuffle, seed=7, epoch=3, rank=rank, world_size=world_size,
                            drop_last=drop_last)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank} of {world_size}")
        assert len(got) == len(sampler)
        # the positions a sample's random stream is keyed by are the sampler's positions in the padded order
        positions = global_positions(0, len(got), rank=rank, world_size=world_size)
        np.testing.assert_array_equal(order[positions % num_samples], want)


@pytest.mark.parametrize("num_samples,world_size,batch_size", [(10, 3, 2), (100, 4, 7), (101, 8, 5), (5, 8, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_batches_per_epoch_are_a_dataloaders_over_the_sampler(num_samples, world_size, batch_size, drop_last):
    """``len(loader)``: DataLoader(batch_size, drop_last) over DistributedSampler(drop_last)."""
    import torch.utils.data as tud

    sampler = DistributedSampler(range(num_samples), num_replicas=world_size, rank=0, shuffle=False,
                                 drop_last=drop_last)
    want = len(tud.DataLoader(range(num_samples), batch_size=batch_size, sampler=sampler, drop_last=drop_last))
    assert num_batches(num_samples, batch_size, world_size=world_size, drop_last=drop_last) == want
