"""The weight vectors a server holds for weighted sampling, by digest: ``WeightsStore``.

A loader with ``batchd.WeightedRandomSampler(weights, ...)`` sends its weights once per server
process (PutWeights, in chunks that each fit ``max_request_bytes``) and names them by digest
(``batchd.sampler.weights_digest``) in every request afterwards: a million weights are 8 MB, sent
once instead of once per epoch. Requests that name weights the store does not hold are refused
(``WeightsNotFoundError``, FAILED_PRECONDITION "WeightsNotFound" on the wire) and the client sends
them again (after a server restart, or once the store dropped them).

Memory: the store holds at most ``max_bytes`` of uploaded weights, dropping those used least
recently first (a computation keeps its own draw, so a running stream never needs them again);
a dataset's own weights (a manifest's ``weight_column``, a python dataset's ``weights``) are
pinned and not counted. Every upload is checked before it is kept: the count is bounded before
anything is allocated, the bytes must be what the count says, the digest must match, and every
weight finite and non-negative, not all zero (``batchd.sampler.check_weights``).
"""

from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from batchd.errors import ResourceExhaustedError
from batchd.sampler import check_weights, weights_digest


class WeightsNotFoundError(LookupError):
    """A request named weights (by digest) this server does not hold: the client sends them again."""

    def __init__(self, digest: str):
        super().__init__(f"this server does not hold the weights {digest[:16]}... (it restarted, or dropped them "
                         "to stay within max_weights_bytes): send them again (PutWeights)")
        self.digest = digest


@dataclass(frozen=True, slots=True)
class Weights:
    """A checked weight vector: float64 [n] (read-only), its digest, and how many are non-zero."""

    values: np.ndarray
    digest: str
    nonzero: int


def make_weights(values, what: str = "weights") -> Weights:
    """Check ``values`` (``check_weights``: ValueError naming ``what`` and the first bad entry) and
    name them by digest."""
    w = check_weights(values, what).copy()
    w.flags.writeable = False
    return Weights(w, weights_digest(w), int(np.count_nonzero(w)))


class WeightsStore:
    """Weight vectors by digest: uploaded ones (at most ``max_bytes``, least recently used dropped
    first) and pinned ones (datasets' own). Thread-safe."""

    def __init__(self, max_bytes: int):
        self.max_bytes = int(max_bytes)
        self._lock = threading.Lock()
        self._uploaded: collections.OrderedDict[str, Weights] = collections.OrderedDict()
        self._pinned: dict[str, Weights] = {}
        self._bytes = 0

    def pin(self, weights: Weights) -> None:
        """Hold ``weights`` for the server's life (a dataset's own)."""
        with self._lock:
            self._pinned[weights.digest] = weights

    def get(self, digest: str) -> Weights:
        """The weights named ``digest``. Raises WeightsNotFoundError."""
        with self._lock:
            w = self._pinned.get(digest)
            if w is not None:
                return w
            w = self._uploaded.get(digest)
            if w is None:
                raise WeightsNotFoundError(digest)
            self._uploaded.move_to_end(digest)
            return w

    def __contains__(self, digest: str) -> bool:
        with self._lock:
            return digest in self._pinned or digest in self._uploaded

    @property
    def bytes(self) -> int:
        """Bytes of uploaded weights held now."""
        with self._lock:
            return self._bytes

    def put(self, chunks: Iterable) -> Weights:
        """Receive one upload: ``chunks`` are ``WeightsChunk`` messages (the first names the digest and
        the count). Returns the weights, now held (already held: kept as they are).

        Raises ValueError (INVALID_ARGUMENT) for a malformed upload (no or a bad digest, bytes that
        are not the count's, a digest that does not match), for bad weights (naming the first);
        ResourceExhaustedError for more than ``max_bytes``. Nothing is kept then.
        """
        it = iter(chunks)
        first = next(it, None)
        if first is None:
            raise ValueError("PutWeights: no chunk came (the first names the digest and the count)")
        digest, n = first.digest, first.num_weights
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            raise ValueError(f"PutWeights: digest must be 64 lower-case hex digits (SHA-256), got {digest[:80]!r}")
        if n < 1:
            raise ValueError(f"PutWeights: num_weights must be >= 1, got {n}")
        if 8 * n > self.max_bytes:
            raise ResourceExhaustedError(
                f"PutWeights: {n} weights ({8 * n} bytes) are more than this server holds (max_weights_bytes="
                f"{self.max_bytes}); raise it in the server's config")
        if digest in self:
            for _ in it:  # (the client sends them all anyway: read them off the call)
                pass
            return self.get(digest)
        buf = np.empty(n, "<f8")
        raw = buf.view(np.uint8)
        at = _fill(raw, 0, first.weights)
        for chunk in it:
            if chunk.digest or chunk.num_weights:
                raise ValueError("PutWeights: only the first chunk names the digest and the count")
            at = _fill(raw, at, chunk.weights)
        if at != raw.nbytes:
            raise ValueError(f"PutWeights: {at} bytes came for {n} weights ({raw.nbytes} bytes)")
        got = weights_digest(buf)
        if got != digest:
            raise ValueError(f"PutWeights: the weights' digest is {got}, not {digest} as named")
        weights = make_weights(buf)
        with self._lock:
            if digest not in self._uploaded:
                self._uploaded[digest] = weights
                self._bytes += weights.values.nbytes
            while self._bytes > self.max_bytes and len(self._uploaded) > 1:
                _, dropped = self._uploaded.popitem(last=False)
                self._bytes -= dropped.values.nbytes
        return weights


def _fill(raw: np.ndarray, at: int, data: bytes) -> int:
    """Copy ``data`` into ``raw`` at byte ``at``; the new end. Raises ValueError past the end or for
    bytes that are not whole weights."""
    if len(data) % 8:
        raise ValueError(f"PutWeights: a chunk of {len(data)} bytes is not a whole number of float64 weights")
    end = at + len(data)
    if end > raw.nbytes:
        raise ValueError(f"PutWeights: more bytes came than the {raw.nbytes // 8} weights named")
    raw[at:end] = np.frombuffer(data, np.uint8)
    return end
