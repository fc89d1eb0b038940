"""The servers of one loader and its passes: ``Servers``.

``RemoteDataLoader`` (the facade) reads through one ``Servers``, for one server or several: the
same code with n = 1. It opens every server the address names at once (at least one must answer;
their datasets must agree: the same size, and under ``strict`` the same fingerprints), and keeps,
for the loader's life, a link per server (``batchd.client.transport.link.ServerLink``: its
connection, its one ``Batches`` call, its thread), what each server can build
(``batchd.client.iteration.credit.Capacity``: its workers and build times, as it says) and which
was stalled at the end of the last pass. ``batches`` runs one pass (``Epoch``) at a time.

Threads: one per server (its link), one for the loader (``batchd-loader``: converting batches in
order where the consumer does not, stalls and servers silent too long, closing passes let go of),
and, for an address that may name more servers later (a ``dns:`` name, a ``file:`` list), one
that reads it again every ``probe_interval`` seconds (``batchd-addresses``): a server that
appears gets a link and joins the pass in progress; one no longer named leaves it (its batches go
to the others) and its link closes. gRPC adds two of its own per server (the channel's and the
call's request iterator's).
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from typing import Any, Iterator

from batchd import errors
from batchd.client import forks
from batchd.client.iteration.credit import Capacity
from batchd.client.iteration.epoch import Epoch
from batchd.client.transport.addresses import AddressSource, may_grow, server_addresses
from batchd.client.transport.connection import ServerConnection
from batchd.client.transport.datasets import mismatches
from batchd.client.transport.link import ServerLink

log = logging.getLogger("batchd.client.loader")

_CLOSE_GRACE_S = 1.0  # close(): a call told `done` that has not ended by then is cancelled (seconds)
_SWEEP_S = 0.5  # how often idle mappings of unlinked shared-memory segments are looked for (seconds)


class Servers:
    """The servers of a loader (module docstring). ``options``: its ``LoaderOptions``;
    ``transfer``: its ``CudaTransfer`` (None for CPU batches); ``stats``: its ``LoaderStats``.

    Raises (at construction) ConnectionError if no server answers within ``connect_timeout``,
    ValueError if the servers disagree on the dataset's size, or (``strict``) on its dataset or
    build fingerprints, naming them and what differs; and what a server's first description
    raises (DatasetNotFoundError, AuthenticationError, ...).
    """

    def __init__(self, address: Any, options: Any, transfer: Any, stats: Any):
        self.options = options
        self.transfer = transfer
        self.stats = stats
        self.single = len(server_addresses(address)) == 1 and not may_grow(address)
        names = server_addresses(address, keep_single_name=self.single)
        self.address = address if isinstance(address, str) else ",".join(names)
        self._lock = threading.Lock()
        self._warned: set = set()  # what was said once per loader (shared by its links)
        self._capacity: dict[Any, Capacity] = {}
        self._pass: Epoch | None = None  # the pass not closed yet (one at a time)
        self._last_figures: dict = {}  # the last pass closed: its Credit.figures (who was stalled, ...)
        self._last_finished = True  # the last pass closed had every batch taken
        self._swept = 0.0
        self._events: queue.SimpleQueue = queue.SimpleQueue()  # wakes the loader's thread (no lock: finalizers)
        self._closed = False
        self._stop = threading.Event()  # set by close: the address follower stops
        self._owner = forks.owner()
        conns = self._open_all(names)
        self._info = next(c for c in conns.values() if c is not None).info
        self.links: list[ServerLink] = [
            ServerLink(a, options, transfer, reference=self._info, conn=conns[a], count=stats.count,
                       warned=self._warned) for a in names]
        for link in self.links:
            if link.conn is None:
                log.warning("batchd server %s is unavailable (%s); it gets batches once it answers", link.address,
                            link.error)
        self._thread = threading.Thread(target=_run, args=(weakref.ref(self), self._events), name="batchd-loader",
                                        daemon=True)
        self._thread.start()
        source = AddressSource(address)
        if not self.single and source.changes:
            threading.Thread(target=_follow, args=(weakref.ref(self), source, self._stop),
                             name="batchd-addresses", daemon=True).start()

    # --- construction ------------------------------------------------------------------------------

    def _open_all(self, names: list[str]) -> dict[str, ServerConnection | None]:
        """A connection to every server at once: None for those that did not answer; the servers
        that answered agree on the dataset (``_check``), or every connection is closed."""
        with concurrent.futures.ThreadPoolExecutor(len(names), thread_name_prefix="batchd-open") as pool:
            futures = {a: pool.submit(ServerConnection, a, self.options, self.transfer, warned=self._warned)
                       for a in names}
        conns: dict[str, ServerConnection | None] = {}
        errors_seen: dict[str, str] = {}
        fatal: BaseException | None = None
        for a, fut in futures.items():
            try:
                conns[a] = fut.result()
            except (ConnectionError, TimeoutError) as e:
                conns[a], errors_seen[a] = None, str(e)
            except BaseException as e:  # bad arguments, unknown dataset: the same on every server
                conns[a], fatal = None, fatal or e
        up = {a: c for a, c in conns.items() if c is not None}
        try:
            if fatal is not None:
                raise fatal
            if not up and self.single:
                raise next(fut.exception() for fut in futures.values())
            if not up:
                raise errors.ConnectionError("no batchd server answered at any of " + ", ".join(names) + ": "
                                             + "; ".join(errors_seen.values()))
            self._check(up)
        except BaseException:
            for c in up.values():
                c.close()
            raise
        return conns

    def _check(self, up: dict[str, ServerConnection]) -> None:
        """The servers that answered (``up``) agree on the dataset (class docstring)."""
        sizes = {a: c.info.num_samples for a, c in up.items()}
        if len(set(sizes.values())) > 1:
            raise ValueError(f"the servers disagree on the size of dataset {self.options.dataset!r}: {sizes}")
        first, *others = up.items()
        differ = [f"{first[0]} vs {a}: {'; '.join(d)}" for a, c in others
                  if (d := mismatches(first[1].info.identity(), c.info.identity()))]
        if differ:
            msg = (f"the servers would send different bytes for dataset {self.options.dataset!r}: "
                   + " | ".join(differ))
            if self.options.strict:
                raise ValueError(msg + "; strict=False accepts them")
            log.warning("%s; mixing them anyway (strict=False)", msg)

    # --- what passes and links ask -----------------------------------------------------------------

    @property
    def info(self) -> Any:
        """The dataset the loader reads (``DatasetInfo``): with one server, as described last
        (another after a restart, under strict=False); with several, the first one's."""
        if self.single:
            conn = self.links[0].conn
            if conn is not None:
                return conn.info
        return self._info

    @property
    def addresses(self) -> list[str]:
        return [link.address for link in self.links]

    def capacity(self, link: Any) -> Capacity:
        """What ``link``'s server can build (kept across passes)."""
        with self._lock:
            return self._capacity.setdefault(link, Capacity())

    def was_stalled(self, link: Any) -> bool:
        """Whether ``link``'s server was stalled at the end of the last pass."""
        with self._lock:
            return self._last_figures.get(link, {}).get("stalled", False)

    def wake(self) -> None:
        """Wake the loader's thread (no lock: safe in a finalizer)."""
        self._events.put(None)

    def passed(self, pass_: Epoch, figures: dict) -> None:
        """``pass_`` closed: remember its ``figures`` (``Credit.figures``: who was stalled, ...); its
        links let go of it."""
        with self._lock:
            self._last_figures = figures
            self._last_finished = pass_.finished
            if self._pass is pass_:
                self._pass = None
            links = list(self.links)
        for link in links:  # (a closed pass is not kept alive by its links: its error, its batches)
            link.let_go(pass_)

    # --- a pass ------------------------------------------------------------------------------------

    def batches(self, epoch: int, start: int, total: int, start_position: int = 0) -> Iterator[Any]:
        """Batches start .. total - 1 of ``epoch`` (its remainder from global position
        ``start_position``), in order, from every server that is up (``Epoch``)."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        old = self.current()
        if old is not None:  # (one pass at a time: an earlier one was let go of)
            old.close()
        pass_ = Epoch(self, epoch, start, total, start_position)
        with self._lock:
            self._pass = pass_
            links = [link for link in self.links if not link.retired]
        pass_.links_up([(link, seq) for link in links if (seq := link.serve(pass_)) is not None])
        if not any(link.conn is not None for link in links):
            pass_.link_down_all()
        self.wake()
        return pass_.batches()

    def current(self) -> Epoch | None:
        with self._lock:
            return self._pass

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server: ``address``, ``up`` (its call is open), ``retired`` (no longer named by the
        address), ``batches`` (yielded that it sent first, all passes), ``error`` (its last),
        and from the pass in progress (else the last): ``share`` of its batches it sent first
        (0..1), ``credit`` (grants it may hold), ``stalled``, ``stalls``, ``regranted`` (its
        batches granted to another server after it stalled or broke), ``duplicates`` (copies
        that came after another's), ``workers`` and ``build_seconds`` (its median worker seconds
        per batch) as the server says."""
        current = self.current()
        figures = current.figures() if current is not None else self._last_figures  # (replaced, not changed)
        sent = sum(f["batches"] for f in figures.values()) or 1
        out = []
        for link in self.links:
            f = figures.get(link, {})
            cap = self.capacity(link)
            out.append({"address": link.address, "up": link.up, "retired": link.retired, "batches": link.batches,
                        "error": link.error, "share": f.get("batches", 0) / sent, "credit": f.get("credit", 0),
                        "stalled": f.get("stalled", False), "stalls": f.get("stalls", 0),
                        "regranted": f.get("regranted", 0), "duplicates": f.get("duplicates", 0),
                        "workers": cap.workers, "build_seconds": cap.build_time or 0.0})
        return out

    @property
    def shm(self) -> Any:
        """The shared-memory session of the first server (None: it does not lend); tests read it."""
        conn = self.links[0].conn
        return conn.shm if conn is not None else None

    def close(self) -> None:
        """End the pass and every call (revoked, ``done``), stop the loader's threads; each link's
        thread then releases what the caller still holds and closes its channel. Idempotent;
        nothing in a forked child (the threads and channels are the parent's)."""
        if forks.forked(self._owner):
            return
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pass_ = self._pass
        self._stop.set()
        if pass_ is not None:
            pass_.close()
        # a pass let go of or in progress: the calls are cancelled (the servers count them
        # cancelled and release what they sent that never came); else ended with `done`
        cancel = not self._last_finished
        for link in self.links:
            link.close(cancel=cancel)
        self.wake()
        deadline = time.monotonic() + _CLOSE_GRACE_S
        for link in self.links:  # (a call the server does not end, a hung server's, is cancelled)
            while link.ending() is not None and time.monotonic() < deadline:
                time.sleep(0.005)
            call = link.ending()
            if call is not None:
                call.cancel()
        if self._thread is not threading.current_thread():
            self._thread.join(1.0)

    # --- the loader's thread -------------------------------------------------------------------------

    def _service(self) -> float:
        """One round: the pass serviced (stalls, silence, closed if let go of), its next batch
        converted. Returns seconds until the next round."""
        now = time.monotonic()
        pass_ = self.current()
        wait = 0.25 if pass_ is None else min(0.25, pass_.service(now))
        if now - self._swept >= _SWEEP_S:  # segments the server unlinked since the last release
            self._swept = now
            for link in self.links:
                link.sweep()
        while pass_ is not None and not pass_.inline and pass_.convert_next():
            pass
        return wait

    def follow(self, current: list[str]) -> None:
        """The address names ``current`` now: new servers get links (and join the pass in
        progress); those no longer named leave it and their links close."""
        with self._lock:
            if self._closed:
                return
            known = {link.address: link for link in self.links if not link.retired}
            new = [a for a in current if a not in known]
            gone = [link for a, link in known.items() if a not in current]
            for link in gone:
                link.retired, link.error = True, "no longer named by the address"
            pass_ = self._pass
        for link in gone:
            log.info("%s no longer names %s; it gets no more work", self.address, link.address)
            if pass_ is not None:
                pass_.link_down(link, None)  # (not a failure: its batches go to the others)
            link.close(cancel=True)
        for a in new:
            log.info("%s now also names %s", self.address, a)
            link = ServerLink(a, self.options, self.transfer, reference=self._info, count=self.stats.count,
                              warned=self._warned)
            with self._lock:
                self.links.append(link)
            if pass_ is not None:
                seq = link.serve(pass_)
                if seq is not None:
                    pass_.links_up([(link, seq)])


def _run(ref: "weakref.ref[Servers]", events: queue.SimpleQueue) -> None:
    """The loader's thread (holds the loader only during a round, so an unreferenced loader is
    collected and its finalizers close it)."""
    wait = 0.25
    while True:
        try:
            events.get(timeout=wait)
        except queue.Empty:
            pass
        servers = ref()
        if servers is None or servers._closed:
            return
        try:
            wait = servers._service()
        except Exception:  # never die silently: log and go on
            log.exception("the batchd loader's thread failed a round")
            wait = 0.25
        del servers


def _follow(ref: "weakref.ref[Servers]", source: AddressSource, stop: threading.Event) -> None:
    """Every probe_interval seconds, read the address again (module docstring)."""
    while True:
        servers = ref()
        if servers is None or servers._closed:
            return
        interval = servers.options.probe_interval
        del servers
        if stop.wait(interval):
            return
        servers = ref()
        if servers is None or servers._closed:
            return
        try:
            current = source.current()
            if current is not None:
                servers.follow(current)
        except Exception:  # never die silently: log and keep following
            log.exception("reading the batchd servers' address again failed")
        del servers
