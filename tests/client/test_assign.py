"""The assigner (``batchd.client.assign``), the hedging budget and the call's outbox, on plain
objects: no network, no threads, virtual time.

``simulate`` plays servers against an ``Assigner`` as the feed drives it: each server builds its
granted batches in grant order on ``workers`` workers, ``service`` seconds each, skips revoked
ones, and stops dead during its ``stalls`` (a SIGSTOP: what it was building finishes after);
the loop takes batches in order, one per ``step`` seconds at most. The policies are tested
against the adversaries they exist for: unequal servers (a fixed split runs at n x the slowest),
and a server that stalls again and again (a yardstick taken from its own history made the stall
its own percentile, and it was never hedged).
"""

from __future__ import annotations

import heapq
import queue
import threading
import time

import numpy as np
import pytest

from batchd.client.assign import Assigner
from batchd.client.transport.outbox import Outbox
from batchd.client.hedge import Budget, HedgePolicy
from batchd.client.pace import Pace
from batchd.client.windows import MAX_WINDOW
from batchd.v1 import loader_pb2 as pb


class Server:
    def __init__(self, name, service, workers=1, stalls=()):
        self.name, self.service, self.workers, self.stalls = name, service, workers, list(stalls)
        self.queue: list[int] = []
        self.busy = 0
        self.revoked: set[int] = set()
        self.built = 0
        self.batches: set[int] = set()  # the batches it built

    def stalled(self, t):
        return any(a <= t < b for a, b in self.stalls)

    def resume_at(self, t):
        return next((b for a, b in self.stalls if a <= t < b), t)


def simulate(servers, total, *, policy=None, mode="dynamic", step=0.0, floor=2, lease_limit=None, until=None,
             homes=False):
    """Run ``total`` batches through an Assigner over ``servers``; returns (seconds, the loop's
    wait per batch, the assigner, the order batches were taken in). homes: each lane's home name
    is its server's name (as the feed gives each its address)."""
    a = Assigner(0, total, floor=floor, policy=policy, mode=mode)
    for s in servers:
        a.add_lane(s.name, Pace(), lease_limit, home=s.name if homes else None)
        a.open_lane(s.name)
    by = {s.name: s for s in servers}
    events, seq = [], [0]

    def push(t, kind, data=None):
        seq[0] += 1
        heapq.heappush(events, (t, seq[0], kind, data))

    def dispatch(s, t):
        while s.busy < s.workers and s.queue and not s.stalled(t):
            b = s.queue.pop(0)
            if b in s.revoked:
                continue
            s.busy += 1
            s.built += 1
            s.batches.add(b)
            push(t + s.service, "done", (s.name, b))

    def grant(grants, t):
        for k, bs in grants.items():
            by[k].queue.extend(bs)
            dispatch(by[k], t)

    for s in servers:
        for _, end in s.stalls:
            push(end, "resume", s.name)
    t, waits, taken, free_at, asked_at, ticks = 0.0, [], [], 0.0, 0.0, set()
    grant(a.plan(t), t)
    push(0.0, "tick")
    while len(taken) < total and events:
        t, _, kind, data = heapq.heappop(events)
        if until is not None and t > until:
            break
        if kind == "done":
            s = by[data[0]]
            if s.stalled(t):
                push(s.resume_at(t), "done", data)
                continue
            s.busy -= 1
            arrival = a.arrived(s.name, data[1], t, work=s.service)
            for k, bs in arrival.revoke.items():
                by[k].revoked.update(bs)
            dispatch(s, t)
        elif kind == "resume":
            dispatch(by[data], t)
        while a.has(a.base) and t >= free_at:
            b = a.base
            a.asked(asked_at)
            a.take(b)
            a.handed(t)
            taken.append(b)
            waits.append(max(0.0, t - asked_at))
            free_at = asked_at = t + step
            if step:
                push(free_at, "tick")
        hedges, deadline = a.check(t)
        grant(hedges, t)
        grant(a.plan(t), t)
        if deadline is not None and deadline not in ticks:
            ticks.add(deadline)
            push(deadline, "tick")
    return t, np.array(waits), a, taken


def fast_loop(a: Assigner) -> Assigner:
    """As if the loop had taken a batch with no step in between: it needs all the servers give."""
    a.handed(0.0)
    a.asked(0.0)
    return a


def every_3s(stall=2.0, first=1.0, until=200.0):
    return [(x, x + stall) for x in np.arange(first, until, 3.0)]


# --- windows, lookahead, shares ---------------------------------------------------------------------


def test_unequal_servers_each_get_a_share_that_follows_its_speed():
    """A fixed stride runs at 2 x the slowest; dynamic grants at the sum of both."""
    fast, slow = 0.05, 0.14
    alone = 1 / fast + 1 / slow
    t, _, a, taken = simulate([Server("fast", fast), Server("slow", slow)], 600)
    assert taken == list(range(600))
    assert 600 / t >= 0.95 * alone, (600 / t, alone)
    shares = {k: f["batches"] / 600 for k, f in a.figures().items()}
    assert shares["fast"] == pytest.approx((1 / fast) / alone, abs=0.03), shares
    t, _, a, taken = simulate([Server("fast", fast), Server("slow", slow)], 600, mode="stride")
    assert taken == list(range(600)) and [f["batches"] for f in a.figures().values()] == [300, 300]
    assert 600 / t == pytest.approx(2 / slow, rel=0.05)  # the old split: n x the slowest


def test_two_loaders_with_homes_grant_alike_where_loaders_without_them_do_not():
    """Two loaders over the same two servers (experiments sharing them; each server's calls share
    one computation), their loops paced by training steps: with homes a batch goes to the same
    server for both, so each server builds it once for both; without, where each goes depends on
    each loader's own timing. Neither costs the loops anything."""
    def where(homes: bool, services: tuple[float, float], step: float):
        servers = [Server("10.0.0.2:7000", services[0], workers=2), Server("10.0.0.1:7000", services[1], workers=2)]
        t, waits, a, taken = simulate(servers, 400, step=step, homes=homes)
        assert taken == list(range(400)) and sum(s.built for s in servers) == 400
        return [s.batches for s in servers], np.median(waits)

    for homes, at_least, at_most in ((True, 0.95, 1.0), (False, 0.0, 0.8)):
        (a1, b1), wait1 = where(homes, (0.040, 0.041), step=0.030)  # loops slower than the servers
        (a2, b2), wait2 = where(homes, (0.043, 0.039), step=0.031)  # (another loader's timing)
        same = (len(a1 & a2) + len(b1 & b2)) / 400
        assert at_least <= same <= at_most, (homes, same)
        assert wait1 < 0.005 and wait2 < 0.005, (wait1, wait2)
    # with homes, batch b's home is the (b mod 2)-th address in order, whoever was added first
    (first, second), _ = where(True, (0.040, 0.041), step=0.030)
    assert len({b for b in second if b % 2 == 0}) >= 0.95 * 200 and len(first) == pytest.approx(200, abs=10)


def test_homes_give_way_to_speed():
    """A server 3 x faster than the other still gets about 3/4 of the batches with homes: a batch
    goes home only when its home would finish it at most one of its batches later."""
    fast, slow = 0.05, 0.15
    alone = 1 / fast + 1 / slow
    t, _, a, taken = simulate([Server("b-fast", fast), Server("a-slow", slow)], 600, homes=True)
    assert taken == list(range(600)) and 600 / t >= 0.95 * alone, (600 / t, alone)
    shares = {k: f["batches"] / 600 for k, f in a.figures().items()}
    assert shares["b-fast"] == pytest.approx((1 / fast) / alone, abs=0.05), shares


def test_windows_grow_to_keep_every_worker_busy_and_the_lookahead_stays_bounded():
    t, _, a, _ = simulate([Server("eight", 0.1, workers=8), Server("one", 0.1)], 900)
    assert 900 / t >= 0.95 * (80 + 10), 900 / t
    eight, one = a.lanes["eight"], a.lanes["one"]
    assert eight.window >= 8 + 1 and one.window <= 3, (eight.window, one.window)
    assert max(eight.window, one.window) <= MAX_WINDOW and a.lookahead() <= 64


def test_a_lane_never_holds_more_than_its_window_and_the_loop_never_more_than_the_lookahead():
    a = Assigner(0, 1000, floor=2)
    for name in ("a", "b"):
        a.add_lane(name, Pace())
        a.open_lane(name)
    grants = a.plan(0.0)
    assert {k: len(v) for k, v in grants.items()} == {"a": 2, "b": 2}
    assert sorted(b for v in grants.values() for b in v) == [0, 1, 2, 3]  # in order, each once
    assert a.plan(0.0) == {}  # no room


def test_a_slow_loop_gets_few_batches_ahead_a_fast_one_what_fills_the_windows():
    a = Assigner(0, 1000, floor=2)
    for name in ("a", "b"):
        a.add_lane(name, Pace())
        a.open_lane(name)
        a.lanes[name].pace.rate = 200.0  # (fast servers: windows of 20 at the 0.1 s horizon)
    assert a.lookahead(0.0) == 4  # before the loop's first step: each server prefetch ahead
    a.handed(0.0)
    a.asked(0.001)  # a loop that steps 1 ms
    a.plan(0.001)
    assert a.lookahead(0.002) == 64  # (2 x its windows of 20, capped)
    a.handed(0.002)
    assert a.lookahead(5.0) == 4, "a loop 5 s into its step still gets batches built for it"
    a.asked(5.0)
    a.handed(5.0)
    assert a.lookahead(5.0) < 10


def test_stride_waits_for_its_server_and_gives_a_leaving_servers_batches_to_the_others():
    a = fast_loop(Assigner(0, 12, floor=2, mode="stride"))
    for name in ("a", "b", "c"):
        a.add_lane(name, Pace())
    a.open_lane("a")
    assert a.plan(0.0) == {"a": [0, 3]}  # b's and c's batches wait for their calls
    a.open_lane("b")
    a.open_lane("c")
    assert a.plan(0.0) == {"b": [1, 4], "c": [2, 5]}
    assert a.remove_lane("c") == [2, 5]  # down: its batches are granted again, first
    for b, lane in ((0, "a"), (3, "a"), (1, "b"), (4, "b")):
        assert a.arrived(lane, b, 1.0).keep
    grants = a.plan(1.0)
    assert sorted(grants["a"] + grants["b"])[:2] == [2, 5]
    assert all(b % 3 == 0 or b in (2, 5) for b in grants["a"]) and all(b % 3 == 1 or b in (2, 5) for b in grants["b"])


def test_a_shared_memory_lane_stays_within_its_leases_yet_always_takes_the_batch_below_those_it_holds():
    """A lane at its lease limit with later batches waiting here must still be granted the one
    before them (refusing it deadlocked the loop on its own leases, seen after a failover)."""
    a = fast_loop(Assigner(0, 100, floor=4))
    a.add_lane("sidecar", Pace(), lease_limit=5)
    a.open_lane("sidecar")
    assert a.plan(0.0) == {"sidecar": [0, 1, 2, 3]}
    for b in (1, 2, 3):
        assert a.arrived("sidecar", b, 0.1).keep
    assert a.plan(0.1) == {"sidecar": [4]}  # leases: 3 held + 2 granted = 5
    assert a.plan(0.1) == {}  # at its limit
    a.lanes["sidecar"].window = 8
    a.requeue(1)  # (batch 1's slot went with a restart: to be granted again)
    assert a.arrived("sidecar", 4, 0.2).keep  # 2, 3, 4 held + 0 granted = 4
    assert a.plan(0.2) == {"sidecar": [1]}  # 5: at its limit again
    assert a.plan(0.2) == {}, "past its lease limit for a batch after those it holds"
    # a remote server holding batches below those the sidecar holds goes down: the sidecar,
    # at its lease limit, must take the one below them (the loop waits for it), not the others
    b = fast_loop(Assigner(0, 100, floor=2))
    b.add_lane("sidecar", Pace(), lease_limit=2)
    b.add_lane("remote", Pace())
    for k in ("sidecar", "remote"):
        b.open_lane(k)
    assert b.plan(0.0) == {"sidecar": [0, 2], "remote": [1, 3]}
    assert b.arrived("sidecar", 2, 0.1).keep  # held {2} + granted {0}: its limit
    assert b.remove_lane("remote") == [1, 3]
    assert b.plan(0.2) == {"sidecar": [1]}, "the batch below those it holds was refused"


# --- hedging ---------------------------------------------------------------------------------------------


def test_budget_never_exceeds_its_fraction_of_the_batches_yielded():
    budget = Budget(HedgePolicy(max_fraction=0.1, burst=3))
    assert not budget.spend()  # it starts empty
    spent = 0
    for yielded in range(1, 1001):
        budget.earn()
        while budget.spend():
            spent += 1
        assert spent <= 0.1 * yielded + 1e-9
    assert spent == 100


def test_the_yardstick_is_the_other_servers_latency_never_the_late_ones_own():
    policy = HedgePolicy(warmup=3, factor=2.0, min_delay=0.05)
    a = Assigner(0, 100, floor=2, policy=policy)
    slow, fast = a.add_lane("stalls", Pace()), a.add_lane("healthy", Pace())
    for lane in (slow, fast):
        a.open_lane(lane.key)
    slow.pace.latencies.extend([5.0] * 50)  # its own history is all stalls
    fast.pace.latencies.extend([0.1] * 50)
    assert a.threshold(slow) == pytest.approx(0.2)  # 2 x the healthy one's median, not 2 x 5 s
    assert a.threshold(fast) == pytest.approx(10.0)  # (the healthy one is judged by the other too)
    assert Assigner(0, 10, policy=policy).threshold(slow) is None  # alone: no yardstick


def test_a_server_that_stalls_again_and_again_is_hedged_every_time_within_the_budget():
    """One of two equal servers stops 2 s of every 3 s (the issue's adversary): without hedging the
    loop waits out every stop (p99 about 2 s); with it the p99 wait stays under 0.5 s, every
    stall is hedged (not only the first ones), at most 10% of the batches, each batch taken once."""
    def run(policy):
        return simulate([Server("a", 0.05), Server("b", 0.05, stalls=every_3s())], 1500, policy=policy, step=0.02)

    _, waits_off, _, taken = run(None)
    assert taken == list(range(1500)) and np.percentile(waits_off, 99) > 1.5
    t, waits, a, taken = run(HedgePolicy())
    assert taken == list(range(1500)), "a batch was taken twice or out of order"
    assert np.percentile(waits, 99) < 0.5, np.percentile(waits, 99)
    issued = sum(f["hedges_issued"] for f in a.figures().values())
    stops = sum(1 for start, _ in every_3s() if start < t)
    assert stops >= 15 and issued >= stops, (issued, stops)  # every stall, not the first few only
    assert issued <= 0.1 * 1500
    extra = sum(s for s in [a.lanes["a"].duplicates, a.lanes["b"].duplicates])
    assert extra <= issued


def test_under_stride_a_stalled_servers_own_batches_are_hedged_too():
    """Stride gives each server fixed batches, so a stalled server's next ones are granted to no one
    (it gets no new grants while stalled): the batch the loop waits for must be hedged to another
    server even though no lane holds it, else the loop waits out every stop. Table 12's adversary:
    one of 3 servers stops 1 s every 8 s (a third of the batches are its own: 10% of the batches
    yielded pays for the hedges)."""
    stalls = [(t, t + 1.0) for t in np.arange(2.0, 120.0, 8.0)]

    def run(policy):
        return simulate([Server("a", 0.05), Server("b", 0.05), Server("c", 0.05, stalls=stalls)], 3000,
                        policy=policy, step=0.02, mode="stride")

    _, waits_off, _, taken = run(None)
    assert taken == list(range(3000))
    _, waits, a, taken = run(HedgePolicy())
    assert taken == list(range(3000)), "a batch was taken twice or out of order"
    assert waits.max() <= waits_off.max() / 2, (waits.max(), waits_off.max())
    assert sum(f["hedges_issued"] for f in a.figures().values()) <= 0.1 * 3000


def test_the_first_copy_wins_the_other_is_revoked_and_a_stalled_lane_keeps_its_oldest_as_a_probe():
    a = Assigner(0, 100, floor=2, policy=HedgePolicy(warmup=1, max_fraction=1.0, burst=10))
    a.budget.tokens = 10.0
    for k in ("x", "y"):
        a.add_lane(k, Pace())
        a.open_lane(k)
    assert a.plan(0.0) == {"x": [0, 2], "y": [1, 3]}
    a.lanes["y"].pace.latencies.append(0.1)
    hedges, _ = a.check(10.0)  # batch 0, the one the loop waits for, is 10 s old
    assert hedges == {"y": [0, 2]} and a.lanes["x"].stalled  # (chase: x's other batch too)
    arrival = a.arrived("y", 0, 10.1)
    assert arrival.keep and arrival.revoke == {}, "a stalled lane's oldest grant stays as its probe"
    arrival = a.arrived("y", 2, 10.2)
    assert arrival.keep and arrival.revoke == {"x": [2]}
    assert not a.arrived("x", 0, 12.0).keep  # the probe's copy, dropped ...
    assert not a.lanes["x"].stalled  # ... says the lane lives again
    figures = a.figures()
    assert (figures["y"]["hedges_issued"], figures["y"]["hedges_won"], figures["x"]["duplicates"]) == (2, 2, 1)


def test_a_hedge_in_flight_on_a_lane_marked_down_is_given_to_another_and_its_copy_never_wins():
    a = Assigner(0, 100, floor=1, policy=HedgePolicy(warmup=1, max_fraction=1.0))
    a.budget.tokens = 5.0
    for k in ("slow", "hedger", "third"):
        a.add_lane(k, Pace())
        a.open_lane(k)
    assert a.plan(0.0) == {"slow": [0], "hedger": [1], "third": [2]}
    for k, b in (("hedger", 1), ("third", 2)):
        a.arrived(k, b, 0.1)
        a.lanes[k].pace.latencies.append(0.1)
    hedges, _ = a.check(5.0)
    (hedged_on,) = hedges
    assert hedges[hedged_on] == [0]
    a.remove_lane(hedged_on)  # marked down (e.g. it came back serving other data)
    assert not a.arrived(hedged_on, 0, 5.1).keep, "a copy from a server marked down won"
    hedges, _ = a.check(5.2)  # still late, still on a stalled lane: hedged again, elsewhere
    assert list(hedges) not in ([hedged_on], ["slow"]) and sum(hedges.values(), []) == [0]


# --- the call's outbox ---------------------------------------------------------------------------------


def test_the_outbox_opens_then_sends_grants_at_once_and_batches_releases():
    sent, unsent = [], []
    outbox = Outbox(pb.StreamBatchesRequest(dataset="d"), sent=sent.extend, unsent=unsent.extend,
                    release_delay=0.05)
    messages = iter(outbox)
    assert next(messages).open.dataset == "d"
    outbox.grant([0, 1])
    outbox.release(7)
    m = next(messages)
    assert list(m.grant) == [0, 1] and list(m.release) == [7] and sent == [7]  # (told as it is handed to gRPC)
    for lease in (8, 9):
        outbox.release(lease)
    m = next(messages)  # releases alone wait a moment for company: one message for both
    assert list(m.release) == [8, 9] and not m.grant
    outbox.revoke([1])
    outbox.close()
    m = next(messages)
    assert list(m.revoke) == [1] and m.done, "the last message of a closed call does not say done"
    with pytest.raises(StopIteration):
        next(messages)
    assert outbox.release(10) is False, "a closed outbox took a release it will never send"

    outbox = Outbox(pb.StreamBatchesRequest())  # closing with nothing queued still says done
    messages = iter(outbox)
    next(messages)
    outbox.close()
    assert next(messages) == pb.BatchesControl(done=True)
    with pytest.raises(StopIteration):
        next(messages)


def test_once_it_released_a_lease_a_grant_waits_a_moment_for_the_next_release():
    """A loop that takes batch b (a grant) lets go of batch b - 1 just after (a release): on a
    call that releases leases, both go in one message instead of two. Before the first release
    (the epoch's first window, or an inline call that never releases) grants go at once, as do
    revokes; a grant alone still goes after ``release_delay``. (A delay of 5 s tells "at once"
    from "waited" by a margin no loaded machine closes.)"""
    outbox = Outbox(pb.StreamBatchesRequest(), release_delay=5.0)
    messages = iter(outbox)
    next(messages)
    outbox.grant([0, 1])
    t0 = time.monotonic()
    assert list(next(messages).grant) == [0, 1] and time.monotonic() - t0 < 2.5, "a grant waited with no release yet"
    outbox.release(7)
    assert list(next(messages).release) == [7]
    outbox.grant([2])
    threading.Timer(0.05, outbox.release, args=(8,)).start()  # the release comes after the grant
    m = next(messages)
    assert list(m.grant) == [2] and list(m.release) == [8], "the grant did not wait for the release"
    outbox.revoke([2])
    t0 = time.monotonic()
    assert list(next(messages).revoke) == [2] and time.monotonic() - t0 < 2.5, "a revoke waited"
    outbox.abort()

    outbox = Outbox(pb.StreamBatchesRequest(), release_delay=0.05)
    messages = iter(outbox)
    next(messages)
    outbox.release(9)
    next(messages)
    outbox.grant([3])  # no release comes: the grant goes alone once release_delay has passed
    t0 = time.monotonic()
    m = next(messages)
    assert list(m.grant) == [3] and not m.release and time.monotonic() - t0 >= 0.05
    outbox.abort()


def test_an_aborted_outbox_hands_back_what_it_never_sent():
    unsent = []
    outbox = Outbox(pb.StreamBatchesRequest(), unsent=unsent.extend)
    messages = iter(outbox)
    next(messages)
    outbox.release(5)
    outbox.release(6)
    outbox.abort()
    assert sorted(unsent) == [5, 6]
    with pytest.raises(StopIteration):  # and no `done`: the server counts an aborted call cancelled
        next(messages)


def test_the_outbox_reports_progress_while_it_changes_and_once_more_at_the_end():
    reports = queue.SimpleQueue()
    count = iter(range(1, 100))

    def progress(force=False):
        p = pb.StreamProgress(batches_taken=next(count))
        reports.put(force)
        return p

    outbox = Outbox(pb.StreamBatchesRequest(), progress=progress, progress_every=0.0)
    messages = iter(outbox)
    next(messages)
    outbox.grant([3])
    assert next(messages).progress.batches_taken == 1
    outbox.close()
    assert next(messages).progress.batches_taken == 2 and reports.get() is False and reports.get() is True
