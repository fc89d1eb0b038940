"""A training loop that keeps its last batches (a metric's window, a gradient accumulation) over
shared memory, at the server's lease cap (``max_leases_per_session``): the server lends a slot
per batch and, at the cap, holds the next batch back until the client frees one. Nothing here
may wait for a lease that only the batch held back could free (issue 36).

Two defects, each with the test that fails without its fix:
* freed leases waited for the request thread's 0.5 s poll (the consumer now sends them before
  it waits: ``ServerLink.send_freed``);
* the server built a later batch first and lent it the last lease: the batch the loop waited for
  then waited out the server's ``LEASE_WAIT_S`` (2 s) for a lease only it could free, and went
  inline. The client now grants past the batch the loop waits for only while its grants and
  every lease it holds leave that batch one (``Holder.room``).

Real servers on 127.0.0.1:0, in this process.
"""

from __future__ import annotations

import pathlib
import time

import pytest
import torch

import batchd
from batchd.server.serve.transport import WAIT_SLICE_S
from procs import fmnist_test_config

pytestmark = pytest.mark.timeout(180)

PYDATA = pathlib.Path(__file__).resolve().parent.parent / "pydata"
KEPT, CAP = 3, 4  # the loop keeps its last 3 batches; the server lends a session 4 slots


def _keep_last(address: str, dataset: str, batches: int, batch_size: int) -> tuple[list[float], torch.Tensor, dict]:
    """A loop that keeps its last ``KEPT`` batches: each batch's wait (s), the indices in the order
    taken, the loader's stats."""
    held, waits, indices = [], [], []
    with batchd.RemoteDataLoader(address, dataset, batch_size=batch_size, transport="shm", prefetch=2,
                                 timeout=60) as ld:
        it = iter(ld)
        for _ in range(batches):
            t0 = time.perf_counter()
            batch = next(it)
            waits.append(time.perf_counter() - t0)
            indices.append(batch["index"].clone())
            held = [*held[-(KEPT - 1):], batch]  # (the oldest goes: its lease is freed)
            del batch
        stats = ld.stats()
        it.close()
        held.clear()
    return waits, torch.cat(indices), stats


def test_freed_leases_never_wait_for_the_poll(make_server, fmnist_root):
    """Freed leases ride on the next grant's frame, and that grant waits for the batch: the
    consumer, about to wait, sends them itself (``ServerLink.send_freed``). Before it, every
    batch past the 5th waited for the request thread's 0.5 s poll (98 s for 200 batches of 50,
    against 2 s), and the server's wait for a lease ran a 0.25 s slice out (``WAIT_SLICE_S``) about
    once a batch. Each sample once; those slices counted by the server (``lease_waits_run_out``):
    a few at most (a loaded machine may stall a batch), not one a batch."""
    srv = make_server(datasets=fmnist_test_config(fmnist_root), workers=2, max_slots=2, max_leases_per_session=CAP,
                      share_window=0)
    before = int(srv.loader.counters.get("data_messages", 0))
    waits, indices, stats = _keep_last(srv.address, "fmnist-test", 60, 50)
    assert stats["bytes_received"]["shm"] > 0
    assert torch.equal(indices, torch.arange(60 * 50))
    assert int(srv.loader.counters.get("data_messages", 0)) - before >= 50  # (the data connection carried them)
    run_out = srv.loader.transport.lease_waits_run_out
    assert run_out <= 5, f"{run_out} lease waits of {WAIT_SLICE_S} s ran out in 60 batches: freed leases waited"


# batch 8 (samples 80..89) takes 0.4 s to read: the other worker builds batch 9 first
@pytest.mark.parametrize("data_plane", [True, False], ids=["data-connection", "call"])
def test_a_later_batch_built_first_never_takes_the_lease_the_next_one_needs(make_server, data_plane):
    """By construction: 2 workers, batch 8 slow, batch 9 fast. Granted both while the loop held 3
    of 4 leases, the server lent batch 9 the last one, and batch 8, which the loop waited for,
    waited 2 s for a lease and came inline (on either path of the messages). Now none comes
    inline (the server's lease wait never runs out), each sample once, in order."""
    paced = {"n": 200, "seconds": 0.0, "stall_at": 85, "stall_seconds": 0.4}
    srv = make_server(workers=2, python_path=[str(PYDATA)], share_window=0, max_leases_per_session=CAP,
                      data_plane={"enabled": data_plane},
                      datasets={"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": paced}})
    waits, indices, stats = _keep_last(srv.address, "paced", 20, 10)
    assert torch.equal(indices, torch.arange(200))
    slowest = max(range(len(waits)), key=waits.__getitem__)
    assert stats["bytes_received"]["inline"] == 0, (
        f"{stats['bytes_received']['inline']} bytes came inline (the longest wait: batch {slowest}, "
        f"{waits[slowest]:.2f} s; the stalled batch's own read is 0.4 s)")
    assert stats["bytes_received"]["shm"] > 0
