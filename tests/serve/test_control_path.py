"""What the server's main process does per batch, counted (issue 26): the pool's scheduler runs at
most ``K`` rounds per batch in steady state, writes at most one wake-up per batch, and never
leaves a dispatch to a timeout (a lost wake-up). Counts, not times: a real server (2 workers) and
a real client over shared memory, the server's own counters (``PoolStats.scheduler_*``).

Why K = 2 (``server/compute/pool.py``): a batch brings the round of its worker's answer; the
dispatch of that round ends on what it lacked, and only a wake for that (its stream taking a
batch, or a slot coming back) runs one more. Every other wake is noted, not signalled.
"""

from __future__ import annotations

import pytest

import batchd
from batchd.client.transport.server_stats import get_stats
from procs import fmnist_test_config

pytestmark = pytest.mark.timeout(120)

K = 2  # scheduler rounds per batch, at most, in steady state
PREFETCH = 4
BATCHES = 100


@pytest.mark.parametrize("transport", ["shm", "inline"])
def test_a_batch_costs_at_most_two_scheduler_rounds(make_server, fmnist_root, transport):
    server = make_server(workers=2, datasets=fmnist_test_config(fmnist_root))
    pool = server.loader.pool
    with batchd.RemoteDataLoader(server.address, "fmnist-test", batch_size=64, shuffle=True, seed=3,
                                 transport=transport, prefetch=PREFETCH, timeout=60, connect_timeout=10) as loader:
        it = iter(loader)
        for _ in range(2 * PREFETCH):  # the stream is open and the workers are busy: steady state from here
            next(it)
        before, late = get_stats(server.address), pool.counts.late
        for _ in range(BATCHES):
            next(it)
        after = get_stats(server.address)
        late = pool.counts.late - late
        it.close()

    def delta(name: str) -> int:
        return getattr(after.pool, name) - getattr(before.pool, name)

    # batches built in the window (one task each: nothing was rebuilt). Not batches_sent: gRPC takes
    # shared-memory batches far ahead of the client, so the server's window is not the client's
    batches = delta("scheduler_dispatches")
    rounds, timeouts, wakeups = delta("scheduler_rounds"), delta("scheduler_timeouts"), delta("scheduler_wakeups")
    counts = {"batches": batches, "rounds": rounds, "timeouts": timeouts, "wakeups": wakeups,
              "waits": delta("scheduler_waits"), "passes": delta("scheduler_passes"), "late": late}
    assert batches >= BATCHES // 2, counts  # the window saw steady work
    # the window's edges: up to PREFETCH batches were in flight when it began, and as many when it ended
    assert rounds - timeouts <= K * batches + PREFETCH, counts
    assert wakeups <= batches + PREFETCH, counts  # the stream's and the slots' wakes: at most one written
    assert counts["waits"] <= rounds and counts["passes"] <= rounds, counts
    assert late == 0, counts  # every dispatch followed the event that allowed it, none a timeout
