"""The loader: datasets + worker pool + streams, as a plain Python object (no gRPC here).

``Loader`` validates requests (``request_checks.py``, mixed in), turns them into ``Stream``
objects and owns every resource the server holds. The gRPC servicer (``service.py``) is a thin
adapter over it.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
import uuid

from batchd.errors import DatasetNotFoundError, ResourceExhaustedError
from batchd.server.compute import python_pipeline
from batchd.server.compute import pipeline as pipelines
from batchd.server import shm
from batchd.server.compute.build import build_fingerprint, build_parts
from batchd.server.data.cache import SharedCache
from batchd.server.config import ServerConfig
from batchd.server.data.datasets import Dataset, open_dataset
from batchd.server.data.datasets.python import add_python_path
from batchd.server.serve import orders
from batchd.server.serve.leases import LeaseTable
from batchd.server.request_checks import RequestChecks
from batchd.server.serve.weights import Weights, WeightsStore, make_weights
from batchd.server.compute.autoscale import RPC_WAIT_UP_S, WAIT_UP, Autoscaler, Demand
from batchd.server.compute.pool import WAKE_SLOT, WAKE_STREAM, WorkerPool
from batchd.server.serve.stats import SENT, stream_outcome
from batchd.server.compute.protocol import StreamRequest
from batchd.server.serve.stream import Computation, Stream
from batchd.server.serve.transport import Transport

log = logging.getLogger(__name__)

_FRESH_S = 5.0  # a client's reported wait ratio counts for demand this long (it reports every 0.5 s)


class Loader(RequestChecks):
    """Opens the configured datasets, starts the worker pool, serves streams.

    Raises whatever opening a dataset raises (FileNotFoundError, ValueError naming the file),
    and RuntimeError if workers fail to start. Call ``close()`` (or use ``with``) to stop.
    """

    def __init__(self, config: ServerConfig):
        self.config = config
        self.started = time.monotonic()
        # this server process, for clients (DatasetInfo.server_id, metadata batchd-server-id): a restart gets a new one
        self.server_id = uuid.uuid4().hex
        shm.remove_stale()
        add_python_path(config.python_path)  # kind python factories and python pipelines import from here
        self.datasets: dict[str, Dataset] = {}
        self.weights = WeightsStore(config.max_weights_bytes)  # weighted sampling's weights, by digest (PutWeights)
        self.dataset_weights: dict[str, Weights] = {}  # datasets' own (weight_column, a python dataset's weights)
        for name, dcfg in config.datasets.items():
            ds = self.datasets[name] = open_dataset(name, dcfg, config.cache_dir, build=True)
            log.info("dataset %r: %s, %d samples, %d classes", name, dcfg.kind, len(ds), len(ds.classes))
            own = ds.weights()
            if own is not None:
                self.dataset_weights[name] = make_weights(own, f"dataset {name!r}: weights")
                self.weights.pin(self.dataset_weights[name])
        python_presets = config.python_pipelines()
        self._presets = {name: python_pipeline.preset_json(name, spec) if name in python_presets
                         else pipelines.canonical_json(spec) for name, spec in config.pipelines.items()}
        for name, text in self._presets.items():
            if name in python_presets:  # imported and built once here: a broken one stops the server at start-up
                python_pipeline.make(python_presets[name], name)
                continue
            try:
                pipelines.build(text)
            except ValueError as e:
                raise ValueError(f"pipelines.{name}: {e}") from None
        self._checked: dict[str, None] = {}  # pipeline keys already known to build
        self.owner = shm.Owner()
        self.slots = shm.SlotPool(max_slots=config.max_slots, prefix=self.owner.prefix)
        self.cache = None  # the decoded-sample cache (server/data/cache/); workers attach to it by name
        if config.cache.memory_bytes:
            c = config.cache
            self.cache = SharedCache.create(
                f"{self.owner.prefix}cache", memory_bytes=int(c.memory_bytes), datasets=list(config.datasets),
                workers=config.max_workers, build=build_fingerprint(build_parts(cache=True)), disk_dir=c.disk_dir,
                disk_bytes=int(c.disk_bytes), compress=c.compress, disk_max_idle_s=c.disk_max_idle_s)
        self.leases = LeaseTable(self.slots, max_held=config.max_leases_per_session, on_return=self._wake_pool)
        self.transport = Transport(self.slots, self.leases, busy_ratio=self._busy_ratio,
                                   workers=lambda: self.pool.num_workers)  # lend or copy each batch sent
        autoscaler = None
        if not isinstance(config.workers, int):
            w = config.workers
            autoscaler = Autoscaler(w.min, w.max, cpu_quota=w.cpu_quota, cool_down_s=w.cool_down_s, now=time.monotonic())
            log.info("workers: %d to %d (max %d, cpu quota %g CPUs), retired after %g s without a waiting client",
                     w.min, autoscaler.limit, w.max, autoscaler.cpu_quota, w.cool_down_s)
        self.pool = WorkerPool(
            config.min_workers, dict(config.datasets), config.cache_dir, self.slots,
            worker_timeout_s=config.worker_timeout_s, max_task_retries=config.max_task_retries,
            max_batch_bytes=config.max_batch_bytes, reads_in_flight=config.reads_in_flight,
            autoscaler=autoscaler, demand=self.demand,
            python_path=config.python_path, python_pipelines=python_presets,
        )
        self._lock = threading.RLock()  # streams, counters, _computations; moving a stream between computations
        self.streams: dict[int, Stream] = {}
        self._computations: dict[tuple, list[Computation]] = {}  # request key -> running computations
        # streams_started, and how closed streams ended + what they sent, the control path's calls and
        # messages (server/serve/stats.py); under _lock
        self.counters: collections.Counter[str] = collections.Counter()
        self.data_plane = None  # the server's DataPlane, for its counters (set by server/app.py)
        self._closed = False
        self.draining = False  # set by drain() on shutdown: nothing more is built, open streams end with UNAVAILABLE

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def dataset(self, name: str) -> Dataset:
        """Raises DatasetNotFoundError if the server has no dataset ``name``."""
        try:
            return self.datasets[name]
        except KeyError:
            raise DatasetNotFoundError(f"no dataset {name!r} on this server; it has {sorted(self.datasets)}") from None

    def count(self, key: str, n: int = 1) -> None:
        """Add ``n`` to counter ``key`` (``Totals``: calls served, control messages, grants...)."""
        with self._lock:
            self.counters[key] += n

    def open_stream(self, args: StreamRequest, *, open_seq: int = 0) -> Stream:
        """Validate ``args`` (as decoded by ``StreamRequest.from_proto``) and start building its batches.
        ``open_seq``: a Batches call's count of ``open`` messages before this one (``Stream.open_seq``).

        A Batches call (``args.granted``) builds nothing until its client grants batch indices
        (``Stream.grant``); its start_batch, batch_stride, batch_offset, end_batch and prefetch
        must be 0 (the servicer clears them).

        Raises DatasetNotFoundError for an unknown dataset, ValueError naming any other bad field
        (a sampler's or mix's too: ``orders``), WeightsNotFoundError for a sampler's weights this
        server does not hold, ResourceExhaustedError past ``max_streams``, RuntimeError while
        shutting down.
        """
        cfg = self.config
        request, n, weights = self._validated(args)
        name = request.pipeline_name
        world_size, stride = request.world_size, request.batch_stride
        stream = Stream(request, n, open_seq)
        if request.granted:
            stream.prefetch = cfg.max_grants  # what it may have ahead (stats)
        indices = sources = None  # this shard's order, computed outside the lock when no computation can be joined
        while True:
            with self._lock:  # join a running computation or register a new one: one decision, one lock
                if self._closed or self.draining:
                    raise RuntimeError("the loader is shutting down")
                if len(self.streams) >= cfg.max_streams:
                    raise ResourceExhaustedError(
                        f"the server already has {len(self.streams)} open streams, its limit (max_streams); "
                        "try again when one ends")
                joined = self._join(stream)
                if joined is not None or indices is not None:
                    started = None if joined is not None else self._new_computation(stream, request, indices, n,
                                                                                    sources)
                    self.streams[stream.id] = stream
                    self.transport.open(stream)
                    self.counters["streams_started"] += 1
                    if request.granted and open_seq == 0:  # (a later open of the call is a new stream only)
                        self.counters["batches_calls_started"] += 1
                    if request.hedge:
                        self.counters["hedge_streams_started"] += 1
                    break
            indices, sources = orders.shard(request, len(self.dataset(request.datasets[0])), weights,
                                            tuple(len(self.dataset(d)) for d in request.datasets))
        if started is not None:
            self.pool.add_computation(started)
        log.log(  # a Batches call's later passes at debug (one line per epoch would flood a small dataset's log)
            logging.INFO if open_seq == 0 else logging.DEBUG,
            "stream %d started: dataset=%s pipeline=%s batch_size=%d order=%s seed=%d epoch=%d rank=%d/%d "
            "%s%s prefetch=%d transport=%s client=%s; %s", stream.id, args.dataset, name, args.batch_size,
            request.order_key[:16] or ("shuffled" if args.shuffle else "sequential"), args.seed, args.epoch, args.rank,
            world_size,
            f"batches {stream.position}..{stream.end}" if stream.ordered else f"granted batches of {n} (Batches call)",
            (f" (stride {stride})" if stride > 1 else "")
            + (f" of the epoch from position {args.start_position}" if args.start_position else "")
            + (" (hedged request)" if args.hedge else ""), stream.prefetch, args.transport,
            args.peer or "-",
            f"joins computation {joined.id}, shared with {joined.readers - 1} other streams" if joined is not None
            else f"computation {stream.computation.id}",
        )
        return stream

    def _join(self, stream: Stream) -> Computation | None:
        """Attach ``stream`` to a running computation of its key that can serve it (under _lock)."""
        if self.config.share_window <= 0:
            return None
        for computation in self._computations.get(stream.request.key, ()):
            if computation.attach(stream):
                return computation
        return None

    def _new_computation(self, stream: Stream, request: StreamRequest, indices, n: int, sources=None) -> Computation:
        """A computation for ``stream``, registered (under _lock, which the caller holds) so that
        identical streams join it; the caller hands it to the pool."""
        computation = Computation(request, indices, min(n, request.end_batch or n), release_slot=self._release_slot,
                                  window=self.config.share_window, sources=sources)
        computation.on_fall_behind = self._fell_behind
        computation.on_grant = lambda: self.pool.wake(WAKE_STREAM)  # new work for a computation
        computation.attach(stream, first=True)
        self._computations.setdefault(request.key, []).append(computation)
        self.counters["computations_started"] += 1
        return computation

    def _fell_behind(self, stream: Stream) -> None:
        """``stream`` is more than share_window batches behind the others: give it its own computation.

        Under _lock, so that a stream being closed is never moved (its new computation would
        have a reader that nobody detaches).
        """
        with self._lock:
            if stream.closed or self._closed or self.draining:
                return
            old = stream.computation
            new = self._new_computation(stream, old.request, old.indices, old.num_batches, old.sources)
            self.pool.add_computation(new)
            ended = old.detach(stream)
        log.info(
            "stream %d fell more than %d batches behind the other readers of computation %d; its batches from %d on "
            "are recomputed (computation %d)", stream.id, old.window, old.id, stream.position, new.id,
        )
        if ended:
            self._end_computation(old)

    def _end_computation(self, computation: Computation) -> None:
        self.pool.remove_computation(computation)
        with self._lock:
            siblings = self._computations.get(computation.request.key, [])
            if computation in siblings:
                siblings.remove(computation)
            if not siblings:
                self._computations.pop(computation.request.key, None)

    def demand(self) -> Demand:
        """How many open streams wait for data now (``server/compute/autoscale.py``): a client that
        reports a wait ratio of ``WAIT_UP`` or more (within the last ``_FRESH_S``), or a stream whose
        RPC has waited ``RPC_WAIT_UP_S`` for its next batch; and the largest reported ratio."""
        now = time.monotonic()
        with self._lock:
            streams = list(self.streams.values())
        waiting, ratio = 0, 0.0
        for s in streams:
            fresh = s.wait_ratio is not None and now - s.wait_reported_at < _FRESH_S
            if fresh:
                ratio = max(ratio, s.wait_ratio)
            since = s.waiting_since
            if (fresh and s.wait_ratio >= WAIT_UP) or (since is not None and now - since >= RPC_WAIT_UP_S):
                waiting += 1
        return Demand(waiting, ratio)

    def _busy_ratio(self, stream: Stream) -> float:
        """The fraction of the workers' time with a batch to build since ``stream`` sent its first
        batch (0..1; 0 for the first batch): its BatchTimings.workers_busy_ratio. (From the first batch
        on, not from the stream's opening: building the first batches is work for any client.)"""
        busy, alive = self.pool.busy_totals()
        if stream.busy_mark is None:
            stream.busy_mark = (busy, alive)
            return 0.0
        busy0, alive0 = stream.busy_mark
        return min(1.0, max(0.0, (busy - busy0) / (alive - alive0))) if alive > alive0 else 0.0

    def _release_slot(self, slot) -> None:
        self.slots.release(slot)
        self.pool.wake(WAKE_SLOT)

    def _wake_pool(self) -> None:
        pool = getattr(self, "pool", None)
        if pool is not None:
            pool.wake(WAKE_SLOT)  # a lease came back: its slot may be free

    def drain(self) -> None:
        """Shutting down: build nothing more. The pool dispatches no task from now on and every
        computation closes (its built batches go back; tasks already running finish into slots
        that were free when they were sent), so no slot is written again: a slot lent to a client
        that the shared-memory sessions give back afterwards keeps its batch's bytes
        (tests/serve/test_shutdown_batches.py). Open streams then end with UNAVAILABLE; new ones
        are refused. Idempotent."""
        with self._lock:
            self.draining = True
            computations = [c for group in self._computations.values() for c in group]
        self.pool.stop_dispatch()  # returns once no dispatch is under way
        for c in computations:
            c.close()

    def close_stream(self, stream: Stream, reason: str = "finished") -> None:
        with self._lock:
            stream.closed = True
            computation = stream.computation
            ended = computation is not None and computation.detach(stream)
        if ended:
            self._end_computation(computation)
        self.transport.close(stream)
        with self._lock:
            if self.streams.pop(stream.id, None) is not None:
                self.counters[stream_outcome(stream)] += 1
                for key in SENT:
                    self.counters[key] += getattr(stream, key)
                if stream.request.hedge:
                    self.counters["hedge_batches_sent"] += stream.batches_sent
        if reason == "finished" and not stream.completed:
            reason = "ended early (the client stopped reading)"
        elapsed = time.monotonic() - stream.started
        log.log(
            logging.INFO if stream.open_seq == 0 else logging.DEBUG,
            "stream %d %s after %d of %d batches (%d samples, %.1f MB sent, %.0f images/s, %d samples skipped, %.1f s)",
            stream.id, reason, stream.batches_sent, stream.batches_due, stream.samples_sent,
            stream.bytes_sent / 1e6, stream.samples_sent / elapsed if elapsed > 0 else 0.0, stream.samples_skipped, elapsed,
        )

    @property
    def computations(self) -> int:
        """Computations running now (identical streams share one)."""
        with self._lock:
            return sum(len(group) for group in self._computations.values())

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Stop every stream and worker and unlink shared memory. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            computations = [c for group in self._computations.values() for c in group]
        self.pool.stop_dispatch()  # before leases go back: nothing is built into a slot a client still holds
        for c in computations:
            c.close()
        self.leases.close_all()
        self.pool.close()
        self.slots.close()
        if self.cache is not None:
            self.cache.close()
        self.owner.close()
