"""The servers of a several-servers loader: who they are, which answer, and who joins or leaves.

``ServerSet`` is the part of ``MultiServerLoader`` (``batchd.client.multi``) that keeps its
``_Server`` list: it opens them at construction, checks that they serve the same dataset (size,
fingerprints), and runs the prober: every ``probe_interval`` seconds a background thread reads
the address again (``batchd.client.transport.addresses.AddressSource``: DNS names resolved anew, a
``file:`` list re-read when it changed), adds the servers that appear, retires those no longer
named, and tries every server that is down. A server that answers (a fresh channel, the
dataset described, health SERVING, the same size and fingerprints) joins the iteration in
progress (``Feed.add_server``: it is granted batches as it has room); a retired one leaves it
(``Feed.retire``: its grants go to the others at once).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

from batchd import errors
from batchd.client.transport.connection import ServerConnection
from batchd.client.transport.datasets import difference, mismatches
from batchd.client.pace import Pace

log = logging.getLogger("batchd.client.multi")

PROBE_CONNECT_S = 2.0  # connect timeout of one probe


@dataclass(eq=False)
class _Server:
    address: str
    conn: ServerConnection | None = None  # channel, shared memory, calls
    up: bool = False
    error: str = ""
    batches: int = 0  # batches yielded that this server sent first (all iterations)
    retired: bool = False  # no longer named by the address: gets no work, is not probed
    pace: Pace = field(default_factory=Pace)  # its rate and latencies (batchd.client.pace)
    hedges_issued: int = 0  # hedged grants it was given, and of those, won and wasted (ended iterations)
    hedges_won: int = 0
    hedges_wasted: int = 0


class ServerSet:
    """The servers and the prober of a ``MultiServerLoader``, which sets ``options``, ``_source``,
    ``_address_source``, ``_lock``, ``_probe_lock``, ``_closed``, ``_servers``, ``_feed`` (the
    iteration in progress, a ``batchd.client.feed.Feed``, or None) and ``_stop_probing``, and
    calls ``_open_all`` then ``start_probing``."""

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server: address, up, retired (no longer named by the address), ``batches`` yielded
        that it sent first (all iterations; hedges it won included), last ``error``, and from the
        iteration in progress (else the last one): ``share`` of that epoch's batches it sent
        (0..1), ``window`` (grants it may hold), ``rate`` (batches/s), ``stalled``; and its
        ``hedges_issued`` / ``hedges_won`` / ``hedges_wasted`` (all iterations)."""
        figures = self._epoch_figures()
        sent = sum(f["batches"] for f in figures.values()) or 1
        with self._lock:
            servers = list(self._servers)
        out = []
        for s in servers:
            f = figures.get(s, {})
            out.append({"address": s.address, "up": s.up, "retired": s.retired, "batches": s.batches,
                        "error": s.error, "share": f.get("batches", 0) / sent, "window": f.get("window", 0),
                        "rate": f.get("rate", s.pace.rate), "stalled": f.get("stalled", False),
                        "hedges_issued": s.hedges_issued + f.get("hedges_issued", 0),
                        "hedges_won": s.hedges_won + f.get("hedges_won", 0),
                        "hedges_wasted": s.hedges_wasted + f.get("hedges_wasted", 0)})
        return out

    def _epoch_figures(self) -> dict[Any, dict[str, Any]]:
        """The assigner's figures of the iteration in progress (its counters not yet folded into
        the servers' totals), else the last one's batches and windows."""
        feed = self._feed
        if feed is not None and not feed.closed:
            return feed.figures()
        return {s: {k: v for k, v in f.items() if not k.startswith("hedges_")}
                for s, f in getattr(self, "_last_figures", {}).items()}

    def _check_fingerprints(self, servers: list[_Server]) -> None:
        """Servers whose dataset or build fingerprint differ from the first's: ValueError naming
        them and what differs (strict), else a warning."""
        first = servers[0]
        differ = [f"{first.address} vs {s.address}: {'; '.join(d)}" for s in servers[1:]
                  if (d := mismatches(first.conn.info.identity(), s.conn.info.identity()))]
        if not differ:
            return
        msg = f"the servers would send different bytes for dataset {self.options.dataset!r}: " + " | ".join(differ)
        if self.options.strict:
            self.close()
            raise ValueError(msg + "; strict=False accepts them")
        log.warning("%s; mixing them anyway (strict=False)", msg)

    def _open_all(self) -> list[_Server]:
        def open_one(server: _Server) -> ServerConnection:
            return ServerConnection(server.address, self.options, self._transfer)

        with concurrent.futures.ThreadPoolExecutor(len(self._servers), thread_name_prefix="batchd-open") as pool:
            futures = {s: pool.submit(open_one, s) for s in self._servers}
        fatal: BaseException | None = None
        for s, fut in futures.items():
            try:
                s.conn, s.up = fut.result(), True
            except (ConnectionError, TimeoutError) as e:
                s.error = str(e)
            except BaseException as e:  # bad arguments, unknown dataset: the same on every server
                fatal = fatal or e
        up = [s for s in self._servers if s.up]
        if fatal is not None or not up:
            for s in up:
                s.conn.close()
            if fatal is not None:
                raise fatal
            raise errors.ConnectionError("no batchd server answered at any of " + ", ".join(self.addresses) + ": "
                                         + "; ".join(s.error for s in self._servers))
        for s in self._servers:
            if not s.up:
                log.warning("batchd server %s is unavailable (%s); it gets work once it answers", s.address, s.error)
        return up

    def _probe(self, server: _Server) -> bool:
        """Try a down server: a fresh connection (new channel and shared memory)."""
        if server.up:
            return True
        options = dataclasses.replace(self.options, connect_timeout=min(self.options.connect_timeout, PROBE_CONNECT_S))
        try:
            fresh = ServerConnection(server.address, options, self._transfer)
        except (ConnectionError, TimeoutError) as e:
            server.error = str(e)
            return False
        except Exception as e:  # the server is up but cannot serve this dataset
            if server.error != str(e):
                log.warning("batchd server %s answers but cannot serve this loader: %s", server.address, e)
            server.error = str(e)
            return False
        if not fresh.serving(options.connect_timeout):
            server.error = "its health service does not say SERVING"
            fresh.close()
            return False
        changed = difference(self.info, fresh.info)  # the check a reconnect makes (check_unchanged)
        if changed.refused(self.options.strict):
            msg = (f"dataset {self.options.dataset!r} differs there from the other servers: {changed} (the others vs "
                   f"there){'' if changed.num_samples else ' (strict=False accepts it)'}")
            if server.error != msg:
                log.warning("batchd server %s is left out: %s", server.address, msg)
            server.error = msg
            fresh.close()
            return False
        with self._lock:
            if self._closed:
                fresh.close()
                return False
            old, server.conn, server.up, server.error = server.conn, fresh, True, ""
            feed = self._feed
        log.info("batchd server %s is up; it gets work as it has room", server.address)
        if feed is not None:
            feed.add_server(server)
        if old is not None:
            t0 = time.monotonic()
            old.close()
            log.debug("closed the old channel to %s in %.2f s", server.address, time.monotonic() - t0)
        return True

    def _probe_down(self) -> None:
        """One round of the prober: new addresses of a DNS name, then every down server."""
        with self._probe_lock:
            self._probe_round()

    def _probe_round(self) -> None:  # (under _probe_lock)
        current = self._address_source.current()  # None: unknown now, or never changes
        if current is not None:
            self._follow(current)
        self._let_go_of_retired()
        down = [s for s in self._servers if not s.up and not s.retired]
        if not down or self._closed or self._stop_probing.is_set():
            return
        # in parallel: each probe may wait its whole connect timeout for a server that is gone
        with concurrent.futures.ThreadPoolExecutor(min(8, len(down)), thread_name_prefix="batchd-probe") as pool:
            list(pool.map(self._probe, down))

    def _follow(self, current: list[str]) -> None:
        """The address now names ``current``: new servers are added (probed next), those no
        longer named retire (their grants go to the others at once), and come back if named
        again."""
        retired = []
        with self._lock:
            if self._closed:
                return
            known = {s.address for s in self._servers}
            for a in current:
                if a not in known:
                    log.info("%s now also names %s", self._source, a)
                    self._servers.append(_Server(a))
            for s in self._servers:
                named = s.address in current
                if s.retired and named:
                    log.info("%s names %s again", self._source, s.address)
                    s.retired = False
                elif not s.retired and not named:
                    log.info("%s no longer names %s; it gets no more work", self._source, s.address)
                    s.retired = True
                    if s.up:
                        retired.append(s)
            feed = self._feed
        if feed is not None:
            for s in retired:
                feed.retire(s)

    def _let_go_of_retired(self) -> None:
        """Close the connections of retired servers that no iteration reads any more (a job that
        outlives many replicas keeps no channel to those gone); named again, they are probed
        afresh."""
        feed = self._feed
        reading = {id(s) for s in (feed.servers if feed is not None else ())}
        with self._lock:
            done = [s for s in self._servers if s.retired and s.conn is not None and id(s) not in reading]
            for s in done:
                s.up, s.error = False, "no longer named by the address"
            conns = [s.conn for s in done]
            for s in done:
                s.conn = None
        for conn in conns:
            conn.close()

    def _mark_down(self, server: _Server, error: BaseException) -> None:
        with self._lock:
            server.up, server.error = False, str(error)

    def _working(self) -> list[_Server]:
        """The servers a new iteration uses: up and still named by the address."""
        with self._lock:
            return [s for s in self._servers if s.up and not s.retired]

    def start_probing(self) -> None:
        self._prober = threading.Thread(target=_probe_loop, args=(weakref.ref(self), self._stop_probing),
                                        name="batchd-probe", daemon=True)
        self._prober.start()


def _probe_loop(ref: "weakref.ref[ServerSet]", stop: threading.Event) -> None:
    """Every probe_interval seconds, probe the down servers (holding the loader only meanwhile)."""
    while True:
        loader = ref()
        if loader is None:
            return
        interval = loader.options.probe_interval
        del loader
        if stop.wait(interval):
            return
        loader = ref()
        if loader is None or loader._closed:
            return
        try:
            loader._probe_down()
        except Exception:  # never die silently: log and keep probing
            log.exception("probing batchd servers failed")
        del loader
