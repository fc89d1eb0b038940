"""The worker process's end of the pipe: tasks in, and what never raises across it going out.

``worker_main`` (``server/compute/worker.py``) runs its loop on these: ``Inbox`` takes the
server's messages (``protocol.py``) as soon as they arrive, between samples too, so the worker
starts reading a queued task's samples early (``_Worker.prefetch``), and says when the server
sent Shutdown or went away; ``failure`` turns an exception into the ``TaskFailed`` the server gets
in its place (the exception itself if it survives pickling, its type name, a message with its
notes, the traceback); ``parent_alive`` tells whether the server process still exists.
"""

from __future__ import annotations

import collections
import os
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING

from batchd.server.compute.protocol import Shutdown, Task, TaskFailed

if TYPE_CHECKING:
    from batchd.server.compute.worker import _Worker


def failure(task_id: int, worker_id: int, exc: BaseException) -> TaskFailed:
    tb = "".join(traceback.format_exception(exc))
    try:
        pickle.loads(pickle.dumps(exc))  # some exceptions pickle but do not unpickle
        error = exc
    except Exception:
        error = None
    # notes (e.g. "while applying the pipeline to dataset ..., sample ...") name the sample; the
    # message is all a client sees when the exception travels as a WorkerError
    message = "\n".join([str(exc), *(n for n in getattr(exc, "__notes__", ()) if isinstance(n, str))])
    return TaskFailed(task_id, worker_id, error, type(exc).__name__, message, tb)


def parent_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


class Inbox:
    """The worker's end of the pipe: tasks taken as soon as they arrive (started reading, then run
    in arrival order), and whether the server said Shutdown or went away (``open`` False)."""

    def __init__(self, conn: Connection, worker: "_Worker"):
        self.conn, self.worker = conn, worker
        self.tasks: collections.deque[Task] = collections.deque()
        self.open = True

    def drain(self) -> None:
        """Take every message already in the pipe, without waiting."""
        try:
            while self.open and self.conn.poll():
                self._put(self.conn.recv())
        except (EOFError, OSError):
            self.open = False

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for a message; True if one came (or the pipe closed)."""
        try:
            if not self.conn.poll(timeout):
                return False
            self._put(self.conn.recv())
        except (EOFError, OSError):
            self.open = False
        return True

    def _put(self, msg) -> None:
        if isinstance(msg, Shutdown):
            self.open = False
        else:
            self.tasks.append(msg)
            self.worker.prefetch(msg)
