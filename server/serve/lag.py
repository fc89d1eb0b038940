"""Logging a stream that falls behind: its RPC waited over ``BEHIND_S`` for its next batch."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchd.server.loader import Loader
    from batchd.server.serve.stream import Stream

log = logging.getLogger(__name__)

BEHIND_S = 2.0  # a client waiting this long for one batch: its stream is falling behind (logged)
BEHIND_LOG_EVERY_S = 60.0


class LagLog:
    """Logs when a stream falls behind: the RPC waited over ``BEHIND_S`` for its next batch.

    At most one warning per ``BEHIND_LOG_EVERY_S`` per stream (counting the slow waits in
    between), and one line when the warned-about batch arrives.
    """

    def __init__(self, stream: "Stream", loader: "Loader"):
        self.stream, self.loader = stream, loader
        self.flagged = False  # this wait is already counted as slow
        self.logged = False  # ... and was logged
        self.slow = 0  # slow waits not logged yet
        self.last_log = -math.inf

    def waiting(self) -> None:
        s = self.stream
        now = time.monotonic()
        waited = now - (s.waiting_since or now)
        if self.flagged or waited < BEHIND_S:
            return
        self.flagged = True
        self.slow += 1
        if now - self.last_log < BEHIND_LOG_EVERY_S:
            return
        in_flight, ready = s.backlog()
        load = self.loader.pool.load()
        earlier = f"; {self.slow - 1} more waits over {BEHIND_S:g} s since the last warning" if self.slow > 1 else ""
        log.warning(
            "stream %d (dataset %s, pipeline %s) is falling behind: its client has waited %.1f s for batch %d "
            "(%d of its batches being built; workers: %d of %d busy, %d batches queued; %d open streams)%s",
            s.id, s.request.dataset, s.request.pipeline_name, waited, s.next_index, in_flight, load["busy"],
            self.loader.pool.num_workers, load["tasks_in_flight"], len(self.loader.streams), earlier,
        )
        self.slow, self.logged, self.last_log = 0, True, now

    def got_batch(self, batch_index: int) -> None:
        s = self.stream
        if self.logged:
            log.info("stream %d caught up: batch %d came after %.1f s", s.id, batch_index,
                     time.monotonic() - (s.waiting_since or time.monotonic()))
        s.waiting_since = None
        self.flagged = self.logged = False
