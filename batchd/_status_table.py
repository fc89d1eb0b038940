"""``batchd status``: a server's ``StatsResponse`` as a plain-text table."""

from __future__ import annotations

from batchd.v1 import loader_pb2 as pb

_COLUMNS = (
    # header, right-aligned
    ("STREAM", True), ("CLIENT", False), ("DATASET", False), ("PIPELINE", False), ("BATCH", True),
    ("EPOCH", True), ("RANK", True), ("PROGRESS", True), ("IMAGES/S", True), ("AHEAD", True),
    ("WAITING", True), ("TRANSPORT", False), ("SHARED", False), ("SENT", True), ("SKIPPED", True),
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
    progress = f"{s.next_batch}/{s.num_batches}"
    return [
        str(s.id), _peer(s.peer), s.dataset, s.pipeline, str(s.batch_size), str(s.epoch),
        f"{s.rank}/{s.world_size}", progress, f"{s.images_per_second:,.1f}",
        f"{s.batches_in_flight + s.batches_ready}/{s.prefetch}",
        f"{s.waiting_seconds:.1f}s" if s.waiting_seconds >= 0.1 else "-",
        s.transport, "yes" if s.shared else "no", human_bytes(s.bytes_sent), str(s.samples_skipped),
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
        "",
    ]
    if reply.streams:
        lines += table([_row(s) for s in reply.streams])
    else:
        lines.append("no open streams")
    return "\n".join(lines)
