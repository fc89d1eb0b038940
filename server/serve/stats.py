"""Live figures of a running server: ``snapshot(loader)``, read by the Stats RPC and by Prometheus.

``snapshot`` only reads: the counters it reports are kept where the work happens (``Stream``:
batches/samples/bytes sent, what the client took, bytes copied, samples skipped; ``WorkerPool``:
restarts, worker seconds; ``Transport``: bytes copied per transport; ``Loader.counters``: streams
started and ended, the sent figures of closed streams, and the control path: unary calls served
by method, Batches calls' control messages, grants, revokes and leases released, so that a
benchmark or a test can put them per batch).

Sent and taken. ``batches_sent``/``samples_sent`` count what was handed to gRPC, which buffers
ahead of the client; ``batches_taken``/``samples_taken`` what the client's iterator handed to its
training loop, as the client reports it (ReleaseLeasesRequest.progress), or, for a client that
does not report, the shared-memory leases it released; 0 for a client that does neither. Nothing
runs in the background and nothing is counted twice; a Prometheus scrape and ``batchd status``
call the same function.

Rates. ``images_per_second`` (per stream, samples taken), ``images_per_second_sent`` and ``utilization`` (per pool) are exponentially weighted
moving rates over about ``RATE_WINDOW_S`` seconds (``RateMeter``, ``BusyClock``: server/compute/rates.py), so they describe the last few
seconds, not the whole life of a long stream. Prometheus users can also derive exact rates over
any window from the counters (``rate(batchd_stream_samples_sent_total[1m])``,
``rate(batchd_worker_busy_seconds_total[1m]) / batchd_workers``).

Thread safety: the loader's lock is held while its streams and counters are read (so a stream
closing at that moment is counted once, either as open or as closed); every other figure is an
int/float attribute or a ``len()``, atomic under the GIL. Worker processes are never polled
(``Process.is_alive`` from another thread would race the scheduler's own reaping).
"""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchd.server.loader import Loader
    from batchd.server.serve.stream import Stream


@dataclass(frozen=True, slots=True)
class StreamStats:
    """One open StreamBatches or Batches call."""

    id: int
    peer: str  # the client's address as gRPC reports it ("" if unknown)
    dataset: str
    pipeline: str  # preset name, "none", or "custom:<key prefix>"
    batch_size: int
    epoch: int
    rank: int
    world_size: int
    transport: str  # "shm" (batches lent in shared memory; some may still go inline), "socket" or "inline"
    shared: bool  # computed once for several identical streams
    num_batches: int  # in this epoch for this shard
    next_batch: int  # the batch the client gets next
    batches_sent: int  # handed to gRPC (which buffers ahead of the client)
    samples_sent: int
    bytes_sent: int  # gRPC message bytes (a shared-memory batch sends only its place)
    batches_taken: int  # the client handed to its training loop (as it reports; see the module doc)
    samples_taken: int
    bytes_copied: int  # batch bytes copied out of slots for this stream (0: every batch lent in place)
    samples_skipped: int  # bad samples left out (dataset on_error: skip)
    batches_in_flight: int  # being built by workers
    batches_ready: int  # built, waiting in the reorder buffer
    prefetch: int
    age_seconds: float  # since the stream opened
    images_per_second: float  # moving rate (RateMeter), samples taken per second (0: the client reports nothing)
    images_per_second_sent: float  # moving rate, samples handed to gRPC per second
    waiting_seconds: float  # how long the RPC has been waiting for its next batch now (0 if not waiting)
    wait_ratio: float = 0.0  # the client's training loop: fraction of its time waiting for data (as it reports), 0..1
    verdict: str = ""  # the client's profile verdict ("" when it reports none)
    reports_wait: bool = False  # the client reported a wait ratio
    call: str = "StreamBatches"  # or "Batches" (the client grants; next_batch: the lowest granted not sent)
    data_bytes_sent: int = 0  # bytes written on its data connection (socket transport), headers and padding included
    granted: int = 0  # batches granted and neither sent nor revoked (StreamBatches: within prefetch)

    @property
    def batches_ahead(self) -> int:
        """Batches built or being built ahead of the client (at most ``prefetch``)."""
        return self.batches_in_flight + self.batches_ready


@dataclass(frozen=True, slots=True)
class WorkerStats:
    """One worker process."""

    id: int
    pid: int
    busy_ratio: float  # moving fraction of its time spent building batches, 0..1
    stage: str  # now: idle, read, decode, pipeline, cache, write (server/compute/stages.py), starting, retiring
    tasks: int  # batches assigned to it now


@dataclass(frozen=True, slots=True)
class PoolStats:
    """The worker processes and the shared memory they write."""

    workers: int  # worker processes running now
    ready: int  # started and answering (a replacement counts once it said Ready)
    busy: int  # workers with at least one batch assigned right now
    restarts: int  # workers that died and were replaced
    batches_rebuilt: int  # batches in flight on a worker that died, queued again for another
    busy_seconds: float  # seconds workers spent building batches (read, decode, pipeline, cache, write), all time
    utilization: float  # moving fraction of worker time with a batch to build, 0..1
    tasks_in_flight: int  # batches sent to workers and not yet back (the work queue)
    slots_in_use: int  # shared-memory slots holding a batch (not counting those lent to clients)
    max_slots: int
    shm_bytes: int  # bytes of shared-memory slots: the server's and those lent to clients
    leases_held: int  # slots lent to same-host clients
    sessions: int  # open shared-memory sessions
    min_workers: int = 0  # the pool's bounds (equal for a fixed pool; max after the CPU limit)
    max_workers: int = 0
    cpu_quota: float = 0.0  # CPUs the workers may use (cgroup limit, else the CPUs available); 0: a fixed pool
    scale_ups: int = 0  # workers started because clients waited for data
    scale_downs: int = 0  # workers retired after a cool-down
    worker_stats: tuple[WorkerStats, ...] = ()
    # the scheduler's own work since start (server/compute/pool.py SchedulerCounts)
    scheduler_rounds: int = 0
    scheduler_waits: int = 0
    scheduler_timeouts: int = 0
    scheduler_wakeups: int = 0
    scheduler_dispatches: int = 0
    scheduler_passes: int = 0


@dataclass(frozen=True, slots=True)
class Totals:
    """Since the server started, over open and closed streams."""

    streams_started: int
    streams_finished: int  # sent their last batch
    streams_failed: int  # ended with an error (bad sample, worker failure)
    streams_cancelled: int  # ended early: client gone, or server shutting down
    batches_sent: int
    samples_sent: int
    bytes_sent: int
    samples_skipped: int
    bytes_copied_shm: int  # batch bytes copied out of slots for shared-memory streams (inline fallbacks)
    bytes_copied_inline: int  # ... for inline streams (every batch's bytes)
    hedge_streams_started: int = 0  # hedged requests (one late batch re-requested by a client of several servers)
    hedge_batches_built: int = 0  # batches workers built for them
    hedge_batches_sent: int = 0  # batches sent on them
    # the control path (issue 26): unary calls served, by method
    describe_dataset_calls: int = 0
    list_datasets_calls: int = 0
    release_leases_calls: int = 0
    stats_calls: int = 0
    batches_calls_started: int = 0  # Batches calls opened (also in streams_started)
    control_messages: int = 0  # BatchesControl messages received (the open included)
    batches_granted: int = 0  # batch indices granted on Batches calls
    batches_revoked: int = 0  # ... revoked before they were sent
    leases_released_on_calls: int = 0  # leases released by BatchesControl.release
    leases_released_by_rpc: int = 0  # ... by ReleaseLeases.leases
    control_frames: int = 0  # grants, revokes, progress read on data connections (control.py, apply_frame)
    data_messages: int = 0  # Batch messages sent in band on data connections (sending.py)
    put_weights_calls: int = 0  # PutWeights calls served (weights.py): one per loader and server process
    weights_bytes_received: int = 0  # ... and the weight bytes they carried
    # the data plane (server/serve/dataplane.py): payload bytes copied out of slots, bytes written on
    # data connections (headers and padding included), connections accepted and refused
    bytes_copied_socket: int = 0
    data_plane_bytes_sent: int = 0
    data_connections_accepted: int = 0
    data_connections_refused: int = 0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """The decoded-sample cache for one dataset, since the server started (server/data/cache/)."""

    dataset: str
    hits: int  # samples served from the cache, RAM + disk
    hits_disk: int
    misses: int  # samples computed
    bytes_ram: int  # bytes of entries in shared memory
    bytes_disk: int  # bytes of entry files in disk_dir
    evictions: int  # entries dropped (found corrupt)
    not_admitted: int  # computed samples the full cache did not take
    errors: int  # cache failures that fell back to computing


@dataclass(frozen=True, slots=True)
class ServerStats:
    uptime_seconds: float
    version: str
    streams: tuple[StreamStats, ...]
    pool: PoolStats
    totals: Totals
    computations: int = 0  # running computations (identical streams share one); not in the proto
    computations_started: int = 0
    cache: tuple[CacheStats, ...] = ()  # per dataset; empty without a cache
    stage_seconds: dict[str, float] | None = None  # BatchTimings stage -> seconds over all batches sent; not in the proto
    scaling: dict[tuple[str, str], int] | None = None  # (direction, reason) -> workers started/retired; not in the proto
    # images decoded by kind over all batches sent (server/compute/samples.py DECODE_KINDS: "full" size,
    # "scaled" whole at m/8 for a first resize, "region": at the m/8 a first random crop's window
    # needs, server/compute/region.py, "indexed": such a region cut from the sample's indexed JPEG
    # in the cache, scaled_jpeg.index_jpeg), and the pixels decoded; not in the proto
    decodes: dict[str, int] | None = None
    decoded_pixels: int = 0

    @property
    def trainer_data_wait_ratio(self) -> float:
        """The mean wait ratio the open streams' clients report (0..1; 0 when none reports)."""
        reported = [s.wait_ratio for s in self.streams if s.reports_wait]
        return sum(reported) / len(reported) if reported else 0.0


# Loader.counters keys, for the streams that have closed (open ones are added by snapshot).
ENDED = ("streams_finished", "streams_failed", "streams_cancelled")
SENT = ("batches_sent", "samples_sent", "bytes_sent", "samples_skipped")
# Loader.counters keys of the control path (Loader.count), reported as they are
CONTROL = ("describe_dataset_calls", "list_datasets_calls", "release_leases_calls", "stats_calls",
           "batches_calls_started", "control_messages", "batches_granted", "batches_revoked",
           "leases_released_on_calls", "leases_released_by_rpc", "control_frames", "data_messages",
           "put_weights_calls", "weights_bytes_received")


def stream_outcome(stream: "Stream") -> str:
    """How a closed stream ended: one of ``ENDED``."""
    if stream.completed:
        return "streams_finished"
    if stream.failed or stream.error is not None:
        return "streams_failed"
    return "streams_cancelled"


def stream_stats(stream: "Stream", now: float) -> StreamStats:
    req = stream.request
    in_flight, ready = stream.backlog()
    waiting_since = stream.waiting_since
    return StreamStats(
        id=stream.id,
        peer=stream.peer,
        dataset=req.dataset,
        pipeline=req.pipeline_name,
        batch_size=req.batch_size,
        epoch=req.epoch,
        rank=req.rank,
        world_size=req.world_size,
        transport=stream.transport,
        shared=bool(stream.shared),
        num_batches=stream.num_batches,
        next_batch=stream.next_index,
        batches_sent=stream.batches_sent,
        samples_sent=stream.samples_sent,
        bytes_sent=stream.bytes_sent,
        batches_taken=stream.batches_taken,
        samples_taken=stream.samples_taken,
        bytes_copied=stream.bytes_copied,
        samples_skipped=stream.samples_skipped,
        batches_in_flight=in_flight,
        batches_ready=ready,
        prefetch=stream.prefetch,
        age_seconds=max(0.0, now - stream.started),
        images_per_second=stream.taken_meter.rate(now=now),
        images_per_second_sent=stream.meter.rate(now=now),
        waiting_seconds=0.0 if waiting_since is None else max(0.0, now - waiting_since),
        wait_ratio=stream.wait_ratio or 0.0,
        verdict=stream.verdict,
        reports_wait=stream.wait_ratio is not None,
        call="StreamBatches" if stream.ordered else "Batches",
        granted=stream.outstanding,
        data_bytes_sent=stream.data_bytes_sent,
    )


def _data_plane(plane) -> dict[str, int]:
    """The data plane's counters as ``Totals`` names them (zeros without one)."""
    if plane is None:
        return {}
    st = plane.stats()
    return {"data_plane_bytes_sent": st["bytes_sent"], "data_connections_accepted": st["connections_accepted"],
            "data_connections_refused": st["connections_refused"]}


def _version() -> str:
    try:
        return importlib.metadata.version("batchd")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def snapshot(loader: "Loader") -> ServerStats:
    """Everything ``batchd status`` and the Prometheus endpoint show, read now."""
    now = time.monotonic()
    with loader._lock:  # streams move from `streams` to `counters` under this lock
        loader_streams = sorted(loader.streams.values(), key=lambda s: s.id)
        streams = tuple(stream_stats(s, now) for s in loader_streams)
        counters = dict(loader.counters)
        computations = loader.computations
    pool, slots, leases = loader.pool, loader.slots, loader.leases
    load = pool.load()
    scaling = dict(pool.scaling)
    pool_stats = PoolStats(
        workers=pool.num_workers,
        ready=load["ready"],
        busy=load["busy"],
        restarts=pool.restarts,
        batches_rebuilt=pool.batches_rebuilt,
        busy_seconds=pool.work_seconds,
        utilization=pool.busy_ratio(now),
        tasks_in_flight=load["tasks_in_flight"],
        slots_in_use=slots.in_use,
        max_slots=slots.max_slots,
        shm_bytes=slots.bytes_mapped,
        leases_held=leases.held_total,
        sessions=leases.sessions,
        min_workers=pool.min_workers,
        max_workers=pool.max_workers,
        cpu_quota=pool.autoscaler.cpu_quota if pool.autoscaler is not None else 0.0,
        scale_ups=sum(n for (direction, _), n in scaling.items() if direction == "up"),
        scale_downs=sum(n for (direction, _), n in scaling.items() if direction == "down"),
        worker_stats=tuple(WorkerStats(**w) for w in pool.workers(now)),
        scheduler_rounds=pool.counts.rounds,
        scheduler_waits=pool.counts.waits,
        scheduler_timeouts=pool.counts.timeouts,
        scheduler_wakeups=pool.counts.wakeups,
        scheduler_dispatches=pool.counts.dispatches,
        scheduler_passes=pool.counts.passes,
    )
    totals = Totals(
        streams_started=counters.get("streams_started", 0),
        **{k: counters.get(k, 0) for k in ENDED},
        **{k: counters.get(k, 0) + sum(getattr(s, k) for s in streams) for k in SENT},
        bytes_copied_shm=loader.transport.bytes_copied["shm"],
        bytes_copied_inline=loader.transport.bytes_copied["inline"],
        hedge_streams_started=counters.get("hedge_streams_started", 0),
        hedge_batches_built=pool.hedge_batches_built,
        hedge_batches_sent=counters.get("hedge_batches_sent", 0)
        + sum(s.batches_sent for s in loader_streams if s.request.hedge),
        **{k: counters.get(k, 0) for k in CONTROL},
        bytes_copied_socket=loader.transport.bytes_copied["socket"],
        **_data_plane(loader.data_plane),
    )
    return ServerStats(
        uptime_seconds=max(0.0, now - loader.started), version=_version(), streams=streams, pool=pool_stats, totals=totals,
        computations=computations, computations_started=counters.get("computations_started", 0),
        cache=_cache_stats(loader), stage_seconds=dict(loader.transport.stage_seconds), scaling=scaling,
        decodes=dict(loader.transport.decodes), decoded_pixels=loader.transport.decoded_pixels,
    )


def _cache_stats(loader: "Loader") -> tuple[CacheStats, ...]:
    cache = getattr(loader, "cache", None)
    if cache is None:
        return ()
    fields = CacheStats.__dataclass_fields__
    return tuple(CacheStats(dataset=ds, **{k: v for k, v in c.items() if k in fields})
                 for ds, c in cache.stats().items())
