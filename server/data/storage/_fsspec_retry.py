"""Retries for the reads that stay on fsspec's HTTP filesystem (presigned URLs, user info).

fsspec's ``HTTPFileSystem`` has timeouts but no retries, and obstore's ``HTTPStore`` cannot carry a
URL's query string or user info, so presigned URLs (``?X-Amz-Signature=...``, ``?token=...``) are
read through fsspec. This wraps those calls in tenacity (a retry library, not a loop of ours) with
the policy of the obstore paths (``_obstore.ObstoreS3``): exponential backoff with full jitter
from 200 ms, capped at 15 s a wait, up to ``max_attempts`` attempts and at most
``max(60, 4 * timeout_s)`` seconds in all; retried: HTTP 408, 429 and 5xx answers, connection errors
and timeouts. A 404 (FileNotFoundError) and other 4xx answers are not retried.
"""

from __future__ import annotations

import asyncio
from typing import Callable, TypeVar

import tenacity

T = TypeVar("T")
_RETRIED_STATUS = frozenset({408, 429})


def transient(e: BaseException) -> bool:
    """True for an error worth another attempt: HTTP 408/429/5xx, a dropped connection, a timeout."""
    if isinstance(e, FileNotFoundError):
        return False
    try:
        import aiohttp
    except ImportError:  # fsspec's HTTP filesystem needs it; without it nothing was sent
        return False
    if isinstance(e, aiohttp.ClientResponseError):
        return e.status in _RETRIED_STATUS or e.status >= 500
    return isinstance(e, (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
                          TimeoutError, ConnectionError))


def call(fn: Callable[[], T], *, max_attempts: int, timeout_s: float) -> T:
    """``fn()``, retried as the module doc says; raises what the last attempt raised."""
    retrying = tenacity.Retrying(
        retry=tenacity.retry_if_exception(transient),
        wait=tenacity.wait_random_exponential(multiplier=0.2, max=15.0),
        stop=tenacity.stop_after_attempt(max_attempts) | tenacity.stop_after_delay(max(60.0, 4 * timeout_s)),
        reraise=True,
    )
    return retrying(fn)


__all__ = ["call", "transient"]
