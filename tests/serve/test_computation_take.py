"""The pool asks a computation ``wants_work`` and then, with a slot in hand, ``take_task``: two
lock acquisitions, between which another thread may close the computation (its last stream went
away) or revoke the grant. The take must check again under the same lock as the act (once, the
scheduler's round raised ``IndexError: pop from an empty deque`` and failed every open stream)."""

from __future__ import annotations

import numpy as np
import pytest

from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.computation import Computation
from batchd.server.serve.stream import Stream

pytestmark = pytest.mark.timeout(30)


def _granted(batches=(0, 1)) -> tuple[Computation, Stream]:
    request = StreamRequest(dataset="d", batch_size=4, granted=True)
    computation = Computation(request, np.arange(40, dtype=np.int64), 10, release_slot=lambda slot: None, window=8)
    stream = Stream(request, 10)
    computation.attach(stream, first=True)
    computation.grant(stream, list(batches), max_grants=256)
    return computation, stream


def test_a_computation_closed_between_wants_work_and_take_task_gives_no_task():
    computation, _ = _granted()
    assert computation.wants_work()
    computation.close()  # (the RPC thread, while the pool acquired a slot)
    assert computation.take_task() is None


def test_a_grant_revoked_between_wants_work_and_take_task_is_not_built():
    computation, stream = _granted([3])
    assert computation.wants_work()
    assert computation.revoke(stream, [3]) == 1
    assert computation.take_task() is None
    computation.grant(stream, [4], max_grants=256)
    assert computation.take_task() == 4  # and the next grant is built
