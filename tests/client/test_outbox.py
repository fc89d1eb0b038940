"""``Outbox`` (client/transport/outbox.py), the request iterator of a Batches call, without a network: once
``direct`` is on, grants, revokes and due progress go as control frames by its ``send`` and the
call carries only its open and last message; a frame that cannot be sent puts its grant and
the progress it carried back on the call."""

from __future__ import annotations

import threading

import pytest

from batchd import datawire
from batchd.client.transport.outbox import Outbox
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until

pytestmark = pytest.mark.timeout(30)


class Progress:
    """A loop's progress that changes only when told (``CallRecord.progress``'s contract)."""

    def __init__(self) -> None:
        self.taken, self._reported = 0, None

    def __call__(self, force: bool = False) -> pb.StreamProgress | None:
        if self.taken == self._reported and not force:
            return None
        self._reported = self.taken
        return pb.StreamProgress(stream_tag="t", batches_taken=self.taken)


def frames(sent: list[bytes]) -> list[pb.BatchesControl]:
    out = []
    for frame in sent:
        magic, length = datawire.CONTROL.unpack_from(frame)
        assert magic == datawire.CONTROL_MAGIC and len(frame) == datawire.CONTROL.size + length
        out.append(pb.BatchesControl.FromString(frame[datawire.CONTROL.size:]))
    return out


def drain(outbox: Outbox) -> tuple[list[pb.BatchesControl], threading.Thread]:
    """The call's messages, read by a thread as gRPC's would."""
    got: list[pb.BatchesControl] = []
    thread = threading.Thread(target=lambda: got.extend(outbox), daemon=True)
    thread.start()
    return got, thread


def test_grants_and_progress_go_as_frames_and_the_call_carries_its_open_and_last_message():
    progress, sent = Progress(), []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), progress=progress, progress_every=0.0)
    got, thread = drain(outbox)
    outbox.grant([0, 1])  # before the data connection: queued for the call ...
    outbox.direct(sent.append)  # ... and sent as a frame once it opens, if the call has not taken it
    progress.taken = 1
    outbox.grant([2])
    outbox.revoke([1])
    outbox.close()
    thread.join(10)
    granted = [b for m in got for b in m.grant] + [b for f in frames(sent) for b in f.grant]
    assert sorted(granted) == [0, 1, 2], "a grant lost or sent twice"
    assert [b for f in frames(sent) for b in f.revoke] == [1]
    assert any(f.progress.batches_taken == 1 for f in frames(sent)), "the due progress went without a frame"
    assert got[0].HasField("open") and got[-1].done and len(got) <= 3
    assert outbox.frames == len(sent)


def test_a_frame_that_cannot_be_sent_puts_its_grant_and_progress_back_on_the_call():
    progress = Progress()
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), progress=progress, progress_every=0.0)
    got, thread = drain(outbox)

    def broken(frame: bytes) -> None:
        raise OSError("the data connection is closed")

    outbox.direct(broken)
    progress.taken = 7
    outbox.grant([5])  # the frame (grant 5, progress 7) fails: both go on the call
    outbox.grant([6])  # and so does everything after it
    assert wait_until(lambda: sum(len(m.grant) for m in got) == 2)  # (before the last message, which forces one)
    outbox.close()
    thread.join(10)
    assert sorted(b for m in got for b in m.grant) == [5, 6]
    with_grant = next(m for m in got if 5 in m.grant)
    assert with_grant.HasField("progress") and with_grant.progress.batches_taken == 7, \
        "the progress of the failed frame did not go on the call with its grant"
    assert outbox.frames == 0
