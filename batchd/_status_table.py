"""``batchd status``: a server's ``StatsResponse`` as a plain-text table.

Per stream, TAKEN and IMAGES/S are what the client's training loop took (as the client reports
it; "-" when it reports nothing), SENT and SENT/S what was handed to gRPC, which buffers ahead.
"""

from __future__ import annotations

from batchd.v1 import loader_pb2 as pb

_COLUMNS = (
    # header, right-aligned
    ("STREAM", True), ("CLIENT", False), ("DATASET", False), ("PIPELINE", False), ("BATCH", True),
    ("EPOCH", True), ("RANK", True), ("TAKEN", True), ("IMAGES/S", True), ("SENT", True), ("SENT/S", True),
    ("AHEAD", True), ("WAITING", True), ("TRANSPORT", False), ("SHARED", False), ("BYTES", True), ("COPIED", True),
    ("SKIPPED", True),
)


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def human_duration(s: float) -> str:
    s = int(s)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


def _peer(peer: str) -> str:
    for prefix in ("ipv4:", "ipv6:"):
        if peer.startswith(prefix):
            return peer[len(prefix):]
    return peer or "-"


def _row(s: pb.StreamStats) -> list[str]:
    reports = s.batches_taken > 0 or s.images_per_second > 0  # the client says what it took
    return [
        str(s.id), _peer(s.peer), s.dataset, s.pipeline, str(s.batch_size), str(s.epoch),
        f"{s.rank}/{s.world_size}", f"{s.batches_taken}/{s.num_batches}" if reports else f"-/{s.num_batches}",
        f"{s.images_per_second:,.1f}" if reports else "-", str(s.batches_sent), f"{s.images_per_second_sent:,.1f}",
        f"{s.batches_in_flight + s.batches_ready}/{s.prefetch}",
        f"{s.waiting_seconds:.1f}s" if s.waiting_seconds >= 0.1 else "-",
        s.transport, "yes" if s.shared else "no", human_bytes(s.bytes_sent), human_bytes(s.bytes_copied),
        str(s.samples_skipped),
    ]


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, (h, _) in enumerate(_COLUMNS)]
    out = []
    for r in [[h for h, _ in _COLUMNS], *rows]:
        cells = [c.rjust(w) if right else c.ljust(w) for c, w, (_, right) in zip(r, widths, _COLUMNS)]
        out.append("  ".join(cells).rstrip())
    return out


def format_status(reply: pb.StatsResponse, address: str) -> str:
    """A few summary lines, then one row per open stream."""
    p, t = reply.pool, reply.totals
    lines = [
        f"batchd {reply.version or '?'} at {address}, up {human_duration(reply.uptime_seconds)}",
        f"workers:  {p.ready}/{p.workers} ready, {p.busy} busy, utilization {p.utilization:.0%}, "
        f"{p.restarts} restarts; {p.tasks_in_flight} batches queued",
        f"memory:   {p.slots_in_use}/{p.max_slots} shm slots in use ({human_bytes(p.shm_bytes)} of slots in all), "
        f"{p.leases_held} lent to {p.sessions} sessions",
        f"totals:   {t.streams_started} streams started ({t.streams_finished} finished, {t.streams_failed} failed, "
        f"{t.streams_cancelled} cancelled, {len(reply.streams)} open); {t.batches_sent:,} batches, "
        f"{t.samples_sent:,} images, {human_bytes(t.bytes_sent)} sent; {t.samples_skipped:,} samples skipped",
        f"copies:   {human_bytes(t.bytes_copied_inline)} copied into inline messages, "
        f"{human_bytes(t.bytes_copied_shm)} for shared-memory streams (0: every batch lent in place)",
        *([f"data:     {human_bytes(t.data_plane_bytes_sent)} sent on {t.data_connections_accepted:,} data "
           f"connections (remote clients' batch bytes beside their calls); {t.data_connections_refused:,} refused"]
          if t.data_connections_accepted or t.data_connections_refused else []),
        *([f"hedges:   {t.hedge_streams_started:,} hedged requests from clients of several servers; "
           f"{t.hedge_batches_built:,} batches built, {t.hedge_batches_sent:,} sent for them"]
          if t.hedge_streams_started else []),
        *(f"cache:    {c.dataset}: {c.hits:,} hits ({c.hits_disk:,} from disk), {c.misses:,} misses; "
          f"{human_bytes(c.bytes_ram)} in RAM, {human_bytes(c.bytes_disk)} on disk; {c.evictions:,} evicted, "
          f"{c.not_admitted:,} not admitted" for c in reply.cache),
        "",
    ]
    if reply.streams:
        lines += table([_row(s) for s in reply.streams])
    else:
        lines.append("no open streams")
    return "\n".join(lines)
