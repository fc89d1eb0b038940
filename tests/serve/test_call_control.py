"""CallControl orders the client's ``done`` (on the call) and a control frame's grant (on the data
connection, another thread): a frame's grant is applied wholly before ``done`` is marked, or not
at all (server/serve/control.py). Against a recording stream, no server."""

from __future__ import annotations

import queue
import threading
from types import SimpleNamespace

import pytest

from batchd.server.serve.control import CallControl
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until

pytestmark = pytest.mark.timeout(30)


class RecordingStream:
    """What CallControl calls on a stream, in order. A grant, once begun, lasts until ``done`` is
    marked (``interrupt(done=True)``) or ``hold_s`` pass: without one lock ordering the two, done
    is marked while the grant is under way and the grant is recorded after it."""

    def __init__(self, hold_s: float = 0.0):
        self.request = SimpleNamespace(session="")
        self.open_seq = 0
        self.events: list[tuple] = []
        self.granting = threading.Event()
        self.done_marked = threading.Event()
        self.hold_s = hold_s

    def grant(self, indices, *, max_grants: int) -> int:
        self.granting.set()
        self.done_marked.wait(self.hold_s)
        self.events.append(("grant", tuple(indices)))
        return len(indices)

    def revoke(self, indices) -> int:
        return 0

    def interrupt(self, *, half_closed: bool = False, done: bool = False) -> None:
        self.events.append(("interrupt", half_closed, done))
        if done:
            self.done_marked.set()


def _control(stream: RecordingStream) -> tuple[CallControl, queue.Queue]:
    requests: queue.Queue = queue.Queue()
    ctl = CallControl(iter(requests.get, None), is_active=lambda: True, transport=None, max_grants=100,
                      count=lambda key, n: None)
    requests.put(pb.BatchesControl(open=pb.StreamBatchesRequest(dataset="d")))
    assert ctl.wait_open(5)
    ctl.attach(stream)
    return ctl, requests


def test_a_frames_grant_under_way_when_done_arrives_is_applied_before_done_is_marked():
    stream = RecordingStream(hold_s=2.0)
    ctl, requests = _control(stream)
    frame = threading.Thread(target=ctl.apply_frame, args=(pb.BatchesControl(grant=[3]).SerializeToString(),))
    frame.start()
    assert stream.granting.wait(5)  # the frame passed its check for done and is granting
    requests.put(pb.BatchesControl(done=True))
    frame.join(5)
    assert wait_until(lambda: ("interrupt", True, True) in stream.events, 5.0, 0.01), stream.events
    assert stream.events.index(("grant", (3,))) < stream.events.index(("interrupt", True, True)), stream.events
    requests.put(None)


def test_a_frames_grant_after_done_is_not_applied():
    stream = RecordingStream()
    ctl, requests = _control(stream)
    requests.put(pb.BatchesControl(done=True))
    assert wait_until(lambda: ("interrupt", True, True) in stream.events, 5.0, 0.01), stream.events
    assert ctl.apply_frame(pb.BatchesControl(grant=[4]).SerializeToString())  # ignored, the call goes on ending
    assert not any(e[0] == "grant" for e in stream.events)
    requests.put(None)
