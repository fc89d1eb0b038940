"""Converting a pass's batches in order: ``Conversion``, the double buffer of ``Epoch``.

A received batch becomes the loader's (``batchd.client.device.convert``: tensors on the device,
finished, decoded, collated) in batch order, once it arrived. Where that is cheap (CPU tensors as
they came: ``inline``), the consumer converts each batch itself as it takes it: one thread
hand-off less. Otherwise the loader's thread converts the next batch while the loop trains on
this one (``convert_next``, one converted ahead); what converting raises is handed to the
consumer in the batch's place. A shared-memory batch whose slot is gone (its server restarted)
is granted again instead (``Credit.requeue``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from batchd.client.device.convert import convert

log = logging.getLogger("batchd.client.loader")


@dataclass(frozen=True, slots=True)
class _Failed:
    error: BaseException  # what converting the next batch raised: the consumer raises it in its place


class Conversion:
    """Mixed into ``Epoch``: needs its ``_lock``, ``_cond``, ``_raw``, ``_ready``, ``_converting``,
    ``closed``, ``credit``, ``servers``, ``options``, ``transfer``, ``stopping``, ``progress``,
    ``_fatal_due`` and ``_plan``."""

    def convert_next(self) -> bool:
        """The loader's thread (not inline): convert the next batch in order if it arrived and the
        consumer has room (one converted ahead). True if it did (look again)."""
        with self._lock:
            if self.closed or self._ready or self._converting is not None or self._fatal_due():
                return False
            b = self.credit.base
            if not self.credit.has(b):
                return False
            self._converting = b
            entry = self._raw[b]
        try:
            item = self._convert(b, entry)
        except BaseException as e:  # (raised to the consumer in its place, after the batches before it)
            with self._lock:
                self._converting = None
                self._ready.append(_Failed(e))
                self._cond.notify_all()
            return False
        with self._lock:
            self._converting = None
            if item is not None and not self.closed:
                self._took(b)
                self._ready.append(item)
                self._cond.notify_all()
        return item is not None

    def _fatal_due(self) -> bool:  # (under the lock)
        return self._fatal is not None and not self.credit.has(self.credit.base)

    def _convert(self, b: int, entry: Any) -> Any:
        """Batch b converted (outside the lock); None if its shared-memory slot was gone (granted again)."""
        try:
            item = convert(entry.raw, entry.shm, options=self.options, transfer=self.transfer, stopping=self.stopping,
                           on_error=self.servers.info.on_error, address=entry.link.address,
                           record=self.progress(entry.link))
        except ConnectionError as e:
            if not entry.raw.segment:
                raise
            log.info("batch %d is gone from %s's shared memory (%s); asking for it again", b, entry.link.address, e)
            with self._lock:
                self._raw.pop(b, None)
                self.credit.requeue(b)
                self._plan()
            return None
        item.times.receive = entry.received
        return item

    def _took(self, b: int) -> None:  # (under the lock)
        link = self.credit.take(b)
        self._raw.pop(b, None)
        link.batches += 1
        self._plan()

    def _convert_here(self, b: int) -> Any:  # (under the lock; released while converting)
        entry = self._raw[b]
        self._converting = b
        self._lock.release()
        try:
            item = self._convert(b, entry)
        finally:
            self._lock.acquire()
            self._converting = None
        if item is not None:
            self._took(b)
        return item
