"""The servers of a several-servers loader: who they are, which answer, and who joins or leaves.

``ServerSet`` is the part of ``MultiServerLoader`` (``batchd.client.multi``) that keeps its
``_Server`` list: it opens them at construction, checks that they serve the same dataset (size,
fingerprints), and runs the prober: every ``probe_interval`` seconds a background thread reads
the address again (``batchd.client.addresses.AddressSource``: DNS names resolved anew, a
``file:`` list re-read when it changed), adds the servers that appear, retires those no longer
named, and tries every server that is down. A server that answers (a fresh channel, the
dataset described, health SERVING, the same size and fingerprints) sets ``_rejoined``; a
retired one that was up sets ``_retired``; the loader splits the epoch again on either.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from batchd.client.connection import ServerConnection
from batchd.client.datasets import difference, mismatches

log = logging.getLogger("batchd.client.multi")

PROBE_CONNECT_S = 2.0  # connect timeout of one probe


@dataclass(eq=False)
class _Server:
    address: str
    conn: ServerConnection | None = None  # channel, shared memory, streams
    up: bool = False
    error: str = ""
    batches: int = 0  # batches delivered from this server (all iterations)
    failing_since: float | None = None  # first failure of a run of failures (reconnect window)
    retired: bool = False  # no longer named by the address: gets no work, is not probed


class ServerSet:
    """The servers and the prober of a ``MultiServerLoader``, which sets ``options``, ``_source``,
    ``_address_source``, ``_lock``, ``_probe_lock``, ``_closed``, ``_servers``, ``_split``,
    ``_next_split``, ``_rejoined``, ``_retired`` and ``_stop_probing``, and calls ``_open_all``
    then ``start_probing``."""

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server: address, up, retired (no longer named by the address), batches delivered
        from it (hedges it won included), last error."""
        with self._lock:
            return [{"address": s.address, "up": s.up, "retired": s.retired, "batches": s.batches, "error": s.error}
                    for s in self._servers]

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
            raise ConnectionError("no batchd server answered at any of " + ", ".join(self.addresses) + ": "
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
            old, server.conn, server.up, server.error, server.failing_since = server.conn, fresh, True, "", None
            self._rejoined.set()
        log.info("batchd server %s is up; it gets work from the next batch", server.address)
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
        longer named retire (a split without them starts at the next batch), and come back if
        named again."""
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
                        self._retired.set()

    def _let_go_of_retired(self) -> None:
        """Close the connections of retired servers that no split reads any more (a job that
        outlives many replicas keeps no channel to those gone); named again, they are probed
        afresh."""
        reading = {id(s) for split in (self._split, self._next_split) if split is not None for s in split.servers}
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
        if server.conn is not None:
            server.conn.stop_stream()

    def _working(self) -> list[_Server]:
        """The servers a new split uses: up and still named by the address."""
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
