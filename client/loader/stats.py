"""The client's own figures: how long the training loop waited for batches, and what the loader
did meanwhile (``RemoteDataLoader.stats()``).

``LoaderStats`` keeps the loop's waits as ``batchd.client.loader.timings.timed`` measures them
(one measurement for this and ``loader.profile()``), and the counters the servers' loaders bump
(reconnects, failovers, stalls). ``snapshot()`` is a plain dict, with these keys (units in the
names: seconds, or a ratio in [0, 1]):

* ``batches``, ``samples``: batches and samples yielded to the training loop, all iterations
  (samples as the server sent them, whatever ``collate_fn`` made of the batch);
* ``wait_seconds``: total time spent in ``__next__``; ``wait_p50_seconds``, ``wait_p95_seconds``,
  ``wait_p99_seconds``: percentiles of the per-batch wait over the last ``window`` batches
  (numpy's linear interpolation; 0.0 before the first batch);
* ``wall_seconds``: from the first ``__next__`` call to the last batch handed over;
  ``wait_fraction``: ``wait_seconds / wall_seconds`` (0.0 before the first batch), the share of
  the training loop's time spent waiting for data;
* ``batches_per_server``: {address: batches yielded that this server sent first, all iterations};
* ``servers``: {address: {``batches`` (as above), and of the epoch in progress (else the last):
  ``share`` (0..1), ``credit``, ``up``, ``stalled``, ``stalls`` (times it was found stalled),
  ``regranted``, ``duplicates``, ``workers``, ``build_seconds``, as ``loader.server_stats()``
  has them (``batchd.client.iteration.servers.Servers.server_stats``)}};
* ``bytes_received``: {``"shm"``, ``"socket"``, ``"inline"``: bytes of batches received that way,
  all iterations}: for shared memory the tensors' bytes mapped from the server's slots, for the
  socket data plane the bytes read from data connections (headers included), inline the gRPC
  messages' bytes;
* ``reconnects`` (a broken call resumed on its server), ``failovers`` (a server's call broke
  while others were up: its batches went to them at once), ``stalls`` (a server found stalled,
  its batches granted to the others: ``batchd.client.iteration.credit``),
  ``data_plane_fallbacks`` (a server whose data port could not be used, or refused every dial
  of a call's data connection, with ``transport="auto"``: its calls go inline from then on;
  over shared memory, its calls' Batch messages come on the calls, the bytes still in place;
  ``batchd.client.transport.redial``).

Thread-safe: the counters are bumped from the servers' and the loader's threads.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

import numpy as np

from batchd.client.transport import fields

WAIT_WINDOW = 10_000  # per-batch waits kept for the percentiles
COUNTERS = ("reconnects", "failovers", "stalls", "data_plane_fallbacks")
TRANSPORTS = ("shm", "socket", "inline")
_SERVER_KEYS = ("batches", "share", "credit", "up", "stalled", "stalls", "regranted", "duplicates", "workers",
                "build_seconds")


class LoaderStats:
    """The figures of one loader (module docstring). window: per-batch waits kept for percentiles."""

    def __init__(self, window: int = WAIT_WINDOW):
        self._lock = threading.Lock()
        self._waits: collections.deque[float] = collections.deque(maxlen=window)
        self._counters: collections.Counter[str] = collections.Counter()
        self._received: dict[str, int] = dict.fromkeys(TRANSPORTS, 0)
        self.batches = 0
        self.samples = 0
        self.wait_seconds = 0.0
        self._first_ask: float | None = None  # time.monotonic() of the first __next__
        self._last_handed: float | None = None  # ... when the last batch was handed over

    def asking(self, now: float) -> None:
        """The training loop asked for a batch at ``now`` (seconds on one clock, e.g. perf_counter)."""
        if self._first_ask is None:
            self._first_ask = now

    def waited(self, seconds: float, batch: Any, now: float, samples: int | None = None) -> None:
        """A batch of ``samples`` samples (None: counted from its ``index``) was handed over at
        ``now`` after the loop waited ``seconds`` for it."""
        with self._lock:
            self.batches += 1
            if samples is None:  # the length of its index tensor (0 for a batch without one)
                index = batch.get("index") if isinstance(batch, dict) else None
                samples = int(index.shape[0]) if index is not None and getattr(index, "ndim", 0) else 0
            self.samples += samples
            self.wait_seconds += seconds
            self._waits.append(seconds)
            self._last_handed = now

    def count(self, name: str, n: int = 1) -> None:
        """Add ``n`` to one of ``COUNTERS``."""
        if name not in COUNTERS:
            raise ValueError(f"unknown loader counter {name!r}; known: {COUNTERS}")
        with self._lock:
            self._counters[name] += n

    def received(self, raw: Any, nbytes: int) -> None:
        """A batch came (``raw``: its WireBatch; any link's thread): over shared memory its tensors'
        bytes in the slot count, over the socket data plane or inline the ``nbytes`` received."""
        if raw.segment:
            transport, nbytes = "shm", sum(fields.nbytes(t) for t in raw.tensors)
        else:
            transport = "socket" if raw.payload is not None else "inline"
        with self._lock:
            self._received[transport] += nbytes

    def waits(self) -> np.ndarray:
        """The recent per-batch waits, oldest first: float64 [<= window], seconds."""
        with self._lock:
            return np.fromiter(self._waits, dtype=np.float64, count=len(self._waits))

    def snapshot(self, batches_per_server: dict[str, int], servers: list[dict[str, Any]] = ()) -> dict[str, Any]:
        """The figures as a plain dict (module docstring); ``servers``: the loader's
        ``server_stats()`` entries."""
        waits = self.waits()
        p50, p95, p99 = (float(v) for v in np.percentile(waits, (50, 95, 99))) if len(waits) else (0.0, 0.0, 0.0)
        with self._lock:
            wall = (self._last_handed - self._first_ask) if self._last_handed is not None else 0.0
            return {
                "batches": self.batches, "samples": self.samples,
                "wait_seconds": self.wait_seconds, "wait_p50_seconds": p50, "wait_p95_seconds": p95,
                "wait_p99_seconds": p99, "wall_seconds": wall,
                "wait_fraction": min(1.0, self.wait_seconds / wall) if wall > 0 else 0.0,
                "batches_per_server": dict(batches_per_server),
                "servers": {s["address"]: {k: s[k] for k in _SERVER_KEYS if k in s} for s in servers},
                "bytes_received": dict(self._received),
                **{name: self._counters[name] for name in COUNTERS},
            }

