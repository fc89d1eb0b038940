"""One server feeding a loader: ``SingleServerLoader``, what ``RemoteDataLoader`` reads through
when ``address`` names one server (``batchd.client.multi`` is the several-servers counterpart).

The iteration itself is the same ``batchd.client.feed`` as with several servers, with n = 1; this
module adds the one-server failure policy: a broken call is resumed within ``reconnect_timeout``
seconds, after which the iteration raises ConnectionError.
"""

from __future__ import annotations

from typing import Any, Iterator

from batchd import errors
from batchd.client.transport.connection import ServerConnection
from batchd.client.transport.datasets import DatasetInfo
from batchd.client.feed import Feed, iterate
from batchd.client.loader.stats import LoaderStats
from batchd.client.membership import _Server
from batchd.client.loader.options import LoaderOptions


class SingleServerLoader:
    """The batches of one server, through one ``Batches`` call per iteration (the same
    ``batchd.client.feed`` as several servers, with n = 1), resumed across a broken call (server
    restart, lost connection) within ``options.reconnect_timeout`` seconds. Built by
    ``RemoteDataLoader``."""

    single = True
    budget = None  # (no hedging with one server)

    def __init__(self, address: str, options: LoaderOptions, transfer: Any = None, stats: LoaderStats | None = None,
                 assignment: str = "dynamic"):
        self.options = options
        self.address = address
        self.assignment = assignment
        self._transfer = transfer
        self.loader_stats = stats if stats is not None else LoaderStats()
        self.server = _Server(address, ServerConnection(address, options, transfer), up=True)
        self._feed: Feed | None = None
        self._last_figures: dict = {}
        self._closed = False

    @property
    def connection(self) -> ServerConnection:
        return self.server.conn

    @property
    def info(self) -> DatasetInfo:
        return self.server.conn.info

    @property
    def addresses(self) -> list[str]:
        return [self.address]

    @property
    def _shm(self):
        return self.server.conn._shm

    def close(self) -> None:
        self._closed = True
        feed = self._feed
        if feed is not None:
            feed.close()
        self.server.conn.close()

    # --- the failure policy of a feed (batchd.client.feed.Owner) ------------------------------------

    def reconnect_window(self) -> float:
        return max(0.0, self.options.reconnect_timeout)

    def lane_down(self, server: Any, error: BaseException, epoch: int, batch: int) -> BaseException | None:
        """The server is given up: the iteration raises ``error`` (a ConnectionError after
        ``reconnect_timeout`` seconds says so)."""
        timeout = self.options.reconnect_timeout
        if isinstance(error, ConnectionError) and timeout > 0:
            return errors.ConnectionError(f"lost the stream from {self.address} at epoch {epoch}, batch {batch}, and "
                                          f"could not resume within reconnect_timeout={timeout:g} s: {error}")
        return error

    def wait_for_any(self, feed: Any, epoch: int, batch: int) -> BaseException | None:
        return errors.ConnectionError(f"lost the stream from {self.address} at epoch {epoch}, batch {batch}")

    def server_stats(self) -> list[dict[str, Any]]:
        """As ``MultiServerLoader.server_stats``, for the one server."""
        feed = self._feed
        figures = feed.figures() if feed is not None and not feed.closed else self._last_figures
        f = figures.get(self.server, {})
        s = self.server
        return [{"address": s.address, "up": True, "retired": False, "batches": s.batches, "error": s.error,
                 "share": 1.0 if f.get("batches") else 0.0, "window": f.get("window", 0),
                 "rate": f.get("rate", s.pace.rate), "stalled": False, "hedges_issued": 0, "hedges_won": 0,
                 "hedges_wasted": 0}]

    def batches(self, epoch: int, start_batch: int, total: int, start_position: int = 0) -> Iterator[Any]:
        """Batches start_batch .. total - 1 of ``epoch`` (its remainder from global position
        ``start_position``), in order."""
        if self._closed or self.server.conn.closed:
            raise RuntimeError("the loader is closed")
        old = self._feed
        if old is not None:  # a previous iteration was abandoned: one at a time
            old.close()
        yield from iterate(self, Feed(self, [self.server], epoch, start_batch, total, start_position))
