"""The ordered side of a feed: the converter thread, and the consumer's iterator.

``Delivery`` is the part of ``Feed`` (``batchd.client.feed``) that turns the reorder buffer
(``_raw``: batch index -> the received ``WireBatch`` and where it came from, filled by the lane
threads, ``batchd.client.lane_runner``) into batches handed out in order, each once::

    raw reorder buffer --one converter thread, in batch order, MAX_READY ahead--> _ready --> batches()

* **The converter** (``_convert_loop``) takes the next batch in order once it arrived and there
  is room among the ``MAX_READY`` converted batches (the double buffer), converts it outside the
  lock (``ServerConnection.convert``: unpack, device copy, gpu_transform, decode_on_client,
  collate_fn) and hands it to the consumer. While it waits (``_next_ready``), it runs the
  assigner's lateness check (hedges, stalled servers, ``batchd.client.lateness``) at the
  deadlines the check gives, and marks down a server that sent nothing for ``timeout`` seconds
  while others did (``_watch``). A shared-memory batch gone with a restarted server's session is
  asked for again (``requeue_shared``). Once the last batch is taken, every call is half-closed
  (``_finish``). An error ends the queue (``_Failed``), after the batches before it.
* **The consumer** (``batches``) takes the converted batches in order, waiting at most
  ``timeout`` seconds for each (``errors.TimeoutError``, naming the servers), and never past the
  converter's end.
* **Inline** (``Feed._inline``: one server, and conversion is CPU tensors over the bytes as they
  came, ``ServerConnection.converts_inline``): the consumer converts each batch itself once it
  arrived, and the converter only ends the feed (the last batch taken, an error). A batch then
  costs one thread wake-up less, which is what a batch costs at training rates
  (``bench/probes/batch_rate.py``); the raw reorder buffer (``prefetch`` ahead) is the buffer.
  The consumer also reads the call itself when the batch it needs has not come (``Feed.direct``:
  the call on loan from its lane thread, ``batchd.client.lane_runner``), another wake-up less.
  The lane and the consumer wait on ``_cond``, the converter on ``_work``, a lane thread whose
  call is on loan on ``_loaned`` (all on the one lock).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Iterator

from batchd import errors
from batchd.client.transport.connection import deliver

log = logging.getLogger("batchd.client.loader.loader")

_POLL_S = 0.25  # the longest a waiting thread sleeps before it checks the others (seconds)
MAX_READY = 1  # converted batches waiting for the consumer (1: double buffering)
_SILENT_EVERY_S = 1.0  # how often the converter looks for servers silent for `timeout`


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException


_END = object()


def release_dropped(raw: Any, record: Any) -> None:
    """Give back the lease of a shared-memory batch received on ``record``'s call and dropped unread."""
    if record.shm is not None:
        record.shm.release_unused(raw.lease)


class Delivery:
    """Mixed into ``Feed``: needs its ``_lock``, ``_cond``, ``_work``, ``_inline``, ``_raw``,
    ``_ready``, ``_runners``, ``_fatal``, ``_all_down_since``, ``_converting``, ``_finished``,
    ``_silent_at``, ``_converter``, ``stopping``, ``assigner``, ``owner``, ``options``, ``epoch``,
    ``start``, ``total``, ``_fail``, ``_plan``, ``_send``, ``_fold`` and ``close``."""

    # --- the converter -------------------------------------------------------------------------------

    def _convert_loop(self) -> None:
        try:
            while True:
                got = self._next_ready()
                if got is None:
                    return
                b, entry = got
                item = self._convert(b, entry)
                if item is None:
                    continue
                with self._lock:
                    self._took(b, entry[1])
                    self._ready.append(item)
                    self._cond.notify_all()
                del item, entry, got
        except BaseException as e:  # never raise in the thread: hand it to the consumer
            with self._lock:
                self._converting = None
                self._ready.append(_Failed(e))
                self._cond.notify_all()

    def _convert(self, b: int, entry: tuple) -> Any:
        """Batch ``b`` (``_converting``, still in the reorder buffer) converted, outside the lock;
        None if its shared-memory slot was gone (asked for again)."""
        raw, server, conn, record, received = entry
        try:
            item = conn.convert(raw, self.stopping, record)
        except ConnectionError as e:
            if not raw.segment:
                raise
            log.info("batch %d is gone from %s's shared memory (%s); asking for it again", b, server.address, e)
            with self._lock:
                self._converting = None
                self._raw.pop(b, None)
                self.assigner.requeue(b)
                self._plan()
            return None
        item.times.receive = received
        return item

    def _took(self, b: int, server: Any) -> None:  # (under the lock)
        """Batch ``b`` was converted: it leaves the reorder buffer, taken from ``server``."""
        self._converting = None
        self._raw.pop(b, None)
        self.assigner.take(b)
        server.batches += 1
        self._plan()

    def _next_ready(self) -> tuple[int, tuple] | None:
        """The next batch in order and its entry, once it arrived and the consumer has room (it
        stays in the reorder buffer, ``_converting``, until converted); None at the end (``_END`` or an error
        queued for the consumer) or when the feed closes."""
        with self._lock:
            while True:
                if self.stopping.is_set():
                    return None
                now = time.monotonic()
                deadline, silent = self._watch(now)
                if silent:  # (marking a server down takes the lock)
                    self._lock.release()
                    try:
                        for runner, error in silent:
                            runner.give_up(error)
                    finally:
                        self._lock.acquire()
                    continue
                a = self.assigner
                if a.done:
                    self._ready.append(_END)
                    self._cond.notify_all()
                    self._finish()
                    return None
                if a.has(a.base) and len(self._ready) < MAX_READY and not self._inline:
                    self._converting = a.base
                    return a.base, self._raw[a.base]
                if self._fatal is not None and not a.has(a.base):
                    self._ready.append(_Failed(self._fatal))
                    self._cond.notify_all()
                    return None
                if not self._runners and not self.owner.single and self._all_down_since is not None:
                    self._lock.release()
                    try:
                        error = self.owner.wait_for_any(self, self.epoch, a.base)
                    finally:
                        self._lock.acquire()
                    if error is not None:
                        self._fail(error)
                    continue
                wait = _POLL_S if deadline is None else min(_POLL_S, max(0.0, deadline - now) + 1e-3)
                self._work.wait(wait)

    def requeue_shared(self, server: Any) -> None:
        """``server``'s call broke: the batches it sent over shared memory that wait here may be
        gone with its session (a restart); they are asked for again."""
        dropped = []
        with self._lock:
            for b in self.assigner.arrived_from(server):
                entry = self._raw.get(b)
                if b == self._converting or entry is None or not entry[0].segment:
                    continue
                dropped.append(self._raw.pop(b))
                self.assigner.requeue(b)
            if dropped:
                self._plan()
        for raw, _, _, record, _ in dropped:
            release_dropped(raw, record)

    def _watch(self, now: float) -> tuple[float | None, list]:  # (under the lock)
        """Lateness (hedges, stalled servers): the next deadline to look again; and the servers
        silent for ``timeout`` while others sent batches, with the error to mark them down with."""
        a = self.assigner
        grants, deadline = a.check(now)
        if grants:
            self._send(grants)
        silent = []
        if now - self._silent_at >= _SILENT_EVERY_S and len(self._runners) > 1:
            self._silent_at = now
            for lane in a.silent(now, self.options.timeout):
                runner = self._runners.get(lane.key)
                if runner is not None:
                    error = errors.TimeoutError(f"no batch from {lane.key.address} for {self.options.timeout:g} s "
                                                "while the other servers sent theirs")
                    silent.append((runner, error))
        return deadline, silent

    def _finish(self) -> None:  # (under the lock)
        """Every batch was taken: half-close the calls (cancel those still holding grants). Once."""
        if self._finished:
            return
        self._finished = True
        for server, runner in self._runners.items():
            lane = self.assigner.lanes.get(server)
            runner.finish(cancel=lane is not None and bool(lane.outstanding))
            self._fold(server, runner)
        self._loaned.notify_all()  # (a call on loan goes back to its lane thread, which reads it to its end)

    # --- the consumer ------------------------------------------------------------------------------

    def batches(self) -> Iterator[Any]:
        """The batches in order, each once; ``close()`` when done (also on an early exit)."""
        o = self.options
        b = self.start
        what = f"dataset {o.dataset!r}, epoch {self.epoch}"
        try:
            while b < self.total:
                item = self._take(b, what)
                if item is _END:
                    return
                if isinstance(item, _Failed):
                    raise item.error
                batch = deliver(item, self.owner._transfer)
                item = None
                b += 1
                yield batch
                batch = None  # (not kept by this frame once the loop has it)
        finally:
            self.close()

    def _take(self, b: int, what: str) -> Any:
        timeout = self.options.timeout
        deadline = time.monotonic() + timeout
        a = self.assigner
        with self._lock:
            a.asked(deadline - timeout)
            while not self._ready:
                if self._inline and self._converting is None and a.has(a.base) and not self.stopping.is_set():
                    item = self._convert_here(a.base)
                    if item is not None:
                        break
                    continue
                now = time.monotonic()
                if now >= deadline:
                    names = ", ".join(s.address for s in self._runners) or ", ".join(self.owner.addresses)
                    raise errors.TimeoutError(f"no batch from {names} for {timeout:g} s ({what}, batch {b})")
                runner = self._lender()
                if runner is not None:  # read the call here (no wake-up of its lane thread)
                    runner.loan.read(self, runner, what, b)
                    continue
                if not self._converter.is_alive() and not self._ready:
                    raise RuntimeError(f"the converter thread ended without a result ({what}, batch {b})")
                self._cond.wait(min(_POLL_S, deadline - now))
            else:
                item = self._ready.popleft()
                if not self._inline:
                    self._work.notify_all()  # room for the converter
            a.handed(time.monotonic())
            self._plan()  # (the loop's pace may let more be granted)
            return item

    def _lender(self) -> Any:  # (under the lock)
        """The lane runner whose call is on loan with nobody reading it (direct reads), or None
        (also once an error waits: the converter hands it to the consumer)."""
        if not self.direct or self.stopping.is_set() or self._fatal is not None:
            return None
        for runner in self._runners.values():
            loan = runner.loan
            if loan is not None and not loan.reading and loan.outcome is None and not loan.timed_out:
                return runner
        return None

    def _convert_here(self, b: int) -> Any:  # (under the lock; released while converting)
        """Inline: batch ``b``, arrived, converted in the consumer's thread; None if it was asked
        for again. Once the last batch is taken (or an error waits), the converter ends the feed."""
        entry = self._raw[b]
        self._converting = b
        self._lock.release()
        try:
            item = self._convert(b, entry)
        except BaseException:
            self._lock.acquire()
            self._converting = None
            raise
        self._lock.acquire()
        if item is not None:
            self._took(b, entry[1])
            if self.assigner.done:
                self._finish()  # (here: the loop may close the feed before the converter wakes)
            if self.assigner.done or self._fatal is not None:
                self._work.notify_all()
        return item
