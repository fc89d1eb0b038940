"""``Outbox`` (client/transport/outbox.py), the request iterator of a Batches call, without a
network: once ``direct`` is on, grants, revokes and due progress go as control frames by its
``send`` (naming their pass's open_seq) and the call carries only its opens and last message; a
frame that cannot be sent puts its grant and the progress it carried back on the call; ``reopen``
switches the call to the next pass (its last progress first), and grants of an earlier pass are
dropped (as frames too, where the server reads opens there); freed leases, queued without a lock,
ride on the next message."""

from __future__ import annotations

import threading

import pytest

from batchd import datawire
from batchd.client.transport.outbox import Outbox
from batchd.v1 import loader_pb2 as pb
from helpers import wait_until

pytestmark = pytest.mark.timeout(30)


class Progress:
    """A loop's progress that changes only when told (``batchd.client.transport.progress.Progress``'s contract)."""

    def __init__(self) -> None:
        self.taken, self._reported = 0, None

    def progress(self, force: bool = False) -> pb.StreamProgress | None:
        if self.taken == self._reported and not force:
            return None
        self._reported = self.taken
        return pb.StreamProgress(stream_tag="t", batches_taken=self.taken)


def frames(sent: list[bytes]) -> list[pb.BatchesControl]:
    """The control frames in the writes ``sent`` (a write may hold several, whole)."""
    out = []
    for data in sent:
        at = 0
        while at < len(data):
            magic, length = datawire.CONTROL.unpack_from(data, at)
            assert magic == datawire.CONTROL_MAGIC and at + datawire.CONTROL.size + length <= len(data)
            at += datawire.CONTROL.size
            out.append(pb.BatchesControl.FromString(data[at:at + length]))
            at += length
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
    outbox.grant([0, 1], 0)  # before the data connection: queued for the call ...
    outbox.direct(sent.append)  # ... and sent as a frame once it opens, if the call has not taken it
    progress.taken = 1
    outbox.grant([2], 0)
    outbox.revoke([1], 0)
    outbox.close()
    thread.join(10)
    granted = [b for m in got for b in m.grant] + [b for f in frames(sent) for b in f.grant]
    assert sorted(granted) == [0, 1, 2], "a grant lost or sent twice"
    assert [b for f in frames(sent) for b in f.revoke] == [1]
    assert any(f.progress.batches_taken == 1 for f in frames(sent)), "the due progress went without a frame"
    assert got[0].HasField("open") and got[-1].done and len(got) <= 3
    assert outbox.frames == len(frames(sent)) and all(f.open_seq == 0 for f in frames(sent))


def test_a_frame_that_cannot_be_sent_puts_its_grant_and_progress_back_on_the_call():
    progress = Progress()
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), progress=progress, progress_every=0.0)
    got, thread = drain(outbox)

    def broken(frame: bytes) -> None:
        raise OSError("the data connection is closed")

    outbox.direct(broken)
    progress.taken = 7
    outbox.grant([5], 0)  # the frame (grant 5, progress 7) fails: both go on the call
    outbox.grant([6], 0)  # and so does everything after it
    assert wait_until(lambda: sum(len(m.grant) for m in got) == 2)  # (before the last message, which forces one)
    outbox.close()
    thread.join(10)
    assert sorted(b for m in got for b in m.grant) == [5, 6]
    with_grant = next(m for m in got if 5 in m.grant)
    assert with_grant.HasField("progress") and with_grant.progress.batches_taken == 7, \
        "the progress of the failed frame did not go on the call with its grant"
    assert outbox.frames == 0


def test_reopen_switches_the_call_and_drops_what_an_earlier_pass_grants_late():
    """The next pass's ``open`` follows the last progress of the one before; grants of the earlier
    pass queued after the switch are dropped (the server revoked that pass's grants); frames name
    the pass they belong to."""
    first, second, sent = Progress(), Progress(), []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d", epoch=0), progress=first, progress_every=60.0)
    got, thread = drain(outbox)
    outbox.grant([0, 1], 0)
    assert wait_until(lambda: sum(len(m.grant) for m in got) == 2)
    first.taken = 2
    assert outbox.reopen(pb.StreamBatchesRequest(dataset="d", epoch=1), second) == 1
    outbox.grant([7], 0)  # the earlier pass, too late: dropped
    outbox.revoke([1], 0)
    outbox.grant([0], 1)
    assert wait_until(lambda: any(0 in m.grant for m in got[1:] if not m.HasField("open")) and
                      any(m.HasField("open") for m in got[1:]))
    outbox.direct(sent.append)
    second.taken = 1
    outbox.grant([3], 1)
    outbox.close()
    thread.join(10)
    opens = [k for k, m in enumerate(got) if m.HasField("open")]
    assert [got[k].open.epoch for k in opens] == [0, 1]
    before = got[opens[1] - 1]
    assert before.progress.batches_taken == 2, "the earlier pass's last progress did not go before the switch"
    assert 7 not in [b for m in got for b in m.grant] and not any(m.revoke for m in got)
    assert [b for m in got[opens[1]:] for b in m.grant] == [0]
    assert [(f.grant[0], f.open_seq) for f in frames(sent)] == [(3, 1)]
    assert got[-1].done and got[-1].progress.batches_taken == 1


def test_where_the_server_reads_opens_in_frames_a_pass_sends_no_message_on_the_call():
    """``direct(opens=True)``: ``reopen`` writes the pass's last progress (its open_seq) and then
    the next ``open`` (one more) as frames from the caller's thread; the call carries its first
    open and its done only. A frame that cannot be sent puts the ``open`` on the call."""
    first, second, third, sent = Progress(), Progress(), Progress(), []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d", epoch=0), progress=first, progress_every=60.0)
    got, thread = drain(outbox)
    outbox.direct(sent.append, opens=True)
    outbox.grant([0], 0)
    first.taken = 1
    assert outbox.reopen(pb.StreamBatchesRequest(dataset="d", epoch=1), second) == 1
    outbox.grant([0], 1)
    want = [(0, "grant", None), (0, "progress", 1), (1, "open", 1), (1, "grant", None)]
    kinds = [(f.open_seq, "open", f.open.epoch) if f.HasField("open") else
             (f.open_seq, "progress", f.progress.batches_taken) if f.HasField("progress") else
             (f.open_seq, "grant", None) for f in frames(sent)]
    assert kinds == want, kinds

    def broken(frame: bytes) -> None:
        raise OSError("the data connection is closed")

    outbox.direct(broken, opens=True)
    second.taken = 2
    assert outbox.reopen(pb.StreamBatchesRequest(dataset="d", epoch=2), third) == 2  # on the call instead
    outbox.close()
    thread.join(10)
    assert [m.open.epoch for m in got if m.HasField("open")] == [0, 2]
    assert got[-1].done


def _freed_leases():
    """A lock-free queue of freed leases (as finalizers fill one) and the ``take_releases`` that empties it."""
    import queue as queue_mod

    freed: queue_mod.SimpleQueue = queue_mod.SimpleQueue()

    def take() -> list[int]:
        out = []
        while not freed.empty():
            out.append(freed.get_nowait())
        return out

    return freed, take


def test_freed_leases_ride_on_the_next_message_without_a_lock():
    """Leases freed (queued by finalizers, lock-free) go with the next grant, or alone within
    the lease poll while any is outstanding; ``sent`` hears each once."""
    freed, take = _freed_leases()
    told: list[int] = []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), take_releases=take, pending=lambda: True,
                    sent=told.extend)
    got, thread = drain(outbox)
    freed.put(11)
    outbox.grant([0], 0)
    assert wait_until(lambda: any(11 in m.release for m in got))
    freed.put(12)  # no grant follows: it goes within the lease poll
    assert wait_until(lambda: any(12 in m.release for m in got), 2.0)
    outbox.close()
    thread.join(10)
    assert sorted(b for m in got for b in m.release) == [11, 12] == sorted(told)


def test_where_the_server_reads_releases_in_frames_no_message_goes_on_the_call_per_batch():
    """A shared-memory call whose server reads releases in frames (``batchd-data-releases``):
    the leases freed ride on each grant's frame; those freed while no grant comes go alone in a
    frame within the lease poll, and so does the progress when due; the call carries only its
    open and its last message. A frame that cannot be sent gives its leases back to be released
    another way (``unsent``), never lost."""
    freed, take = _freed_leases()
    told: list[int] = []
    progress, sent = Progress(), []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), progress=progress, take_releases=take,
                    pending=lambda: True, sent=told.extend, progress_every=0.2)
    got, thread = drain(outbox)
    assert wait_until(lambda: got)  # (the open)
    outbox.direct(sent.append, releases=True)
    freed.put(11)
    outbox.grant([0], 0)
    assert [(list(f.grant), list(f.release)) for f in frames(sent)] == [([0], [11])]
    freed.put(12)  # no grant follows: a frame of its own within the lease poll
    assert wait_until(lambda: any(12 in f.release for f in frames(sent)), 2.0)
    progress.taken = 3  # and the progress, once due, without a grant
    assert wait_until(lambda: any(f.progress.batches_taken == 3 for f in frames(sent)), 2.0)
    assert len(got) == 1, "a message went on the call"
    assert sorted(told) == [11, 12]

    unsent: list[int] = []
    broken = Outbox(pb.StreamBatchesRequest(dataset="d"), take_releases=take, pending=lambda: True,
                    sent=told.extend, unsent=unsent.extend)

    def refuse(frame: bytes) -> None:
        raise OSError("the data connection is closed")

    broken.direct(refuse, releases=True)
    freed.put(21)
    broken.grant([1], 0)  # the frame fails: the grant goes on the call, the lease back to its owner
    assert unsent == [21] and 21 not in told
    outbox.close()
    thread.join(10)
    assert got[-1].done and sorted(b for m in got for b in m.release) == []
