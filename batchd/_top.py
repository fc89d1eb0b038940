"""``batchd top ADDRESS``: a server's live figures in the terminal (rich), refreshed every second.

One frame is a summary line (workers and their bounds, busy ratio, shared-memory slots, bytes
sent, cache hit rate), a row per open stream (dataset, client, batches/s, the client's wait
fraction and profile verdict, as it reports them; "-" for a client that reports nothing) and a
row per worker (busy ratio, what it is doing now). Everything comes from one Stats call per
frame (``batchd.client.transport.server_stats.get_stats``), the RPC ``batchd status`` uses.
"""

from __future__ import annotations

import sys
import time
from typing import Callable

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from batchd._status_table import _peer, human_bytes, human_duration
from batchd.v1 import loader_pb2 as pb

_VERDICT_STYLE = {"trainer-bound": "green", "cpu-bound": "yellow", "storage-bound": "yellow",
                  "transport-bound": "magenta", "copy-bound": "magenta"}


def cache_hit_rate(reply: pb.StatsResponse) -> float | None:
    """Samples served from the cache / samples looked up, over every dataset (None without a cache)."""
    hits = sum(c.hits for c in reply.cache)
    looked_up = hits + sum(c.misses for c in reply.cache)
    return hits / looked_up if looked_up else None


def frame(reply: pb.StatsResponse, address: str) -> Group:
    """One view of ``reply``: summary, streams, workers, cache."""
    p, t = reply.pool, reply.totals
    bounds = f"{p.min_workers}-{p.max_workers}" if p.max_workers > p.min_workers else f"{p.workers}"
    quota = f", cpu quota {p.cpu_quota:g}" if p.cpu_quota else ""
    hit = cache_hit_rate(reply)
    summary = Text.assemble(
        (f"batchd {reply.version or '?'}", "bold"), f" at {address}, up {human_duration(reply.uptime_seconds)}\n",
        f"workers {p.ready}/{p.workers} ready (of {bounds}{quota}; {p.scale_ups} started, {p.scale_downs} retired), ",
        (f"{p.utilization:.0%} busy", "bold"), f"; {p.tasks_in_flight} batches queued\n",
        f"slots {p.slots_in_use}/{p.max_slots} in use, {p.leases_held} lent to {p.sessions} sessions; ",
        f"{human_bytes(t.bytes_sent)} sent; cache hit rate {'-' if hit is None else f'{hit:.0%}'}",
    )
    streams = Table(title="streams", title_justify="left", expand=False)
    for name, justify in (("STREAM", "right"), ("DATASET", "left"), ("CLIENT", "left"), ("BATCHES/S", "right"),
                          ("WAIT", "right"), ("VERDICT", "left"), ("EPOCH", "right"), ("BATCH", "right"),
                          ("TRANSPORT", "left"), ("SENT", "right")):
        streams.add_column(name, justify=justify, no_wrap=True)
    for s in reply.streams:
        rate = (s.images_per_second if s.batches_taken or s.images_per_second else s.images_per_second_sent)
        streams.add_row(
            str(s.id), s.dataset, _peer(s.peer), f"{rate / max(1, s.batch_size):,.1f}",
            f"{s.wait_ratio:.0%}" if s.reports_wait else "-",
            Text(s.verdict or "-", style=_VERDICT_STYLE.get(s.verdict, "")), str(s.epoch),
            f"{s.next_batch}/{s.num_batches}", s.transport, human_bytes(s.bytes_sent))
    if not reply.streams:
        streams.add_row("", Text("no open streams", style="dim"), *[""] * 8)
    workers = Table(title="workers", title_justify="left", expand=False)
    for name, justify in (("WORKER", "right"), ("PID", "right"), ("BUSY", "right"), ("STAGE", "left"),
                          ("TASKS", "right")):
        workers.add_column(name, justify=justify, no_wrap=True)
    for w in reply.pool.worker_stats:
        workers.add_row(str(w.id), str(w.pid), f"{w.busy_ratio:.0%}", w.stage, str(w.tasks))
    parts = [summary, streams, workers]
    if reply.cache:
        cache = Table(title="cache", title_justify="left", expand=False)
        for name in ("DATASET", "HIT RATE", "HITS", "MISSES", "RAM", "DISK"):
            cache.add_column(name, justify="left" if name == "DATASET" else "right", no_wrap=True)
        for c in reply.cache:
            rate = c.hits / (c.hits + c.misses) if c.hits + c.misses else None
            cache.add_row(c.dataset, "-" if rate is None else f"{rate:.0%}", f"{c.hits:,}", f"{c.misses:,}",
                          human_bytes(c.bytes_ram), human_bytes(c.bytes_disk))
        parts.append(cache)
    return Group(*parts)


def run(address: str, fetch: Callable[[], pb.StatsResponse], *, once: bool, interval: float = 1.0,
        console: Console | None = None) -> int:
    """Show ``fetch()`` (a Stats call) every ``interval`` seconds until Ctrl-C, or once. Returns the
    exit code: 1 if the first call fails (its error on stderr), else 0. Later failures show in the
    view, which keeps refreshing (the server may come back)."""
    from batchd.errors import BatchdError

    console = console or Console(width=None if sys.stdout.isatty() else 160)
    try:
        reply = fetch()
    except (ConnectionError, TimeoutError, BatchdError) as e:
        print(f"batchd top: {e}", file=sys.stderr, flush=True)
        return 1
    if once:
        console.print(frame(reply, address))
        return 0
    try:
        with Live(frame(reply, address), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(interval)
                try:
                    reply = fetch()
                    live.update(frame(reply, address))
                except (ConnectionError, TimeoutError, BatchdError) as e:
                    live.update(Group(Text(f"batchd top: {e} (retrying every {interval:g} s)", style="red"),
                                      frame(reply, address)))
    except KeyboardInterrupt:
        return 0
