"""The Prometheus endpoint (``metrics_port`` / ``batchd serve --metrics-port``).

A custom collector turns ``stats.snapshot(loader)`` into metric families on each scrape: nothing
is counted twice and no thread runs between scrapes. Names follow Prometheus conventions
(``batchd_`` prefix, base units, ``_total`` for counters, ``_ratio`` for 0..1 gauges). Per-stream
series carry the labels ``stream`` (its id), ``dataset``, ``pipeline``, ``rank`` and ``transport``;
they disappear when the stream ends, and the server-wide ``batchd_*_total`` counters keep counting
what closed streams sent.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.exposition import start_http_server
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from batchd.server.serve import stats

if TYPE_CHECKING:
    from batchd.server.loader import Loader

log = logging.getLogger(__name__)

_STREAM_LABELS = ("stream", "dataset", "pipeline", "rank", "transport")

# (name, help, StreamStats attribute) of the per-stream series
_STREAM_COUNTERS = (
    ("batchd_stream_batches_sent", "Batches handed to gRPC for the stream's client (gRPC buffers ahead).", "batches_sent"),
    ("batchd_stream_samples_sent", "Samples (images) handed to gRPC for the stream's client.", "samples_sent"),
    ("batchd_stream_bytes_sent", "gRPC message bytes sent to the stream's client.", "bytes_sent"),
    ("batchd_stream_batches_taken", "Batches the stream's client handed to its training loop (as it reports).",
     "batches_taken"),
    ("batchd_stream_samples_taken", "Samples the stream's client handed to its training loop (as it reports).",
     "samples_taken"),
    ("batchd_stream_bytes_copied", "Batch bytes copied out of shared-memory slots for the stream (0: all lent).",
     "bytes_copied"),
    ("batchd_stream_samples_skipped", "Unreadable samples left out of the stream's batches.", "samples_skipped"),
    ("batchd_stream_data_bytes_sent", "Bytes written on the stream's data connection (socket transport: "
     "headers, payloads, padding).", "data_bytes_sent"),
)
_STREAM_GAUGES = (
    ("batchd_stream_images_per_second", "Samples the client took per second, moving rate over about 10 s "
     "(0 when the client reports nothing).", "images_per_second"),
    ("batchd_stream_images_per_second_sent", "Samples handed to gRPC per second, moving rate over about 10 s.",
     "images_per_second_sent"),
    ("batchd_stream_batches_ahead", "Batches built or being built ahead of the client (<= prefetch).", "batches_ahead"),
    ("batchd_stream_batches_in_flight", "Batches of the stream being built by workers.", "batches_in_flight"),
    ("batchd_stream_batches_ready", "Built batches waiting in the stream's reorder buffer.", "batches_ready"),
    ("batchd_stream_prefetch", "Batches the stream may have ahead.", "prefetch"),
    ("batchd_stream_batches", "Batches in the stream's epoch (for its shard).", "num_batches"),
    ("batchd_stream_next_batch", "The batch index the stream's client gets next.", "next_batch"),
    ("batchd_stream_waiting_seconds", "How long the stream has been waiting for its next batch (0: not waiting).",
     "waiting_seconds"),
    ("batchd_stream_age_seconds", "Seconds since the stream opened.", "age_seconds"),
)
# only for streams whose client reports its training loop's wait (StreamProgress.wait_ratio)
_STREAM_WAIT = ("batchd_stream_data_wait_ratio", "Fraction of the client's training-loop time spent waiting for "
                "this stream's batches, as the client reports it (moving over about 10 s).")


class StatsCollector(Collector):
    """Builds every batchd metric from one ``snapshot(loader)`` per scrape."""

    def __init__(self, loader: "Loader"):
        self.loader = loader

    def collect(self):
        s = stats.snapshot(self.loader)
        yield from _server_families(s)
        yield from _pool_families(s)
        yield from _cache_families(s.cache)
        yield from _stream_families(s.streams)


def _gauge(name, doc, value):
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name, doc, value):
    return CounterMetricFamily(name, doc, value=value)


def _server_families(s: "stats.ServerStats"):
    """Streams, what they sent, the data plane, hedged requests, the control path and computations,
    over the server's life (open and closed streams)."""
    t = s.totals
    yield _gauge("batchd_uptime_seconds", "Seconds since the server started.", s.uptime_seconds)
    yield _gauge("batchd_streams", "Open streams (StreamBatches and Batches calls).", len(s.streams))
    yield _gauge("batchd_streams_shared", "Open streams computed once for several identical clients.",
                 sum(1 for st in s.streams if st.shared))
    yield _counter("batchd_streams_started", "Streams opened.", t.streams_started)
    ended = CounterMetricFamily("batchd_streams_ended", "Streams closed, by outcome.", labels=["outcome"])
    ended.add_metric(["finished"], t.streams_finished)
    ended.add_metric(["failed"], t.streams_failed)
    ended.add_metric(["cancelled"], t.streams_cancelled)
    yield ended
    yield _counter("batchd_batches_sent", "Batches sent, all streams.", t.batches_sent)
    yield _counter("batchd_samples_sent", "Samples (images) sent, all streams.", t.samples_sent)
    yield _counter("batchd_bytes_sent", "gRPC message bytes of batches sent, all streams.", t.bytes_sent)
    yield _counter("batchd_samples_skipped", "Unreadable samples left out of batches, all streams.", t.samples_skipped)
    copied = CounterMetricFamily("batchd_bytes_copied", "Batch bytes copied out of shared-memory slots, by the "
                                 "stream's transport (shm: inline fallbacks; 0 while every batch is lent; socket: "
                                 "payloads on data connections).",
                                 labels=["transport"])
    copied.add_metric(["shm"], t.bytes_copied_shm)
    copied.add_metric(["inline"], t.bytes_copied_inline)
    copied.add_metric(["socket"], t.bytes_copied_socket)
    yield copied
    yield _counter("batchd_data_plane_bytes_sent", "Bytes written on data connections (socket transport: "
                   "headers, payloads, padding), all streams.", t.data_plane_bytes_sent)
    conns = CounterMetricFamily("batchd_data_connections", "Data connections, by outcome (refused: no, a wrong, "
                                "reused or late token, or a failed TLS handshake).", labels=["outcome"])
    conns.add_metric(["accepted"], t.data_connections_accepted)
    conns.add_metric(["refused"], t.data_connections_refused)
    yield conns
    yield _counter("batchd_hedge_streams_started", "Hedged requests opened (a client of several servers "
                   "re-requesting one late batch here).", t.hedge_streams_started)
    yield _counter("batchd_hedge_batches_built", "Batches workers built for hedged requests.", t.hedge_batches_built)
    yield _counter("batchd_hedge_batches_sent", "Batches sent on hedged requests.", t.hedge_batches_sent)
    rpcs = CounterMetricFamily("batchd_control_rpcs", "Unary calls served, by method (the control path; "
                               "divide by batchd_batches_sent_total for a per-batch cost).", labels=["method"])
    for method, value in (("DescribeDataset", t.describe_dataset_calls), ("ListDatasets", t.list_datasets_calls),
                          ("ReleaseLeases", t.release_leases_calls), ("Stats", t.stats_calls),
                          ("PutWeights", t.put_weights_calls)):
        rpcs.add_metric([method], value)
    yield rpcs
    yield _counter("batchd_weights_bytes_received", "Weight bytes received by PutWeights (weighted sampling: "
                   "sent once per loader and server process).", t.weights_bytes_received)
    yield _counter("batchd_batches_calls_started", "Batches calls opened (also counted in batchd_streams_started).",
                   t.batches_calls_started)
    yield _counter("batchd_control_messages", "BatchesControl messages received on Batches calls (the open "
                   "included).", t.control_messages)
    yield _counter("batchd_control_frames", "Control frames (grants, revokes, progress) read on data connections "
                   "instead of Batches calls.", t.control_frames)
    yield _counter("batchd_data_messages", "Batch messages sent on data connections in front of their payloads "
                   "instead of on Batches calls.", t.data_messages)
    yield _counter("batchd_batches_granted", "Batch indices granted on Batches calls.", t.batches_granted)
    yield _counter("batchd_batches_revoked", "Batch indices revoked on Batches calls before they were sent.",
                   t.batches_revoked)
    released = CounterMetricFamily("batchd_leases_released", "Shared-memory leases released by clients, by "
                                   "how (call: on a Batches call; rpc: ReleaseLeases).", labels=["via"])
    released.add_metric(["call"], t.leases_released_on_calls)
    released.add_metric(["rpc"], t.leases_released_by_rpc)
    yield released
    yield _gauge("batchd_computations", "Running computations (identical streams share one).", s.computations)
    yield _counter("batchd_computations_started", "Computations started.", s.computations_started)


def _pool_families(s: "stats.ServerStats"):
    """The worker processes, their sizing and scheduler, the batches' stages, and the shared-memory slots."""
    p = s.pool
    yield _gauge("batchd_workers", "Configured worker processes.", p.workers)
    yield _gauge("batchd_workers_ready", "Worker processes started and answering.", p.ready)
    yield _gauge("batchd_workers_busy", "Worker processes with a batch assigned now.", p.busy)
    yield _counter("batchd_worker_restarts", "Worker processes that died and were replaced.", p.restarts)
    yield _counter("batchd_batches_rebuilt", "Batches in flight on a worker that died, queued again for another.",
                   p.batches_rebuilt)
    yield _counter("batchd_worker_busy_seconds", "Seconds workers spent building batches (read, decode, "
                   "pipeline, cache, write).",
                   p.busy_seconds)
    yield _gauge("batchd_worker_utilization_ratio",
                 "Fraction of worker time spent building batches, moving over about 10 s.", p.utilization)
    yield _gauge("batchd_workers_busy_ratio", "Fraction of the workers' time with a batch to build, moving over "
                 "about 10 s (the same as batchd_worker_utilization_ratio; scale on it).", p.utilization)
    yield _gauge("batchd_trainer_data_wait_ratio", "Mean fraction of their training loop's time the clients of "
                 "the open streams spend waiting for data, as they report it (0 when none reports).",
                 s.trainer_data_wait_ratio)
    yield _gauge("batchd_workers_min", "The fewest workers the pool runs (config workers, or workers.min).",
                 p.min_workers)
    yield _gauge("batchd_workers_max", "The most workers the pool runs (workers.max capped by the CPU quota).",
                 p.max_workers)
    yield _gauge("batchd_workers_cpu_quota", "CPUs the workers may use (the cgroup limit, else the CPUs "
                 "available); 0 for a fixed pool.", p.cpu_quota)
    scaling = CounterMetricFamily("batchd_worker_scaling", "Workers started (direction up, reason "
                                  "clients_waiting) and retired (down, idle) by the pool's sizing.",
                                  labels=["direction", "reason"])
    for direction, reason in (("up", "clients_waiting"), ("down", "idle")):
        scaling.add_metric([direction, reason], (s.scaling or {}).get((direction, reason), 0))
    yield scaling
    for name, doc, value in _scheduler_counters(p):
        yield _counter(name, doc, value)
    per_worker = GaugeMetricFamily("batchd_worker_busy_ratio", "Fraction of a worker's time with a batch to "
                                   "build, moving over about 10 s.", labels=["worker"])
    for w in p.worker_stats:
        per_worker.add_metric([str(w.id)], w.busy_ratio)
    yield per_worker
    stages = CounterMetricFamily("batchd_batch_stage_seconds", "Seconds of each stage of the batches sent "
                                 "(BatchTimings: queued, read, decode, pipeline, cache, write, reorder, send; "
                                 "read_io overlaps the others).", labels=["stage"])
    for stage, seconds in (s.stage_seconds or {}).items():
        stages.add_metric([stage], seconds)
    yield stages
    decodes = CounterMetricFamily("batchd_decodes", "Images decoded for the batches sent, by kind: full (full size), "
                                  "scaled (whole, at m/8 for a first resize), region (at the m/8 a first random "
                                  "crop's window needs), indexed (a region cut from the image's indexed JPEG in "
                                  "the cache).", labels=["kind"])
    for kind, n in (s.decodes or {}).items():
        decodes.add_metric([kind], n)
    yield decodes
    yield _counter("batchd_decoded_pixels", "Pixels decoded for the batches sent (width x height of each decode).",
                   s.decoded_pixels)
    yield _gauge("batchd_tasks_in_flight", "Batches sent to workers and not back yet (the work queue).",
                 p.tasks_in_flight)
    yield _gauge("batchd_shm_slots_in_use", "Shared-memory slots holding a batch (lent slots not included).",
                 p.slots_in_use)
    yield _gauge("batchd_shm_slots_max", "The cap on shared-memory slots (max_slots).", p.max_slots)
    yield _gauge("batchd_shm_bytes", "Bytes of shared-memory slots, held by the server or lent to clients.", p.shm_bytes)
    yield _gauge("batchd_leases_held", "Shared-memory slots lent to same-host clients.", p.leases_held)
    yield _gauge("batchd_sessions", "Open shared-memory sessions.", p.sessions)


def _stream_families(streams: "tuple[stats.StreamStats, ...]"):
    """The per-stream series (labels ``_STREAM_LABELS``), gone when their stream ends."""
    families = [CounterMetricFamily(n, d, labels=_STREAM_LABELS) for n, d, _ in _STREAM_COUNTERS]
    families += [GaugeMetricFamily(n, d, labels=_STREAM_LABELS) for n, d, _ in _STREAM_GAUGES]
    attrs = [a for _, _, a in _STREAM_COUNTERS + _STREAM_GAUGES]
    wait = GaugeMetricFamily(*_STREAM_WAIT, labels=_STREAM_LABELS)
    for st in streams:
        labels = [str(st.id), st.dataset, st.pipeline, str(st.rank), st.transport]
        for family, attr in zip(families, attrs):
            family.add_metric(labels, getattr(st, attr))
        if st.reports_wait:
            wait.add_metric(labels, st.wait_ratio)
    yield from families
    yield wait



def _scheduler_counters(p: "stats.PoolStats"):
    """(name, help, value) of the pool scheduler's own work (the server's main process); divided by
    batchd_batches_sent_total they are its cost per batch (docs/tuning-control-path.md)."""
    return (
        ("batchd_scheduler_rounds", "Rounds the worker pool's scheduler ran (in steady state at most 2 per batch).",
         p.scheduler_rounds),
        ("batchd_scheduler_waits", "Times the scheduler blocked on its selector.", p.scheduler_waits),
        ("batchd_scheduler_timeouts", "Scheduler waits that ended with nothing to do (about 2 a second when idle).",
         p.scheduler_timeouts),
        ("batchd_scheduler_wakeups", "Wake-ups other threads wrote to the scheduler (those that could let it "
         "dispatch).", p.scheduler_wakeups),
        ("batchd_scheduler_dispatch_passes", "Scheduler rounds that tried to send tasks (the others only received "
         "built batches while no stream or slot was free).", p.scheduler_passes),
        ("batchd_scheduler_tasks_sent", "Tasks (batches to build) the scheduler sent to workers.",
         p.scheduler_dispatches),
    )


def _cache_families(cache):
    """The decoded-sample cache, per dataset (tier: ram or disk). Nothing without a cache."""
    if not cache:
        return
    hits = CounterMetricFamily("batchd_cache_hits", "Samples served from the cache, by tier.", labels=["dataset", "tier"])
    size = GaugeMetricFamily("batchd_cache_bytes", "Bytes of cache entries, by tier.", labels=["dataset", "tier"])
    misses = CounterMetricFamily("batchd_cache_misses", "Samples computed (not in the cache).", labels=["dataset"])
    evicted = CounterMetricFamily("batchd_cache_evictions", "Cache entries dropped (found corrupt).", labels=["dataset"])
    left = CounterMetricFamily("batchd_cache_not_admitted", "Computed samples the full cache did not take.",
                               labels=["dataset"])
    for c in cache:
        hits.add_metric([c.dataset, "ram"], c.hits - c.hits_disk)
        hits.add_metric([c.dataset, "disk"], c.hits_disk)
        size.add_metric([c.dataset, "ram"], c.bytes_ram)
        size.add_metric([c.dataset, "disk"], c.bytes_disk)
        misses.add_metric([c.dataset], c.misses)
        evicted.add_metric([c.dataset], c.evictions)
        left.add_metric([c.dataset], c.not_admitted)
    yield from (hits, misses, size, evicted, left)


class MetricsServer:
    """``/metrics`` over HTTP on ``host:port`` (port 0: a free one); ``address`` is the bound one.

    Raises RuntimeError if the port cannot be bound.
    """

    def __init__(self, loader: "Loader", host: str, port: int):
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(StatsCollector(loader))
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total, process_resident_memory_bytes, ...
        try:
            self._httpd, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise RuntimeError(f"cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
        bound = self._httpd.server_address[1]
        self.address = f"[{host}]:{bound}" if ":" in host else f"{host}:{bound}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5.0)


def metrics_host(grpc_address: str) -> str:
    """The host to serve metrics on: the gRPC address's host, 127.0.0.1 for a unix: address."""
    if grpc_address.startswith("unix:"):
        return "127.0.0.1"
    host = grpc_address.rpartition(":")[0]
    return host.strip("[]") or "0.0.0.0"
