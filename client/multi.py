"""Several batchd servers feeding one loader (``RemoteDataLoader`` given several addresses).

The rule. Batch b of an epoch is a pure function of the request and b, whichever server builds
it, so the loader hands batch indices out as the servers have room for them and puts the
batches back in order: each server has one ``Batches`` call per iteration, and the assigner
(``batchd.client.assign``) grants the next batch index to the server with room in its window
that will finish it soonest (or to its home server, the same in every loader, when that is
nearly as soon: ``batchd.client.assign``); every window is sized to the server's measured rate.
A fast server gets more batches, a slow one fewer, and the loop still gets batch b, b + 1, ...
once each, with the bytes one server would give. ``state_dict``/``load_state_dict``, ``len`` and ``set_epoch``
mean what they mean with one server. The iteration itself (lane threads, the reorder buffer,
the converter) is ``batchd.client.feed``; hedging is the assigner's (``batchd.client.lateness``).

Failures, joins, leaves:

* a server whose call breaks (ConnectionError) keeps its grants while it reconnects, for up to
  ``failover_timeout`` seconds (at most ``reconnect_timeout``); one that does not come back, that
  comes back serving other data (the server refuses the call's expected size or fingerprints, or
  its new id's description differs: ``ServerConnection.check_unchanged``; named in its
  ``server_stats`` error), or that sends nothing for ``timeout`` seconds while others do, is
  marked down and its batches in flight go to the others at once (``failovers`` counts it);
* a server joins: the prober (``batchd.client.membership``) tries every down server every
  ``probe_interval`` seconds and reads the address again (``AddressSource``: a DNS name resolved
  anew, a ``file:`` list re-read when it changed). One that answers (health SERVING, the same
  dataset size and fingerprints) is given batches as it has room, from the next one not granted;
* a server leaves the address (no longer resolved or listed): its batches in flight go to the
  others at once (a server that stops is a failure, above).

Hedged grants (``batchd.client.hedge``): a batch late compared with the healthy servers' pace is
also granted to another server, within a budget; the first copy is used.

With no server left, the loader keeps trying all of them for ``reconnect_timeout`` seconds and
then raises ConnectionError. Each server has its own ``ServerConnection`` (channel,
shared-memory session; ``transport="auto"`` picks shared memory per server: on for a same-host
sidecar, inline for the others); all share the loader's options (the device resolved in the
caller's thread) and its ``CudaTransfer``.

``assignment="stride"`` (semi-public, for ``bench/tables/table_fullspeed.py``'s comparison only): the old
static split, server i of n granted exactly the batches b with ``(b - start) % n == i``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Iterator

import torch

from batchd import errors
from batchd.client.transport.addresses import AddressSource, may_grow, server_addresses
from batchd.client.assign import MODES
from batchd.client.feed import Feed, iterate
from batchd.client.hedge import Budget
from batchd.client.loader.stats import LoaderStats
from batchd.client.membership import PROBE_CONNECT_S, ServerSet, _Server
from batchd.client.loader.options import LoaderOptions
from batchd.client.single import SingleServerLoader

log = logging.getLogger(__name__)


def open_servers(address: Any, options: LoaderOptions, transfer: Any, stats: LoaderStats,
                 assignment: str = "dynamic") -> "SingleServerLoader | MultiServerLoader":
    """What a ``RemoteDataLoader`` reads through for ``address``: a ``SingleServerLoader`` for one
    server, a ``MultiServerLoader`` for several or for an address that may name more later (a
    ``dns:///`` name, a ``file:`` list; ``batchd.client.transport.addresses``). Raises as they do."""
    addresses = server_addresses(address)
    if len(addresses) == 1 and not may_grow(address):
        return SingleServerLoader(addresses[0], options, transfer, stats)
    # names as IP:PORT, as the prober will see them when it resolves them again
    addresses = server_addresses(address, keep_single_name=False)
    return MultiServerLoader(address, addresses, options, transfer, stats, assignment=assignment)


class MultiServerLoader(ServerSet):
    """The batches of several servers (see the module docstring); built by ``RemoteDataLoader``
    when ``address`` names several servers (a list, or a DNS name with several addresses; see
    ``batchd.client.transport.addresses``), which reads through it (``loader.servers``).

    At least one server must answer at construction; the others are probed later. Raises
    ValueError if the servers disagree on the dataset's size, or (``strict``, the default) on
    its dataset or build fingerprint, naming the servers and what differs; a server that
    rejoins later (probed) or comes back after a broken call (reconnected) with another
    dataset size, or other fingerprints, is left out (``difference``, the same check both ways)
    and the others take its batches. ``strict=False`` accepts other fingerprints.
    ``assignment``: "dynamic" (default) or "stride" (module docstring).
    """

    single = False

    def __init__(self, source: Any, addresses: list[str], options: LoaderOptions, transfer: Any = None,
                 stats: LoaderStats | None = None, assignment: str = "dynamic"):
        if assignment not in MODES:
            raise ValueError(f"assignment must be one of {MODES}, got {assignment!r}")
        self._source = source
        self._address_source = AddressSource(source)
        self.options = options
        self._transfer = transfer
        self.loader_stats = stats if stats is not None else LoaderStats()
        self.assignment = assignment
        self.budget = Budget(options.hedge) if options.hedge is not None else None
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one probe round at a time (prober thread or a failover)
        self._closed = False
        self._feed: Feed | None = None
        self._last_figures: dict = {}
        self._stop_probing = threading.Event()
        self._servers = [_Server(a) for a in addresses]
        self.info = self._open_all()[0].conn.info
        self.address = source if isinstance(source, str) else ",".join(addresses)
        sizes = {s.address: s.conn.info.num_samples for s in self._servers if s.up}
        if len(set(sizes.values())) > 1:
            self.close()
            raise ValueError(f"the servers disagree on the size of dataset {options.dataset!r}: {sizes}")
        self._check_fingerprints([s for s in self._servers if s.up])
        self.start_probing()

    # --- the failure policy of a feed (batchd.client.feed.Owner) ------------------------------------

    def reconnect_window(self) -> float:
        o = self.options
        return min(o.failover_timeout, o.reconnect_timeout) if o.reconnect_timeout > 0 else 0.0

    def lane_down(self, server: _Server, error: BaseException, epoch: int, batch: int) -> BaseException | None:
        """``server`` is given up: marked down (the prober tries it again later), its batches go
        to the others."""
        self._mark_down(server, error)
        self.loader_stats.count("failovers")
        log.warning("batchd server %s failed at epoch %d, batch %d (%s); the other servers take its batches",
                    server.address, epoch, batch, error)
        return None

    def wait_for_any(self, feed: Feed, epoch: int, batch: int) -> BaseException | None:
        """No server is left in ``feed``: probe them all for ``reconnect_timeout`` seconds (one that
        answers joins the feed: None), else the ConnectionError to raise."""
        since = feed.all_down_since or time.monotonic()
        deadline = since + max(0.0, self.options.reconnect_timeout)
        while not self._closed and not feed.stopping.is_set():
            self._probe_down()
            if feed.servers:
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            feed.stopping.wait(min(0.5, remaining))
        if self._closed or feed.stopping.is_set():
            return RuntimeError("the loader is closed")
        why = "; ".join(f"{s.address}: {s.error}" for s in self._servers if s.error)
        return errors.ConnectionError(
            f"lost every batchd server ({', '.join(self.addresses)}) at epoch {epoch}, batch {batch}, and none came "
            f"back within reconnect_timeout={self.options.reconnect_timeout:g} s ({why or 'no answer'})")

    # --- iteration -----------------------------------------------------------------------------

    def batches(self, epoch: int, start_batch: int, total: int, start_position: int = 0
                ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches start_batch .. total - 1 of ``epoch`` (its remainder from global position
        ``start_position``), in order, from the servers that are up."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        old = self._feed
        if old is not None:  # a previous iteration was abandoned: one at a time
            old.close()
        servers = self._working()
        feed = Feed(self, servers, epoch, start_batch, total, start_position)
        if not servers:
            feed.mark_all_down()
        yield from iterate(self, feed)

    def close(self) -> None:
        """Cancel the calls, stop probing, close every server's channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_probing.set()
        feed = self._feed
        if feed is not None:
            feed.close()
        for s in self._servers:
            if s.conn is not None:
                s.conn.close()
        prober = getattr(self, "_prober", None)
        if prober is not None and prober is not threading.current_thread():
            prober.join(PROBE_CONNECT_S + 1.0)
