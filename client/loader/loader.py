"""``RemoteDataLoader``: a PyTorch-DataLoader-shaped iterator over batches batchd servers build.

``RemoteDataLoader(address, dataset, ...)`` is what users type, for one server or several: it
checks the arguments once (``LoaderOptions``, in the caller's thread; its settings are
attributes, ``LoaderSettings``), then reads through the loader's ``Servers``
(``batchd.client.iteration.servers``: one pass of an epoch at a time, each batch once, in order,
from whichever server builds it first). The facade keeps the position, epochs and exact resume.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

from batchd.client import forks
from batchd.client.device import transfer
from batchd.client.iteration import elastic
from batchd.client.iteration.servers import Servers
from batchd.client.loader.options import LoaderOptions, LoaderSettings
from batchd.client.loader import sampling
from batchd.client.loader.profile import Profile, make_profile
from batchd.client.loader.sampling import Mix, WeightedRandomSampler
from batchd.client.loader.stats import LoaderStats
from batchd.client.loader.timings import LoopTimings, timed
from batchd.client.transport.datasets import DatasetInfo
from batchd.sampler import num_batches

_VERDICT_EVERY_S = 0.5  # how often the verdict reported to servers is recomputed


class RemoteDataLoader(LoaderSettings):
    """Iterate batches of a dataset that a batchd server at ``address`` decodes and augments.

    Each batch is a dict with an entry per field of the dataset's samples (e.g. ``image``,
    ``label``; ``boxes``, ``labels``, ``masks`` for detection), plus ``index`` int64 [B] (dataset
    sample indices), ``position`` int64 [B] (each sample's place in the epoch's global order) and
    ``skipped`` int64 [K] when the server left out K unreadable samples (dataset ``on_error:
    skip``; such a batch has B - K samples). Each field is, in each batch:

    * stacked, a tensor [B, ...], where the B samples' values have one shape (as
      ``default_collate`` stacks them): ``image`` uint8 [B, H, W, C] (unless the pipeline changes
      the dtype, e.g. Normalize gives float32), ``label`` int64 [B];
    * a list of B tensors where their shapes differ (images of different sizes; ``boxes`` float32
      [N_i, 4] xyxy pixels, ``labels`` int64 [N_i], ``masks`` uint8 [N_i, H, W] with N_i objects in
      sample i, 0 included): sample i's value, a view of the field's one buffer (no copy); nothing
      is padded or cropped;
    * a list of B ``str`` / ``bytes`` for a str / bytes field.

    Stacked or a list is decided per field in each batch: a field whose shapes happen to agree (every
    image of the batch has 2 boxes) arrives stacked in that batch; ``list(batch[name])`` gives B
    tensors either way, and ``collate_fn`` sees the same samples either way.

    Batch ``b`` of an epoch is a pure function of (dataset, transform, batch_size, shuffle, seed,
    epoch, b, rank, world_size): iterating twice, on another server, or with another number of
    server workers gives the same bytes.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH`` of the server; or several servers feeding this
            loader together: a list of addresses, or a DNS name with several addresses
            (``dns:///NAME:PORT``, or ``NAME:PORT`` resolving to several A records, e.g. a
            Kubernetes headless Service), or ``file:PATH`` (a text file of ``HOST:PORT`` lines).
            Each server is granted batches as it has credit for them (what it says it can build
            soon: its workers and its build time per batch), they are put back in order, and the
            first copy of each batch wins: the same bytes from any server
            (``batchd.client.iteration.credit``; docs/several-servers.md). A ``file:`` list or a
            ``dns:///`` name is read again every ``probe_interval``, so that servers listed later
            join (``batchd.client.transport.addresses``).
        dataset: a dataset name from the server's config, or a ``batchd.Mix`` of several (batches
            then also carry ``source`` int64 [B]; docs/sampling.md).
        batch_size: samples per batch (>= 1).
        shuffle: permute the samples each epoch (a pure function of seed and epoch).
        sampler: None, or a ``batchd.WeightedRandomSampler`` (torch's arguments): each epoch is
            a weighted draw instead (mutually exclusive with shuffle, as in DataLoader).
        seed: the seed of the shuffle (or draw) and of the pipeline's random augmentations.
        drop_last: drop the final partial batch (and do not pad shards), as in DataLoader.
        transform: None (images as decoded), a preset name from the server config, or an
            albumentations transform/Compose (sent in albumentations' serialized form); for a
            Mix, also ``{source name: transform}`` (a source left out gets none).
        rank, world_size: this process's shard, as in DistributedSampler. None (default): from
            torch.distributed (an initialised process group, else the RANK and WORLD_SIZE
            environment variables torchrun sets), else 0 and 1.
        device: None/"cpu" for CPU tensors, or a CUDA device: batches are copied on a side stream,
            overlapping the copy with compute (inline batches through reused pinned buffers,
            shared-memory batches straight from their registered slots). "cuda" means the
            caller's current CUDA device when the loader is built (``torch.cuda.set_device``).
        gpu_transform: None, or ``gpu_transform(images, positions, *, seed, epoch) -> Tensor``
            finishing each batch where it lands: images is the batch's uint8 [B, H, W, C] tensor
            (on the device after the copy, on the copy's side stream; on CPU without a device),
            positions is ``batch["position"]`` (int64 [B], each sample's position in the epoch's
            global order); its result replaces ``batch["image"]``. A batch without "position", or
            whose images have different sizes (a list, not [B, H, W, C]; resize them on the server),
            raises ValueError.
        collate_fn: None (default): the dict batch above. Or ``fn(samples) -> Any``, as
            DataLoader's: ``samples`` is the batch's B samples in order, each a dict of its fields
            (row i of each stacked field, so ``label``, ``index`` and ``position`` are 0-d int64
            tensors; the i-th tensor of each ragged field; the i-th str / bytes), and the loop gets
            what fn returns, exactly as DataLoader's collate_fn over a Dataset of those dicts:
            ``torch.utils.data.default_collate`` gives the dict batch back where shapes agree, and
            ``batchd.detection_collate`` gives torchvision's detection models their ``(images,
            targets)``: a tuple of the B ``image`` tensors and a tuple of B dicts of the other
            fields (``boxes`` float32 [N_i, 4] xyxy pixels, ``labels`` int64 [N_i], ``masks`` uint8
            [N_i, H, W], ``index``, ``position``, ...), as ``tuple(zip(*x))`` does over its
            references' (image, target) samples. ``skipped`` is not a sample: fn gets the B - K
            samples that were read. fn runs in the loader's converter thread, in batch order,
            overlapping the training step as DataLoader's workers do; with a
            CUDA ``device`` it runs in the iterating thread once the copy is waited for, so GPU
            work in it is queued in order on the loop's current stream. The samples' tensors are
            on ``device`` (str / bytes stay Python objects) and, over shared memory, keep the slot
            lent until they are all freed. What fn raises, iteration raises.
        decode_on_client: the server sends each sample's JPEG file as it is and this loader decodes
            it (``batchd.client.device.decode``): with nvJPEG on a CUDA ``device`` when torchvision >= 0.19
            loads (not the same bytes as the server's OpenCV decode), else with OpenCV on the CPU
            (the same bytes as the server's decode). Less server CPU and fewer bytes on the
            network. The transform must then be None or exactly one ``A.Resize(h, w)`` (the
            loader redoes it; other transforms belong in ``gpu_transform``), the dataset's files
            baseline/progressive JPEGs; otherwise iteration raises ValueError / SampleError. A
            file the loader cannot decode follows the dataset's ``on_error`` (SampleError, or
            left out and named in ``skipped``).
        prefetch: the fewest batches a server is asked to build ahead (>= 1): its window of
            grants starts there and grows with its measured rate (``batchd.client.windows``).
        timeout: seconds without a batch before iteration raises ``batchd.TimeoutError``.
        connect_timeout: seconds to find the server before raising ``batchd.ConnectionError``.
        max_message_bytes: the largest gRPC message this loader accepts, in bytes (None: 1 GiB,
            ``batchd.client.transport.channel.DEFAULT_MAX_MESSAGE_BYTES``). An inline batch is one message: a
            larger one raises ResourceExhaustedError. The server sends at most its own
            ``max_message_bytes`` (default 512 MiB).
        transport: "auto" (shared memory when this process can read the server's /dev/shm,
            i.e. same host and IPC namespace; else the socket data plane: each batch's bytes on a
            TCP connection beside the call, received straight into a reused buffer, TLS when the
            channel is, docs/network.md; else, where the server has no data plane or the address
            is ``unix:``, bytes in the gRPC messages), "shm" (shared memory or RuntimeError),
            "socket" (the data plane even on the server's host; inline where the server has none),
            or "inline" (always bytes in the messages).
        relay: "auto" (on for CPU batches on Linux), True or False: a process of batchd's own
            receives the data plane's bytes into memory this one maps (client/transport/relay.py).
        compression: None, or "lz4" to compress inline tensor bytes (for slow remote links; the
            batches then come inline, not on the data plane).
        reconnect_timeout: if no server's call is up (a server restarted, the connection lost),
            seconds to keep reconnecting before raising ConnectionError; the iteration resumes
            with the batches not yet received, none missing or repeated. A server that comes back
            is checked: the call tells it the dataset this loader expects (its size, and under
            ``strict`` its fingerprints), and a server process with a new id is described again:
            another number of samples raises ``batchd.DatasetChangedError`` (a ValueError), other
            fingerprints too under ``strict`` (else a warning, and ``info`` is the new
            description). With several servers, a broken server's batches go to the others at once
            while it reconnects. 0 disables.
        probe_interval: seconds between tries of a server that is down (a fresh connection), and
            between readings of the address (a DNS name, a ``file:`` list): a server that answers
            is granted batches as it has credit, one no longer named gets none.
        hedge: with several servers, a stalled server's batches go to the others (True, default):
            a server whose oldest batch is late past a deadline computed from its own capacity
            (``batchd.client.iteration.credit``) has every batch it holds granted to another
            server too; the first copy wins (same bytes). It keeps one (its probe) and gets
            nothing new until a batch comes from it. A stalled server silent for ``timeout / 4``
            seconds (at least 2) is reconnected. False: a stalled server is waited for.
        tls, tls_ca, tls_cert, tls_key: TLS to the server: ``tls_ca`` is the PEM file of the CA
            that signed the server's certificate, ``tls_cert`` + ``tls_key`` a client certificate
            (mutual TLS); or ``tls=True`` (system roots) / a ``batchd.TLS`` / a dict of its
            fields. None of them: plaintext.
        token: the bearer token for a server with ``auth`` (default: the ``BATCHD_TOKEN``
            environment variable). A missing or wrong one raises AuthenticationError; a dataset
            the token may not read, PermissionDeniedError (both PermissionErrors).
        strict: refuse to mix batches that cannot be byte-identical (as ``strict`` in
            ``nn.Module.load_state_dict``): several servers whose dataset or build fingerprints
            differ raise ValueError, and so do ``load_state_dict`` of a state saved against
            other fingerprints and a reconnect to a server whose fingerprints changed
            (``DatasetChangedError``; with several servers, that server is left out). False:
            accept, with a warning (see ``DatasetInfo``).

    Memory: over shared memory, a batch's tensors (a ragged field's per-sample tensors included)
    are views of a server slot lent to this client, mapped copy-on-write (a write stays in this
    process); the slot goes back when the last tensor on it is freed. Inline, they are views of
    the received message. On a CUDA device, each field is copied once (a ragged field as one
    buffer, then split into views there); str / bytes stay Python objects. Either way a batch
    stays valid as long as it is referenced, and may be modified in place, as with DataLoader.

    Raises (at construction): ValueError for bad arguments, ConnectionError if no server
    answers, DatasetNotFoundError if the server has no such dataset. Iteration raises
    ValueError (bad preset or pipeline, with the server's explanation), SampleError (a sample
    could not be read; names dataset, index and file), ShapeMismatchError, WorkerError,
    ResourceExhaustedError (a server limit: open streams, batch bytes), ConnectionError (server
    gone), TimeoutError or DatasetChangedError (a restarted server serves other data; see
    ``reconnect_timeout``). With auth: AuthenticationError / PermissionDeniedError. Every one
    but ValueError is a ``batchd.BatchdError``; batchd's ConnectionError and TimeoutError are
    also the built-in exceptions of those names.

    Epochs: each complete pass advances ``epoch`` by one (so shuffle differs per pass, as with
    DataLoader); ``set_epoch(e)`` picks the epoch explicitly, as with DistributedSampler.

    Resume: ``state_dict()`` and ``load_state_dict(state)``, exactly, at the same or another
    ``world_size`` or ``batch_size``. Figures: ``stats()``, ``server_stats()``. Where the time
    went and what bounds it: ``profile()``.

    Fork: the process may fork while the loader reads (DataLoader workers, a multiprocessing pool,
    ``subprocess`` with ``preexec_fn``); the children live, and the loader reads on undisturbed.
    A loader belongs to the process that created it: iterating it (or an iterator of it) in a
    forked child raises RuntimeError, and ``close`` there does nothing. Create a loader in the
    process that uses it (``batchd.client.forks``).
    """

    def __init__(self, address: Any, dataset: str | Mix, *, batch_size: int = 1, shuffle: bool = False,
                 sampler: WeightedRandomSampler | None = None, seed: int = 0,
                 drop_last: bool = False, transform: Any = None, rank: int | None = None,
                 world_size: int | None = None, device: str | torch.device | None = None, prefetch: int = 2,
                 timeout: float = 120.0, connect_timeout: float = 10.0, max_message_bytes: int | None = None,
                 transport: str = "auto", relay: bool | str = "auto", compression: str | None = None,
                 reconnect_timeout: float = 60.0, probe_interval: float = 5.0, tls: Any = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None,
                 token: str | None = None, strict: bool = True, gpu_transform: Any = None,
                 decode_on_client: bool = False, collate_fn: Any = None, hedge: bool = True):
        self._owner = forks.owner()  # the process that may use it (batchd.client.forks)
        forks.warn_if_handlers()
        extra = {} if max_message_bytes is None else {"max_message_bytes": max_message_bytes}
        self.options = LoaderOptions.from_arguments(
            dataset, transform=transform, rank=rank, world_size=world_size, device=device, compression=compression,
            tls=tls, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key, token=token, batch_size=batch_size,
            shuffle=shuffle, seed=seed, drop_last=drop_last, prefetch=prefetch, timeout=timeout,
            connect_timeout=connect_timeout, transport=transport, relay=relay, reconnect_timeout=reconnect_timeout,
            probe_interval=probe_interval, strict=strict,
            gpu_transform=gpu_transform, decode_on_client=decode_on_client, collate_fn=collate_fn, hedge=hedge,
            sampler=sampler, **extra)
        cuda = self.options.device.type == "cuda"  # made here, in the caller's thread, on the resolved device
        self._transfer = transfer.CudaTransfer(self.options.device) if cuda else None
        self._stats = LoaderStats()
        try:
            self.servers = Servers(address, self.options, self._transfer, self._stats)  # one or several
        except BaseException:
            if self._transfer is not None:
                self._transfer.close()
            raise
        self.address: str = self.servers.address
        self.epoch = 0
        self._start_position = 0  # the epoch at self.epoch is read from this global position (elastic resume)
        self._resume_batch = 0  # where the next iteration starts (load_state_dict)
        self._position: tuple[int, int, int] | None = None  # (epoch, start position, next batch) of the iteration
        self.timings = LoopTimings()  # this epoch's stages and waits (batchd.client.loader.timings)
        self._verdict, self._verdict_at = "", 0.0  # reported to the servers with the progress

    @property
    def info(self) -> DatasetInfo:
        """What the server(s) serve: with one server, as described again on each reconnect (strict=False)."""
        return self.servers.info

    @property
    def addresses(self) -> list[str]:
        """The servers this loader reads from, as ``HOST:PORT`` (one, or several)."""
        return self.servers.addresses

    def server_stats(self) -> list[dict[str, Any]]:
        """One dict per server: ``address``, ``up``, ``retired`` (no longer named by the address),
        ``batches`` (yielded that it sent first, all iterations), ``error`` (its last), ``share`` of
        the current (else last) epoch's batches (0..1), ``credit`` (grants it may hold),
        ``stalled``, ``stalls``, ``regranted``, ``duplicates``, ``workers`` and ``build_seconds``
        (``batchd.client.iteration.servers.Servers.server_stats``)."""
        return self.servers.server_stats()

    @property
    def _shm(self) -> Any:
        """The shared-memory session of the (first) server (None when it does not lend); tests read it."""
        return self.servers.shm

    # --- DataLoader surface ------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch for this rank: of the epoch's remainder, for an epoch resumed at
        another world size or batch size (``load_state_dict``)."""
        return self._batches_from(self._start_position)

    def _batches_from(self, start_position: int) -> int:
        o = self.options
        return num_batches(sampling.epoch_length(o, self.info), o.batch_size, world_size=o.world_size,
                           drop_last=o.drop_last, start_position=start_position)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its shuffle order and augmentation seeds)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self.epoch:
            self._resume_batch, self._position, self._start_position = 0, None, 0
        self.epoch = epoch

    def __iter__(self) -> Iterator[Any]:
        forks.check(self._owner)
        start, self._resume_batch = self._resume_batch, 0
        return self._iterate(self.epoch, self._start_position, start)

    def _iterate(self, epoch: int, start_position: int, start_batch: int) -> Iterator[Any]:
        total = self._batches_from(start_position)
        b = start_batch
        self.timings.begin(epoch)
        batches = timed(self.servers.batches(epoch, start_batch, total, start_position), self.timings,
                        cuda=self.options.device.type == "cuda", verdict=self._current_verdict, stats=self._stats)
        try:
            for batch in batches:
                b += 1
                self._position = (epoch, start_position, b)
                yield batch
                batch = None  # (not kept alive by this frame, e.g. in the traceback of the next one's error)
                forks.check(self._owner)  # an iterator resumed in a forked child
        finally:
            if forks.forked(self._owner):
                forks.hold(batches)  # the parent's stream: neither closed nor freed here
            else:
                batches.close()
        if b != total:
            raise RuntimeError(f"the server ended epoch {epoch} after {b} of {total} batches")
        if self.epoch == epoch:
            self.epoch, self._start_position = epoch + 1, 0
        self._position = (self.epoch, self._start_position, 0)

    def stats(self) -> dict[str, Any]:
        """This loader's figures as a plain dict: batches and samples yielded, the time the loop
        waited in ``__next__`` (total and p50/p95/p99 per batch, seconds; the wait fraction of
        wall time), batches per server, each server's share of the epoch, credit and stalls
        (``servers``), reconnects, failovers and stalls. Keys and units:
        ``batchd.client.loader.stats``."""
        per_server = self.servers.server_stats()
        return self._stats.snapshot({s["address"]: s["batches"] for s in per_server}, per_server)

    def profile(self) -> Profile:
        """Where this epoch's time went (each batch's stages on the server and here, the loop's wait
        for data), and what bounds it: a dict (``verdict``, ``advice``, ``evidence``,
        ``wait_ratio``, ``stages`` {stage: seconds}, ``shares``, ...) that prints as a table. See
        ``batchd.client.loader.profile`` for the stages, the rules and their thresholds. The wait shows
        as a ``batchd.wait`` range in PyTorch profiler traces (and NVTX on CUDA)."""
        return make_profile(self.timings.snapshot())

    def _current_verdict(self, now: float) -> str:
        """The verdict reported to the servers, recomputed at most every ``_VERDICT_EVERY_S`` once there is one."""
        if not self._verdict or now - self._verdict_at >= _VERDICT_EVERY_S:
            self._verdict_at = now
            verdict = make_profile(self.timings)["verdict"]  # (pending CUDA times are not waited for)
            self._verdict = "" if verdict == "unknown" else verdict
        return self._verdict

    def close(self) -> None:
        """Cancel any stream in progress and close the channels (a shared-memory session ends once
        the batches still held on it are freed). Idempotent. Nothing in a forked child: the
        channels are the parent's."""
        if forks.forked(self._owner):
            return
        self.servers.close()
        if self._transfer is not None:
            self._transfer.close()

    def __enter__(self) -> "RemoteDataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- exact resume ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a small JSON-serialisable dict.

        ``{"version": 2, "epoch": e, "next_batch": k, "start_position": s, "position": p, ...}``: a
        loader given it with ``load_state_dict`` continues with batch k of epoch e (read from
        global position s, 0 unless this epoch was itself resumed elastically), byte for byte what
        this one would have produced next. ``position`` = s + k x batch_size x world_size is the
        global position reached (every rank, stepping together, reached the same one), where a
        loader with another world_size or batch_size continues. Also holds the settings and the
        server's ``fingerprint``, ``build_fingerprint`` and ``build`` (DatasetInfo).
        """
        epoch, start, next_batch = (self._position if self._position is not None
                                    else (self.epoch, self._start_position, self._resume_batch))
        reached = elastic.position_reached(start, next_batch, self.batch_size, self.world_size)
        return {"version": elastic.STATE_VERSION, **elastic.settings_of(self.options, self.info.num_samples),
                **self.info.identity(), "epoch": epoch, "next_batch": next_batch, "start_position": start,
                "position": reached}

    def load_state_dict(self, state: dict[str, Any], strict: bool | None = None) -> None:
        """Continue from ``state`` (from ``state_dict``) at the next iteration.

        strict: True refuses a state saved against another dataset fingerprint (the files
        changed) or build (e.g. another OpenCV): the batches would not be the same bytes. False
        accepts it with a warning. None (default): the loader's ``strict`` (True by default).

        Elastic: ``world_size``, ``rank`` and ``batch_size`` may differ from the saved ones. Every
        rank of the new job loads the same state (e.g. rank 0's); with the same world_size and
        batch_size the saved batch comes next, otherwise the epoch's remainder from the global
        position reached, sharded over the new ranks (``batchd.client.iteration.elastic``; ``len(self)``
        is then its batches). States of version 1 (positions from 0) load too.

        Raises ValueError if the state was saved by a loader with other settings (dataset, shuffle,
        seed, drop_last, transform, sampler or mix), is malformed, or (strict) against other fingerprints, naming
        what differs ("dataset fingerprint A vs B", "opencv 4.10.0 vs 5.0.0"; saved value first).
        """
        elastic.check_state(state, elastic.settings_of(self.options, self.info.num_samples), self.info.identity(),
                            strict=self.strict if strict is None else strict, address=self.address)
        at = elastic.resume_from(state, num_samples=sampling.epoch_length(self.options, self.info),
                                 batch_size=self.batch_size, world_size=self.world_size, drop_last=self.drop_last)
        self.epoch, self._start_position, self._resume_batch, self._position = (at.epoch, at.start_position,
                                                                              at.next_batch, None)
