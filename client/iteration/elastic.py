"""Where a loader stands in an epoch, as a position in the epoch's global order: what
``state_dict()`` saves and what ``load_state_dict()`` resumes from, at the same or at another
``world_size`` and ``batch_size`` (an elastic resume).

The epoch's order, padded by wrapping, is one sequence of global positions, whatever the world
size (``batchd.sampler``): position ``p`` holds sample ``order[p % n]`` and keys its random
stream. A loader reads the epoch from ``start_position`` (0, unless the epoch was itself resumed
elastically): rank ``r``'s shard position ``i`` is ``start_position + r + world_size * i``.
Ranks step together, so after ``k`` batches of ``batch_size`` on every rank the positions
``[start_position, start_position + k * batch_size * world_size)`` have been served: that end is
the global position reached, whichever rank saved the state.

Resuming with the same ``world_size`` and ``batch_size`` continues at batch ``k`` of the same
reading (the same batches, and the server can share them with a reader that did not stop).
Resuming with others reads the epoch's remainder from the position reached, sharded over the new
ranks: every remaining sample once across them, each with the bytes the uninterrupted run gave
it (its position is the same); ``drop_last`` and the padding apply to the remainder
(``batchd.sampler``). A state of version 1 (before positions were saved) was always read from
position 0.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from batchd.client.loader import sampling
from batchd.client.transport.datasets import mismatches
from batchd.sampler import num_batches

log = logging.getLogger("batchd.client.loader")

STATE_VERSION = 2
TOPOLOGY = ("batch_size", "world_size", "rank")  # may differ between the saved state and the loader


@dataclass(frozen=True, slots=True)
class Resume:
    """Where the next iteration starts: batch ``next_batch`` of epoch ``epoch`` read from global
    position ``start_position``."""

    epoch: int
    start_position: int
    next_batch: int


def settings_of(options: Any, num_samples: int) -> dict[str, Any]:
    """What determines a loader's batches besides the position, as ``state_dict`` saves it:
    ``options`` (a ``LoaderOptions``) and the dataset's ``num_samples``."""
    o = options
    return {
        "dataset": o.dataset, "num_samples": num_samples, "batch_size": o.batch_size,
        "shuffle": o.shuffle, "seed": o.seed, "drop_last": o.drop_last, "rank": o.rank,
        "world_size": o.world_size,  # (batch_size, rank and world_size may differ on load: TOPOLOGY)
        "pipeline": "" if o.pipeline is None else o.pipeline.SerializeToString(deterministic=True).hex(),
        **({"decode_on_client": True} if o.decode_on_client else {}),  # other bytes (nvJPEG)
        **sampling.settings(o),  # a weighted or mixed epoch: its weights (digest), num_samples, sources
    }


def check_state(state: Any, settings: dict[str, Any], identity: dict[str, Any], *, strict: bool,
                address: str) -> None:
    """Whether a loader with ``settings`` (``settings_of``) reading a server whose dataset has
    ``identity`` (``DatasetInfo.identity``) at ``address`` may continue ``state``.

    Raises ValueError if ``state`` is not a state_dict (version 1 or 2), was saved with other
    settings (``TOPOLOGY`` aside), or (``strict``) against other fingerprints, naming what differs
    (saved value first); without ``strict``, other fingerprints are a warning.
    """
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION):
        raise ValueError(f"not a RemoteDataLoader state_dict (version 1 or {STATE_VERSION})")
    for key, value in settings.items():
        if key not in TOPOLOGY and state.get(key) != value:
            raise ValueError(f"state_dict was saved with {key}={state.get(key)!r}, this loader has {key}={value!r}")
    differ = mismatches(state, identity)
    if differ:
        what = (f"state_dict of dataset {settings['dataset']!r} was saved where the batches were other bytes than "
                f"{address} now serves: " + "; ".join(differ) + " (saved vs now)")
        if strict:
            raise ValueError(what + "; load_state_dict(state, strict=False) resumes anyway")
        log.warning("%s; resuming anyway (strict=False)", what)


def position_reached(start_position: int, next_batch: int, batch_size: int, world_size: int) -> int:
    """The global position after ``next_batch`` steps of every rank: ``start_position + next_batch
    * batch_size * world_size``."""
    return start_position + next_batch * batch_size * world_size


def resume_from(state: dict[str, Any], *, num_samples: int, batch_size: int, world_size: int,
                drop_last: bool) -> Resume:
    """Where a loader with these settings continues ``state`` (a ``state_dict``, version 1 or 2).
    num_samples: samples per epoch (the dataset's, or a sampler's or mix's ``num_samples``).

    The same batch_size and world_size: the saved batch of the saved reading. Others: batch 0 of
    the remainder from the position reached; the next epoch if no batch is left of it (with
    drop_last, fewer samples than one step of the new ranks). Raises ValueError for an invalid
    position (naming it).
    """
    epoch, next_batch = state.get("epoch"), state.get("next_batch")
    saved_batch, saved_world = state.get("batch_size"), state.get("world_size")
    start = state.get("start_position", 0) if state.get("version") == STATE_VERSION else 0
    numbers = (epoch, next_batch, saved_batch, saved_world, start)
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in numbers) or epoch < 0 or saved_batch < 1 \
            or saved_world < 1 or not 0 <= start < num_samples:
        raise ValueError(f"state_dict has an invalid position: epoch={epoch!r}, next_batch={next_batch!r}, "
                         f"start_position={start!r}, batch_size={saved_batch!r}, world_size={saved_world!r}")
    saved_total = num_batches(num_samples, saved_batch, world_size=saved_world, drop_last=drop_last,
                              start_position=start)
    if not 0 <= next_batch <= saved_total:
        raise ValueError(f"state_dict has an invalid position: next_batch={next_batch!r} of {saved_total} batches "
                         f"(epoch={epoch}, start_position={start})")
    if next_batch == saved_total:
        return Resume(epoch + 1, 0, 0)
    if (saved_batch, saved_world) == (batch_size, world_size):
        return Resume(epoch, start, next_batch)
    reached = position_reached(start, next_batch, saved_batch, saved_world)
    if num_batches(num_samples, batch_size, world_size=world_size, drop_last=drop_last, start_position=reached) == 0:
        return Resume(epoch + 1, 0, 0)
    return Resume(epoch, reached, 0)
