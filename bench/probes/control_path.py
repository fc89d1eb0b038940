"""The control path per batch (issue 26): the server main process's CPU and its control calls and
messages per batch, StreamBatches (a ReleaseLeases call per batch, as today's client) against the
Batches call (grants, releases and progress on the call).

    python -m bench.probes.control_path [--epochs N] [--batch-size B ...] [--window W]

One ``batchd serve`` process (bench/fixtures/server_proc.py), 2 workers, Fashion-MNIST's test split
without a pipeline (the workers are not the bottleneck), shared memory. The client here is the
wire protocol by hand (no batchd.client), so the figures are the server's alone:

* StreamBatches: prefetch W; each batch's lease released by one ReleaseLeases call as it arrives;
* Batches: W batches granted ahead; each received batch is answered by one BatchesControl that
  grants the next index and releases its lease.

CPU is the server main process's utime + stime (/proc, threads that ended included; workers are
other processes), over whole epochs after a first one that warms up, median of the epochs. The
counts come from ``StatsTotals`` (describe/list/release/stats calls, control messages) divided by
the batches sent. On a shared machine the CPU figures move by 10-20 %; the counts do not.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import queue
import statistics
import tempfile
import uuid

import grpc

from batchd.v1 import loader_pb2 as pb
from batchd.v1 import loader_pb2_grpc
from bench.fixtures.server_proc import ServerProcess

FMNIST = pathlib.Path("/usr/share/datasets/fashion-mnist")
COUNTED = ("release_leases_calls", "describe_dataset_calls", "list_datasets_calls", "stats_calls", "control_messages")


def cpu_seconds(pid: int) -> float:
    """utime + stime of process ``pid`` (all its threads, ended ones included), seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stream_epoch(stub, session: str, request: dict, window: int) -> int:
    n = 0
    for batch in stub.StreamBatches(pb.StreamBatchesRequest(**request, prefetch=window, session=session,
                                                            transport=pb.TRANSPORT_SHARED_MEMORY), timeout=600):
        n += 1
        if batch.lease:
            stub.ReleaseLeases(pb.ReleaseLeasesRequest(session=session, leases=[batch.lease]), timeout=30)
    return n


def batches_epoch(stub, session: str, request: dict, window: int) -> int:
    controls: queue.Queue = queue.Queue()
    controls.put(pb.BatchesControl(open=pb.StreamBatchesRequest(**request, session=session,
                                                                transport=pb.TRANSPORT_SHARED_MEMORY),
                                   grant=range(window)))

    def requests():
        while (msg := controls.get()) is not None:
            yield msg

    n, granted = 0, window
    for batch in stub.Batches(requests(), timeout=600):
        n += 1
        msg = pb.BatchesControl(release=[batch.lease] if batch.lease else [])
        if granted < batch.num_batches:
            msg.grant.append(granted)
            granted += 1
        msg.done = n == batch.num_batches  # the last: every lease goes back on it, then the half-close
        controls.put(msg)
        if msg.done:
            controls.put(None)
    return n


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--epochs", type=int, default=4, help="measured epochs per row (after one warm-up epoch)")
    ap.add_argument("--batch-size", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--window", type=int, default=8, help="StreamBatches prefetch / Batches grants ahead")
    args = ap.parse_args(argv)
    calls = {"StreamBatches": stream_epoch, "Batches": batches_epoch}
    rows = []
    with tempfile.TemporaryDirectory(prefix="batchd-bench-") as tmp, ServerProcess(
            datasets={"f": {"kind": "fashion-mnist", "root": str(FMNIST), "split": "test"}}, workers=2,
            cache_dir=tmp, extra={"max_leases_per_session": 4 * args.window}) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            stub = loader_pb2_grpc.BatchLoaderStub(channel)
            session = uuid.uuid4().hex
            events = stub.OpenSession(pb.OpenSessionRequest(session=session))
            next(events)
            for bs in args.batch_size:
                for name, epoch in calls.items():
                    cpu, counts, sent = [], dict.fromkeys(COUNTED, 0), 0
                    for e in range(args.epochs + 1):
                        request = dict(dataset="f", batch_size=bs, shuffle=True, seed=1, epoch=e)
                        t0, c0 = cpu_seconds(srv.pid), stub.Stats(pb.StatsRequest(), timeout=30).totals
                        n = epoch(stub, session, request, args.window)
                        t1, c1 = cpu_seconds(srv.pid), stub.Stats(pb.StatsRequest(), timeout=30).totals
                        if e:  # the first epoch warms up
                            cpu.append((t1 - t0) / n)
                            sent += n
                            for k in COUNTED:
                                counts[k] += getattr(c1, k) - getattr(c0, k) - (k == "stats_calls")
                    rows.append((name, bs, sent, statistics.median(cpu) * 1e3,
                                 counts["release_leases_calls"] / sent, counts["control_messages"] / sent,
                                 (counts["describe_dataset_calls"] + counts["list_datasets_calls"]) / sent))
            events.cancel()
    print(f"Server main-process CPU and control work per batch (shared memory, window {args.window}, "
          f"median of {args.epochs} epochs)\n")
    print(f"| call | batch size | batches | CPU ms/batch | ReleaseLeases/batch | control messages/batch "
          f"| describe+list/batch |")
    print("|---|---|---|---|---|---|---|")
    for name, bs, sent, ms, rel, msgs, desc in rows:
        print(f"| {name} | {bs} | {sent} | {ms:.3f} | {rel:.2f} | {msgs:.2f} | {desc:.3f} |")


if __name__ == "__main__":
    main()
