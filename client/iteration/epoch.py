"""One pass of a loader over an epoch's batches, from its servers, in order: ``Epoch``.

::

    each server's link (its thread reads its call) --arrived--> reorder buffer (batch -> received batch)
                                                                    |
              inline (CPU tensors as they came): the consumer converts batch b itself once it arrived;
              else the loader's thread converts in order, one ahead (the double buffer: device copy,
              gpu_transform, decode_on_client, collate_fn; ``convert_next``)
                                                                    |
                                          consumer: ``batches()`` yields b, b + 1, ... once each

The pass's state is under one lock (``_lock``; the consumer waits on ``_cond``): who holds which
grant (``Credit``, the rule: batchd.client.iteration.credit), the reorder buffer, the converted
batch, the error that ends it. Its servers' links tell it what happens (``links_up``, ``arrived``,
``link_down``, ``link_failed``, ``fail``), each from its own thread; the loader's thread
(``batchd.client.iteration.servers.Servers``) calls ``service`` now and then (stalls, servers
silent too long, all servers down for ``reconnect_timeout``, converting) and closes a pass that was
let go of (``abandon``).

* **Waits.** The consumer waits for batch b at most ``timeout`` seconds from when it asked or from
  when b was last granted, whichever is later (a failover moves the deadline), then raises
  ``batchd.TimeoutError`` naming the servers; with no server up for ``reconnect_timeout`` seconds,
  ``batchd.ConnectionError``; a server's error (a sample that cannot be read, a worker that died)
  after the batches before it; what converting raises in the batch's place. A shared-memory batch
  whose slot is gone (its server restarted) is granted again instead (``Credit.requeue``).
* **The end.** Once the last batch is taken (or on ``close``) the grants still out (a stalled
  server's probe, copies that lost) are revoked and the batches waiting are dropped, their leases
  released. A ``break``, or the iterator collected by the garbage collector in any thread, only
  marks the pass let go of (``abandon``: no lock, so a finalizer never deadlocks) and wakes the
  loader's thread, which closes it; a pass that ends late never touches the next one's batches
  (grants name their pass: ``Outbox``).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

from batchd import errors
from batchd.client.device.convert import convert, deliver, inline
from batchd.client.iteration.credit import Credit
from batchd.client.transport.progress import Progress
from batchd.client.transport.redial import FellBack

log = logging.getLogger("batchd.client.loader")

SILENT_AFTER_MIN_S = 2.0  # a stalled server silent this long (or timeout / 4, if longer) is down for the pass
_MAX_WAIT_S = 0.25  # the longest the consumer sleeps before it looks at its deadline again


@dataclass(slots=True)
class _Arrived:
    raw: Any  # the WireBatch
    link: Any
    shm: Any  # the shared-memory session it was lent on (None: not lent)
    received: float  # seconds its message took to come


class Epoch:
    """Batches ``start .. total - 1`` of ``epoch`` (its remainder from global position
    ``start_position``) from ``servers``' links (``Servers``), in order. ``batches()`` is the
    consumer's iterator."""

    def __init__(self, servers: Any, epoch: int, start: int, total: int, start_position: int = 0):
        self.servers = servers
        self.options = o = servers.options
        self.transfer = servers.transfer
        self.epoch, self.start, self.total, self.start_position = epoch, start, total, start_position
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self.credit = Credit(start, total, prefetch=o.prefetch, regrant=o.hedge)
        self._raw: dict[int, _Arrived] = {}
        self._ready: Any = None  # the next batch, converted by the loader's thread, or what that raised
        self._seqs: dict[Any, int] = {}  # link -> this pass's open_seq on its call (once up)
        self._progress: dict[Any, Progress] = {}
        self.inline = inline(o, self.transfer)
        self._converting: int | None = None  # the batch being converted (still in _raw)
        self._fatal: BaseException | None = None
        self._down_since: float | None = None  # no server has sent a batch since its call broke (None: some did)
        self.closed = False
        self.finished = False  # every batch was taken (not let go of)
        self._abandoned = False  # let go of (set without the lock: ``abandon``)
        self.stopping = threading.Event()  # set when the pass ends (a device copy is then refused)
        self.silent_after = max(SILENT_AFTER_MIN_S, o.timeout / 4)

    # --- from the links' threads ---------------------------------------------------------------------

    def where(self) -> str:
        """``epoch E, batch B``: where the pass is (the next batch the loop takes), for logs."""
        return f"epoch {self.epoch}, batch {self.credit.base}"

    def progress(self, link: Any) -> Progress:
        """What the loop took of ``link``'s batches in this pass (reported on its call)."""
        with self._lock:
            return self._progress.setdefault(link, Progress())

    def links_up(self, ups: list[tuple[Any, int]]) -> None:
        """Links' calls carry this pass (``(link, open_seq)``; several as it begins): each is granted
        what it held, then one plan (so that the first does not take what the others would build
        as soon)."""
        with self._lock:
            if self.closed or not ups:
                return
            for link, seq in ups:
                self._seqs[link] = seq
                capacity = self.servers.capacity(link)
                capacity.workers = link.workers or capacity.workers
                capacity.max_leases = link.max_leases
                capacity.leases_held = link.leases_held
                if link not in self.credit.holders:
                    self.credit.add(link, capacity, link.address, stalled=self.servers.was_stalled(link))
                if again := self.credit.opened(link):
                    link.grant(again, seq)
            self._plan()
            self._cond.notify_all()

    def link_down(self, link: Any, error: BaseException | None) -> None:
        """``link``'s call broke (it reconnects; ``error``), or its server left the address (None):
        its batches go to the others now (a failover, if they are up and it broke). With no
        server open, the pass fails once none sent a batch for ``reconnect_timeout`` seconds."""
        with self._lock:
            if self.closed:
                return
            self._seqs.pop(link, None)
            if self._seqs and error is not None:
                self.servers.stats.count("failovers")
            self.credit.closed(link)
            self._requeue_shared(link)
            if not any(h.open for h in self.credit.holders.values()) and self._down_since is None:
                self._down_since = time.monotonic()
            self._plan()
            self._cond.notify_all()
        if error is not None:  # (a fall back to inline was warned once already)
            (log.info if isinstance(error, FellBack) else log.warning)(
                "lost the stream from %s at epoch %d, batch %d (%s); its batches go to the other servers, if any, "
                "while it reconnects", link.address, self.epoch, self.credit.base, error)

    def link_down_all(self) -> None:
        """No server is connected as the pass begins: it fails unless one sends a batch within
        ``reconnect_timeout`` seconds."""
        with self._lock:
            if self._down_since is None:
                self._down_since = time.monotonic()

    def link_failed(self, link: Any, error: BaseException) -> None:
        """``link``'s server no longer serves this loader's dataset: with one server the pass ends
        with ``error``; with several, it is left out and the others take its batches."""
        with self._lock:
            if self.closed:
                return
            self._seqs.pop(link, None)
            self.credit.remove(link)
            if self.servers.single:
                self._fail(error)
            self._plan()  # (with one server, nobody is left to grant to: nothing)
            self._cond.notify_all()

    def arrived(self, link: Any, raw: Any, received: float, nbytes: int, shm: Any) -> None:
        """A batch came on ``link``'s call for this pass."""
        self.servers.stats.received(raw, nbytes)
        if raw.segment and shm is not None:
            shm.hold(raw.lease)
        keep = False
        with self._lock:
            b = raw.batch_index
            self._down_since = None  # (a server lives)
            if not self.closed and link in self._seqs:
                if not self.start <= b < self.total:
                    self._fail(RuntimeError(f"{link.address} sent batch {b}, not one of batches {self.start}.."
                                            f"{self.total - 1} of epoch {self.epoch}"))
                else:
                    t = raw.timings
                    if t is not None:
                        self.servers.capacity(link).record(
                            t.read_seconds + t.decode_seconds + t.pipeline_seconds + t.cache_seconds
                            + t.write_seconds, t.workers)
                    revoke = self.credit.arrived(link, b, nbytes)
                    keep = revoke is not None
                    if keep:
                        self._tell(revoke)
                        self._raw[b] = _Arrived(raw, link, shm, received)
                        if b == self.credit.base:
                            self._cond.notify_all()
                            if not self.inline:
                                self.servers.wake()
                    self._plan()
        if not keep:
            _release(raw, shm)

    def fail(self, error: BaseException) -> None:
        """The pass ends with ``error`` (a server's), after the batches before it that arrived."""
        with self._lock:
            self._fail(error)

    def _fail(self, error: BaseException) -> None:  # (under the lock)
        if self._fatal is None and not self.closed:
            self._fatal = error
        self._cond.notify_all()
        self.servers.wake()

    def _plan(self) -> None:  # (under the lock)
        self._tell(self.credit.plan(time.monotonic()), grant=True)

    def _tell(self, batches_of: dict[Any, list[int]], grant: bool = False) -> None:  # (under the lock)
        """Grant (or revoke) each link's batches on its call, in this pass (its ``open_seq``)."""
        for link, batches in batches_of.items():
            if (seq := self._seqs.get(link)) is not None:
                (link.grant if grant else link.revoke)(batches, seq)

    def _requeue_shared(self, link: Any) -> None:  # (under the lock)
        """``link``'s call broke: its shared-memory batches waiting here may be gone with its
        session (a restart): they are granted again (their leases released)."""
        for b in self.credit.arrived_from(link):
            entry = self._raw.get(b)
            if b == self._converting or entry is None or not entry.raw.segment:
                continue
            del self._raw[b]
            self.credit.requeue(b)
            _release(entry.raw, entry.shm)

    # --- the loader's thread ---------------------------------------------------------------------

    def service(self, now: float) -> float:
        """Stalls, servers silent too long, no server for ``reconnect_timeout``; a pass let go of
        is closed. Returns seconds until it wants to look again."""
        if self._abandoned and not self.closed:
            self.close()
        with self._lock:
            if self.closed:
                return _MAX_WAIT_S
            revokes, due = self.credit.check(now)
            self._tell(revokes)
            for link, batches in revokes.items():
                self.servers.stats.count("stalls")
                log.info("batchd server %s is stalled (its oldest batch is late); its %d batches go to the "
                         "other servers", link.address, len(batches))
            if revokes:
                self._plan()
                self._cond.notify_all()
            restart = self.credit.silent(now, self.silent_after) if len(self._seqs) > 1 else []
            if (self._down_since is not None and self._fatal is None
                    and now - self._down_since >= max(0.0, self.options.reconnect_timeout)):
                self._fail(self._no_server_error())
        for link in restart:
            link.restart(f"silent for {self.silent_after:g} s while the others sent batches")
        return _MAX_WAIT_S if due is None else max(0.0, min(_MAX_WAIT_S, due - now))

    def _no_server_error(self) -> BaseException:
        names = ", ".join(link.address for link in self.servers.links)
        why = "; ".join(f"{link.address}: {link.error}" for link in self.servers.links if link.error)
        lost, unless = ((f"the stream from {names}", "could not resume") if self.servers.single
                        else (f"every batchd server ({names})", "none came back"))
        return errors.ConnectionError(
            f"lost {lost} at epoch {self.epoch}, batch {self.credit.base}, and {unless} within "
            f"reconnect_timeout={self.options.reconnect_timeout:g} s ({why or 'no answer'})")

    def convert_next(self) -> bool:
        """Convert the next batch in order if it arrived and the consumer has room (one converted
        ahead; not inline). True if it did (look again)."""
        with self._lock:
            b = self.credit.base  # (never arrives, too, once the pass failed after the batches before it)
            if (self.closed or self._ready is not None or self._converting is not None
                    or not self.credit.has(b)):
                return False
            try:
                item = self._convert(b)
            except BaseException as e:  # (raised to the consumer in its place, after the batches before it)
                self._ready = e
                self._cond.notify_all()
                return False
            if item is not None and not self.closed:
                self._ready = item
                self._cond.notify_all()
            return item is not None

    # --- converting (either thread) ----------------------------------------------------------------

    def _convert(self, b: int) -> Any:  # (under the lock, released while converting)
        """Batch b converted and taken (its server credited, the next grants planned); None if its
        shared-memory slot was gone (it is granted again)."""
        entry = self._raw[b]
        self._converting = b
        self._lock.release()
        try:
            item = convert(entry.raw, entry.shm, options=self.options, transfer=self.transfer,
                           stopping=self.stopping, on_error=self.servers.info.on_error,
                           address=entry.link.address, record=self.progress(entry.link))
        except ConnectionError as e:
            if not entry.raw.segment:
                raise
            log.info("batch %d is gone from %s's shared memory (%s); asking for it again", b,
                     entry.link.address, e)
            item = None
        finally:
            self._lock.acquire()
            self._converting = None
        if item is None:
            self._raw.pop(b, None)
            self.credit.requeue(b)
            self._plan()
            return None
        item.times.receive = entry.received
        if not self.closed:
            self._raw.pop(b, None)
            self.credit.take(b).batches += 1
            self._plan()
        return item

    # --- the consumer --------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The batches in order, each once (module docstring)."""
        what = f"dataset {self.options.dataset!r}, epoch {self.epoch}"
        try:
            for b in range(self.start, self.total):
                batch = deliver(self._take(b, what), self.transfer)
                yield batch
                batch = None  # (not kept by this frame once the loop has it)
            self.finished = True
            self.close()
        finally:
            self.abandon()

    def _take(self, b: int, what: str) -> Any:
        """Batch b, converted: waits for it, at most ``timeout`` s from when asked or from its last
        grant. Inline, converts it here (the lock released meanwhile)."""
        asked = time.monotonic()
        timeout = self.options.timeout
        with self._lock:
            self.credit.asked(asked)
            while True:
                if self._ready is not None:
                    item, self._ready = self._ready, None
                    if isinstance(item, BaseException):  # (a converted batch never is one)
                        raise item
                    self.servers.wake()  # (room for the next conversion)
                    break
                if self.inline and self._converting is None and self.credit.has(self.credit.base):
                    item = self._convert(b)
                    if item is not None:
                        break
                    continue
                if self._fatal is not None and not self.credit.has(self.credit.base):
                    raise self._fatal
                if self.closed:
                    raise RuntimeError(f"the loader was closed ({what}, batch {b})")
                now = time.monotonic()
                deadline = max(asked, self.credit.granted_at.get(b, asked)) + timeout
                if now >= deadline:
                    names = (", ".join(link.address for link in self._seqs)
                             or ", ".join(self.servers.addresses))
                    raise errors.TimeoutError(f"no batch from {names} for {timeout:g} s ({what}, batch {b})")
                for link in self._seqs:
                    if (h := self.credit.holders.get(link)) is not None and h.at_lease_cap():
                        link.send_freed()  # (it waits for them)
                self._cond.wait(min(_MAX_WAIT_S, deadline - now))
            self.credit.handed(time.monotonic())  # (the batch's taking planned the next grants)
            return item

    # --- the end -------------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Let go of the pass (a ``break``, or the iterator collected in any thread): no lock; the
        loader's thread closes it."""
        if not self.closed:
            self._abandoned = True
            self.stopping.set()
            self.servers.wake()

    def close(self) -> None:
        """Revoke the grants still out, drop the batches waiting (their leases released), end. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.stopping.set()
            self._tell(self.credit.outstanding())
            dropped = [entry for b, entry in self._raw.items() if b != self._converting]
            self._raw.clear()
            self._ready = None
            figures = self.credit.figures()
            self._cond.notify_all()
        self.servers.passed(self, figures)  # (outside the lock: it tells the links)
        for entry in dropped:
            _release(entry.raw, entry.shm)

    def figures(self) -> dict[Any, dict]:
        with self._lock:
            return self.credit.figures()


def _release(raw: Any, shm: Any) -> None:
    """The lease of a shared-memory batch dropped unread goes back."""
    if raw.segment and shm is not None:
        shm.release_unused(raw.lease)

