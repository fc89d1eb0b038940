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

Weighted and mixed epochs (``batchd.WeightedRandomSampler``, ``batchd.Mix``; docs/sampling.md).
Their epoch is a *draw* of ``num_samples`` entries instead of a permutation of the dataset, a pure
function of (seed, epoch, the weights, num_samples, replacement); it is then one sequence of
global positions, padded, cut and sharded exactly as an order above (``shard_of``), so ranks,
elastic resume, several servers and hedging need nothing new. A sample drawn twice has two
positions, hence two augmentation streams. The formulas, with
``g(*spawn) = Generator(PCG64(SeedSequence([seed, epoch], spawn_key=spawn)))``::

    weighted, replacement=True:   c = cumsum(w); c /= c[-1]
                                  draw = searchsorted(c, g(2).random(num_samples), side="right")
    weighted, replacement=False:  keys = -log1p(-g(2).random(n)) / w   (inf where w == 0)
                                  draw = argsort(keys, kind="stable")[:num_samples]
    mix of sources k = 0..K-1:    c = cumsum(m); c /= c[-1]            (m: the sources' weights)
                                  source = searchsorted(c, g(3).random(num_samples), side="right")
                                  index[source == k] = concatenate([h.permutation(n_k) for each pass])[:count_k]
                                  with h = g(3, k), one permutation per pass over source k

(``weighted_draw``, ``mix_draw``). Without replacement the exponential keys are Efraimidis and
Spirakis' weighted sampling without replacement ("Weighted random sampling with a reservoir",
2006): the ``num_samples`` smallest keys, in increasing order, are a weighted draw without
replacement in draw order, as ``torch.multinomial(w, num_samples, replacement=False)`` samples.

Only numpy is imported here; client and server share it so both agree on ``len(loader)``.
"""

from __future__ import annotations

import hashlib

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
    is not in [0, num_samples) (``shard_of``'s checks).
    """
    if num_samples < 1:
        raise ValueError("the dataset has no samples")
    order = epoch_order(num_samples, shuffle=shuffle, seed=seed, epoch=epoch)
    return shard_of(order, rank=rank, world_size=world_size, drop_last=drop_last, start_position=start_position)


def shard_of(order: np.ndarray, *, rank: int, world_size: int, drop_last: bool, start_position: int = 0) -> np.ndarray:
    """Rank ``rank``'s part of an epoch's ``order`` (any array of N entries: a permutation, a
    weighted draw, a mix's sources or indices), from ``start_position`` on, as the module
    docstring shards an order: array [shard_size] of order's dtype.

    Raises ValueError if rank is not in [0, world_size), the order is empty or start_position is
    not in [0, N).
    """
    n = len(order)
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    if n < 1:
        raise ValueError("the epoch has no samples")
    if not 0 <= start_position < n:
        raise ValueError(f"start_position {start_position} is not in [0, {n}) (the epoch's samples)")
    # positions rank, rank + world_size, ... of the order padded by wrapping (as DistributedSampler
    # pads) or cut: computed directly, so memory is O(N + shard), whatever world_size is
    size = shard_size(n, world_size, drop_last, start_position)
    positions = global_positions(0, size, rank=rank, world_size=world_size, start_position=start_position)
    return order[positions % n]


def _generator(seed: int, epoch: int, *spawn: int) -> np.random.Generator:
    """``Generator(PCG64(SeedSequence([seed, epoch], spawn_key=spawn)))``: spawn (2,) draws a weighted
    epoch, (3,) a mix's sources, (3, k) the passes over its source k. ``epoch_order`` uses the root
    (no spawn key) and ``sample_key`` (1,): no two share a stream."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch], spawn_key=spawn)))


def weights_digest(weights: np.ndarray) -> str:
    """What names a weight vector on the wire: ``sha256(np.asarray(weights, "<f8").tobytes()).hexdigest()``
    (64 hex characters)."""
    return hashlib.sha256(np.ascontiguousarray(weights, "<f8").tobytes()).hexdigest()


def check_weights(weights, what: str = "weights") -> np.ndarray:
    """``weights`` as float64 [n], checked: one dimension, at least one entry, every entry finite
    and >= 0, not all zero. Raises ValueError naming ``what``, the first bad entry and its value
    ("weights[3] is nan")."""
    try:
        w = np.asarray(weights, dtype=np.float64)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be a sequence of non-negative numbers: {e}") from None
    if w.ndim != 1:
        raise ValueError(f"{what} must be one-dimensional (one weight per sample), got shape {list(w.shape)}")
    if len(w) == 0:
        raise ValueError(f"{what} is empty: give one weight per sample")
    bad = ~np.isfinite(w) | (w < 0)
    if bad.any():
        i = int(np.argmax(bad))
        raise ValueError(f"{what}[{i}] is {float(w[i])!r}; every weight must be finite and non-negative")
    if not (w > 0).any():
        raise ValueError(f"{what} are all zero ({len(w)} weights); at least one must be positive")
    return w


def check_draw(num_samples: int, replacement: bool, nonzero: int, what: str = "num_samples") -> None:
    """Raises ValueError unless ``num_samples`` >= 1 and, without replacement, at most ``nonzero``
    (the samples of non-zero weight)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, (int, np.integer)) or num_samples < 1:
        raise ValueError(f"{what} must be a positive integer, got {num_samples!r}")
    if not replacement and num_samples > nonzero:
        raise ValueError(f"{what}={num_samples} without replacement, but only {nonzero} samples have a non-zero "
                         "weight: draw at most that many, or replacement=True")


def weighted_draw(weights: np.ndarray, num_samples: int, *, replacement: bool, seed: int, epoch: int) -> np.ndarray:
    """The samples of one weighted epoch, in draw order: int64 [num_samples] (module docstring).

    weights: float64 [n], checked by ``check_weights``; ``check_draw`` holds. Sample i is drawn
    with probability weights[i] / sum(weights) at each draw (with replacement), or by successive
    weighted draws among those not drawn yet (without).
    """
    w = np.asarray(weights, dtype=np.float64)
    rng = _generator(seed, epoch, 2)
    if replacement:
        c = np.cumsum(w)
        c /= c[-1]
        return np.searchsorted(c, rng.random(num_samples), side="right").astype(np.int64, copy=False)
    keys = np.full(len(w), np.inf)
    np.divide(-np.log1p(-rng.random(len(w))), w, out=keys, where=w > 0)
    return np.argsort(keys, kind="stable")[:num_samples].astype(np.int64, copy=False)


def mix_draw(sizes, weights, num_samples: int, *, seed: int, epoch: int) -> tuple[np.ndarray, np.ndarray]:
    """One epoch of a mix: (source int64 [num_samples], index int64 [num_samples]) (module docstring).

    sizes: each source's samples (>= 1); weights: the sources' weights (finite, >= 0, not all 0).
    Position p takes source[p] with probability weights[k] / sum(weights), and the next sample
    of that source's own shuffled order: each pass over source k is a permutation of its
    samples drawn from ``g(3, k)``, so no sample of a source comes twice before all of it came.
    """
    m = np.asarray(weights, dtype=np.float64)
    c = np.cumsum(m)
    c /= c[-1]
    source = np.searchsorted(c, _generator(seed, epoch, 3).random(num_samples), side="right").astype(np.int64)
    index = np.empty(num_samples, np.int64)
    for k, n_k in enumerate(sizes):
        at = np.flatnonzero(source == k)
        if not len(at):
            continue
        h = _generator(seed, epoch, 3, k)
        passes = [h.permutation(n_k) for _ in range(-(-len(at) // n_k))]
        index[at] = np.concatenate(passes)[: len(at)]
    return source, index


def draw_key(key: np.ndarray, position: int) -> np.ndarray:
    """The key a ``kind: python`` dataset's own randomness uses for the sample at ``position`` of a
    weighted or mixed epoch (uint64 [2]): BLAKE2b (16 bytes) of the epoch's key (``sample_key``),
    the position and a tag. A plain epoch keys it to (epoch key, index); a drawn epoch may hold a
    sample twice, so there it is keyed to the position, and the two copies differ."""
    data = np.asarray(key, "<u8").tobytes() + int(position).to_bytes(8, "little") + b"batchd-draw"
    return np.frombuffer(hashlib.blake2b(data, digest_size=16).digest(), "<u8").astype(np.uint64)


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

