"""The worker's recheck of ``kind: python`` samples while serving: randomness batchd cannot key.

The server checks a python dataset at start-up (``PythonDataset.check_keyed`` on sample 0 and a
few others, server/data/datasets/python.py); a dataset whose unkeyed randomness starts later
(after its first samples, on some indices only) passes that check. So each worker, at random
intervals (``RECHECK_EVERY`` samples on average), builds a sample it has just built a second
time under the same key and lets ``check_keyed`` refuse the dataset
(``UnkeyableRandomnessError``). ``Rechecks`` is mixed into the worker (``worker._Worker``),
whose ``WorkerSamples._load`` (``samples.py``) calls ``recheck`` for each sample a dataset builds
in memory.
"""

from __future__ import annotations

import random

import numpy as np

from batchd.server.data.datasets import Dataset

# mean number of samples between two checks of a kind: python dataset's keying while serving
# (``Rechecks.recheck``: the sample built a second time, watched); the gaps are random
RECHECK_EVERY = 256


class Rechecks:
    """When to check a python sample's keying next, and the check (mixed into the worker)."""

    def _start_rechecks(self) -> None:
        """(the worker's ``__init__``) when to check a kind: python sample's keying next
        (``recheck``): drawn by batchd's own generator, seeded by the OS, never one a dataset
        draws from (so the bytes do not depend on it)."""
        self._gaps = random.Random()
        self._until_recheck = self._gap()

    def _gap(self) -> int:
        """Samples until the next ``recheck``: 1 + exponential of mean ``RECHECK_EVERY`` - 1."""
        return 1 + int(self._gaps.expovariate(1.0 / max(RECHECK_EVERY - 1, 1e-9))) if RECHECK_EVERY > 1 else 1

    def recheck(self, ds: Dataset, index: int, key: np.ndarray, sample: dict) -> None:
        """At random intervals (``RECHECK_EVERY`` samples on average), build a ``kind: python``
        sample (just built: ``sample``) a second time under the same key and raise
        ``UnkeyableRandomnessError`` naming the dataset if randomness batchd cannot key shows
        (``PythonDataset.check_keyed``). Not for ``deterministic: false`` datasets."""
        check = getattr(ds, "check_keyed", None)
        if check is None or not getattr(ds, "deterministic", True):
            return
        self._until_recheck -= 1
        if self._until_recheck > 0:
            return
        self._until_recheck = self._gap()
        check(index, key, sample)
