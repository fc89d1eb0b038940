"""``RemoteDataLoader``: a PyTorch-DataLoader-shaped iterator over batches a batchd server builds."""

from __future__ import annotations

import json
import logging
import time
import weakref
from typing import Any, Iterator

import grpc
import torch

from batchd.client.channel import DEFAULT_MAX_MESSAGE_BYTES, open_channel, resolve_token, tls_settings, translate
from batchd.client.addresses import single_address
from batchd.client.datasets import DatasetInfo, describe, mismatches
from batchd.client.distributed import rank_and_world_size
from batchd.client.receiver import Receiver, _End, to_tensors
from batchd.client.shm import SharedMemorySession, SharedMemoryUnavailable
from batchd.sampler import num_batches
from batchd.v1 import loader_pb2 as pb

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "inline")
_warned_no_shm: set[str] = set()


def _pipeline(transform: Any) -> pb.Pipeline | None:
    """None, a preset name, or an albumentations transform (sent as JSON of A.to_dict)."""
    if transform is None:
        return None
    if isinstance(transform, str):
        if not transform:
            raise ValueError("transform must be None, a preset name or an albumentations transform, not ''")
        return pb.Pipeline(preset=transform)
    import albumentations as A

    if not isinstance(transform, A.BaseCompose | A.BasicTransform):
        raise ValueError(f"transform must be None, a preset name or an albumentations transform, "
                         f"not {type(transform).__name__}")
    if not isinstance(transform, A.Compose):
        transform = A.Compose([transform])
    return pb.Pipeline(albumentations_json=json.dumps(A.to_dict(transform), sort_keys=True))


class RemoteDataLoader:
    """Iterate batches of a dataset that a batchd server at ``address`` decodes and augments.

    Each batch is a dict of tensors: ``image`` [B, H, W, C] (uint8 unless the pipeline changes
    the dtype, e.g. Normalize gives float32), ``label`` int64 [B], ``index`` int64 [B] (dataset
    sample indices), and ``skipped`` int64 [K] when the server left out K unreadable samples
    (dataset ``on_error: skip``; such a batch has B - K samples). Batch ``b`` of an epoch is a pure function of (dataset, transform,
    batch_size, shuffle, seed, epoch, b, rank, world_size): iterating twice, on another server,
    or with another number of server workers gives the same bytes.

    Args:
        address: ``HOST:PORT`` or ``unix:PATH`` of the server; or several servers feeding this
            loader together: a list of addresses, or a DNS name with several addresses
            (``dns:///NAME:PORT``, or ``NAME:PORT`` resolving to several A records, e.g. a
            Kubernetes headless Service). Batches are then split among the servers that are up
            and merged in order, with the same bytes (``batchd.client.multi``).
        dataset: a dataset name from the server's config.
        batch_size: samples per batch (>= 1).
        shuffle: permute the samples each epoch (a pure function of seed and epoch).
        seed: the seed of the shuffle and of the pipeline's random augmentations.
        drop_last: drop the final partial batch (and do not pad shards), as in DataLoader.
        transform: None (images as decoded), a preset name from the server config, or an
            albumentations transform/Compose (sent in albumentations' serialized form).
        rank, world_size: this process's shard, as in DistributedSampler. None (default): from
            torch.distributed (an initialised process group, else the RANK and WORLD_SIZE
            environment variables torchrun sets), else 0 and 1.
        device: None/"cpu" for CPU tensors, or a CUDA device: batches are copied through reused
            pinned buffers on a side stream, overlapping the copy with compute.
        prefetch: batches the server computes ahead of the one being read (>= 1).
        timeout: seconds without a batch before iteration raises TimeoutError.
        connect_timeout: seconds to find the server before raising ConnectionError.
        transport: "auto" (shared memory when this process can read the server's /dev/shm,
            i.e. same host and IPC namespace, else bytes in the gRPC messages), "shm" (shared
            memory or RuntimeError), or "inline" (always bytes in the messages).
        compression: None, or "lz4" to compress inline tensor bytes (for slow remote links).
        reconnect_timeout: if the stream breaks (server restarted, connection lost), seconds to
            keep reconnecting (gRPC's exponential backoff) before raising ConnectionError; the
            stream resumes at the next batch, none missing or repeated. 0 disables.
        failover_timeout: with several servers, seconds a broken server's stream may take to
            resume before its batches go to the other servers (at most reconnect_timeout).
        probe_interval: with several servers, seconds between probes of servers that are down
            (or new addresses of a DNS name); one that answers gets work from the next batch.
        tls, tls_ca, tls_cert, tls_key: TLS to the server: ``tls_ca`` is the PEM file of the CA
            that signed the server's certificate, ``tls_cert`` + ``tls_key`` a client certificate
            (mutual TLS); or ``tls=True`` (system roots) / a ``batchd.client.channel.TLS`` / a dict
            of its fields. None of them: plaintext.
        token: the bearer token for a server with ``auth`` (default: the ``BATCHD_TOKEN``
            environment variable). A missing or wrong one raises AuthenticationError; a dataset
            the token may not read, PermissionDeniedError (both PermissionErrors).
        strict: refuse to mix batches that cannot be byte-identical (as ``strict`` in
            ``nn.Module.load_state_dict``): several servers whose dataset or build fingerprints
            differ raise ValueError, and so does ``load_state_dict`` of a state saved against
            other fingerprints. False: accept, with a warning (see ``DatasetInfo``).

    Memory: over shared memory, a batch's tensors are views of a server slot lent to this
    client; the slot goes back when the last tensor on it is freed. Inline, they are views of
    the received message. Either way a batch stays valid as long as it is referenced, and may
    be modified in place, as with DataLoader.

    Raises (at construction): ValueError for bad arguments, ConnectionError if no server
    answers, DatasetNotFoundError if the server has no such dataset. Iteration raises
    ValueError (bad preset or pipeline, with the server's explanation), SampleError (a sample
    could not be read; names dataset, index and file), ShapeMismatchError, WorkerError,
    ResourceExhaustedError (a server limit: open streams, batch bytes), ConnectionError (server
    gone) or TimeoutError. With auth: AuthenticationError / PermissionDeniedError.

    Epochs: each complete pass advances ``epoch`` by one (so shuffle differs per pass, as with
    DataLoader); ``set_epoch(e)`` picks the epoch explicitly, as with DistributedSampler.

    Resume: ``state_dict()`` is a small dict (the settings and the position: epoch, next batch);
    ``load_state_dict(state)`` on a new loader makes its next iteration start at exactly that
    batch, computing nothing before it.
    """

    def __new__(cls, address: Any = None, *args: Any, **kwargs: Any):
        """Several servers (a list, or a DNS name with several addresses): a MultiServerLoader."""
        if cls is RemoteDataLoader and address is not None:  # (None: copy/pickle machinery)
            from batchd.client.addresses import server_addresses

            addresses = server_addresses(address)
            if len(addresses) > 1:
                from batchd.client.multi import MultiServerLoader

                obj = super().__new__(MultiServerLoader)
                obj._resolved = addresses
                return obj
        return super().__new__(cls)

    def __init__(
        self,
        address: str,
        dataset: str,
        *,
        batch_size: int = 1,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        transform: Any = None,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device | None = None,
        prefetch: int = 2,
        timeout: float = 120.0,
        connect_timeout: float = 10.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        transport: str = "auto",
        compression: str | None = None,
        reconnect_timeout: float = 60.0,
        failover_timeout: float = 5.0,
        probe_interval: float = 5.0,
        tls: Any = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        token: str | None = None,
        strict: bool = True,
    ):
        address = single_address(address)  # several servers: MultiServerLoader (see __new__)
        rank, world_size = rank_and_world_size(rank, world_size)
        self.failover_timeout, self.probe_interval = failover_timeout, probe_interval
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
        if not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
        if not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank!r}")
        if not isinstance(prefetch, int) or prefetch < 1:
            raise ValueError(f"prefetch must be a positive integer, got {prefetch!r}")
        if not isinstance(seed, int) or not 0 <= seed < 1 << 64:
            raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
        if timeout <= 0:
            raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        if compression not in (None, "lz4"):
            raise ValueError(f"compression must be None or 'lz4', got {compression!r}")
        self.transport = transport
        self.strict = bool(strict)
        self.reconnect_timeout = reconnect_timeout
        self._compression = pb.COMPRESSION_LZ4 if compression == "lz4" else pb.COMPRESSION_NONE
        self._connect_timeout = connect_timeout
        self._shm: SharedMemorySession | None = None
        self._shm_tried = False
        self.address = address
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.rank = rank
        self.world_size = world_size
        self.prefetch = prefetch
        self.timeout = timeout
        self.epoch = 0
        self._pipeline = _pipeline(transform)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self._transfer = None
        if self.device.type == "cuda":
            from batchd.client.transfer import CudaTransfer

            self._transfer = CudaTransfer(self.device)
        elif self.device.type != "cpu":
            raise ValueError(f"device must be None, 'cpu' or a CUDA device, got {device!r}")
        self._channel = open_channel(address, connect_timeout=connect_timeout, max_message_bytes=max_message_bytes,
                                     tls=tls_settings(tls, tls_ca, tls_cert, tls_key), token=resolve_token(token))
        self._finalizer = weakref.finalize(self, self._channel.close)
        # StreamBatches is parsed by batchd.wire (tensors as views of the message, no copies)
        self._stream_batches = self._channel.unary_stream(
            "/batchd.v1.BatchLoader/StreamBatches",
            request_serializer=pb.StreamBatchesRequest.SerializeToString,
            response_deserializer=None,
        )
        self._receiver: Receiver | None = None
        self._resume_batch = 0  # where the next iteration starts (load_state_dict)
        self._position: tuple[int, int] | None = None  # (epoch, next batch) of the current iteration
        try:
            self.info: DatasetInfo = describe(self._channel, address, dataset, timeout=connect_timeout)
        except BaseException:
            self.close()
            raise

    # --- DataLoader surface ------------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch for this rank."""
        return num_batches(self.info.num_samples, self.batch_size, world_size=self.world_size, drop_last=self.drop_last)

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch`` for the next iteration (its shuffle order and augmentation seeds)."""
        if not isinstance(epoch, int) or epoch < 0:
            raise ValueError(f"epoch must be a non-negative integer, got {epoch!r}")
        if epoch != self.epoch:
            self._resume_batch, self._position = 0, None
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        start, self._resume_batch = self._resume_batch, 0
        return self._iterate(self.epoch, start)

    def close(self) -> None:
        """Cancel any stream in progress and close the channel. Idempotent."""
        if self._receiver is not None:
            self._receiver.stop()
            self._receiver = None
        if self._shm is not None:
            # tensors still held keep their slots: the session (and channel) ends with the last one
            self._shm.close()
            if self._shm.outstanding:
                self._finalizer.detach()
                return
        self._finalizer()

    def __enter__(self) -> "RemoteDataLoader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- internals ---------------------------------------------------------------------------

    def _shared_memory(self) -> SharedMemorySession | None:
        """The shared-memory session, opened on first use; None when the transport is inline."""
        if self.transport == "inline" or self._shm_tried:
            return self._shm
        self._shm_tried = True
        try:
            self._shm = SharedMemorySession.open(self._channel, self.address, self._connect_timeout)
        except SharedMemoryUnavailable as e:
            if self.transport == "shm":
                raise RuntimeError(f"transport='shm' but shared memory with {self.address} is unavailable: {e}") from None
            if self.address not in _warned_no_shm:
                _warned_no_shm.add(self.address)
                log.warning("shared memory with %s is unavailable (%s); batches travel in gRPC messages", self.address, e)
        return self._shm

    def _request(self, epoch: int, start_batch: int, stride: int = 1, offset: int = 0) -> pb.StreamBatchesRequest:
        shm = self._shared_memory()
        return pb.StreamBatchesRequest(
            dataset=self.dataset, pipeline=self._pipeline, batch_size=self.batch_size, shuffle=self.shuffle,
            seed=self.seed, epoch=epoch, drop_last=self.drop_last, rank=self.rank, world_size=self.world_size,
            start_batch=start_batch, prefetch=self.prefetch,
            transport=pb.TRANSPORT_SHARED_MEMORY if shm is not None else pb.TRANSPORT_INLINE,
            session=shm.session if shm is not None else "", compression=self._compression,
            batch_stride=stride if stride > 1 else 0, batch_offset=offset,
        )

    def _convert(self, raw) -> tuple[int, Any]:
        batch = self._shm.tensors(raw) if raw.segment else to_tensors(raw)
        if raw.skipped:
            batch["skipped"] = torch.tensor(raw.skipped, dtype=torch.int64)
        if self._transfer is not None:
            batch = self._transfer.to_device(batch)
        return raw.batch_index, batch

    def _open_stream(self, epoch: int, start_batch: int, stride: int = 1, offset: int = 0) -> Receiver:
        """Stream batches start_batch + offset, + stride, ... (every batch with the defaults)."""
        try:
            call = self._stream_batches(self._request(epoch, start_batch, stride, offset))
        except grpc.RpcError as e:
            raise translate(e, self.address) from None
        receiver = self._receiver = Receiver(call, self.address, self._convert)
        receiver.start()
        return receiver

    def _reconnect(self, epoch: int, next_batch: int, error: ConnectionError) -> Receiver:
        """Wait for the server to come back (gRPC's own reconnect backoff) and resume at next_batch.

        Raises ConnectionError after ``reconnect_timeout`` seconds.
        """
        deadline = time.monotonic() + self.reconnect_timeout
        log.warning("lost the stream from %s at epoch %d, batch %d (%s); reconnecting for up to %g s",
                    self.address, epoch, next_batch, error, self.reconnect_timeout)
        self._shm, self._shm_tried = None, False  # a restarted server has new shared memory
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ConnectionError(
                    f"lost the stream from {self.address} at epoch {epoch}, batch {next_batch}, and could not "
                    f"resume within reconnect_timeout={self.reconnect_timeout:g} s: {error}"
                ) from None
            try:
                grpc.channel_ready_future(self._channel).result(timeout=remaining)
                receiver = self._open_stream(epoch, next_batch)
                log.info("resumed the stream from %s at epoch %d, batch %d", self.address, epoch, next_batch)
                return receiver
            except grpc.FutureTimeoutError:
                continue
            except ConnectionError as e:
                error = e
                time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def _iterate(self, epoch: int, start_batch: int) -> Iterator[dict[str, torch.Tensor]]:
        if not self._finalizer.alive:
            raise RuntimeError("the loader is closed")
        if self._receiver is not None:  # a previous iteration was abandoned: one stream at a time
            self._receiver.stop()
        receiver = self._open_stream(epoch, start_batch)
        self._position = (epoch, start_batch)
        expected = start_batch
        try:
            while True:
                try:
                    item = receiver.get(self.timeout, f"dataset {self.dataset!r}, epoch {epoch}, batch {expected}")
                except ConnectionError as e:
                    receiver.stop()
                    if self.reconnect_timeout <= 0:
                        raise
                    receiver = self._reconnect(epoch, expected, e)
                    continue
                if isinstance(item, _End):
                    break
                batch_index, batch = item
                if batch_index != expected:
                    raise RuntimeError(f"the server sent batch {batch_index} where batch {expected} was due")
                if self._transfer is not None:
                    batch = self._transfer.hand_over(*batch)
                expected += 1
                self._position = (epoch, expected)
                yield batch
            if expected != len(self):
                raise RuntimeError(f"the server ended epoch {epoch} after {expected} of {len(self)} batches")
            if self.epoch == epoch:
                self.epoch = epoch + 1
            self._position = (self.epoch, 0)
        finally:
            receiver.stop()
            if self._receiver is receiver:
                self._receiver = None

    # --- exact resume ------------------------------------------------------------------------

    def _identity(self) -> dict[str, Any]:
        """What determines the batches, besides the position."""
        return {
            "dataset": self.dataset, "num_samples": self.info.num_samples, "batch_size": self.batch_size,
            "shuffle": self.shuffle, "seed": self.seed, "drop_last": self.drop_last, "rank": self.rank,
            "world_size": self.world_size,
            "pipeline": "" if self._pipeline is None else self._pipeline.SerializeToString(deterministic=True).hex(),
        }

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a small JSON-serialisable dict.

        ``{"epoch": e, "next_batch": k, ...}``: a loader given it with ``load_state_dict``
        continues with batch k of epoch e, byte for byte what this one would have produced next.
        Also holds the server's ``fingerprint``, ``build_fingerprint`` and ``build`` (DatasetInfo).
        """
        epoch, next_batch = self._position if self._position is not None else (self.epoch, self._resume_batch)
        return {"version": 1, **self._identity(), **self.info.identity(), "epoch": epoch, "next_batch": next_batch}

    def load_state_dict(self, state: dict[str, Any], strict: bool | None = None) -> None:
        """Continue from ``state`` (from ``state_dict``) at the next iteration.

        strict: True refuses a state saved against another dataset fingerprint (the files
        changed) or build (e.g. another OpenCV): the batches would not be the same bytes. False
        accepts it with a warning. None (default): the loader's ``strict`` (True by default).

        Raises ValueError if the state was saved by a loader with other settings (dataset,
        batch_size, shuffle, seed, drop_last, rank, world_size, transform), is malformed, or
        (strict) against other fingerprints, naming what differs ("dataset fingerprint A vs B",
        "opencv 4.10.0 vs 5.0.0"; saved value first).
        """
        if not isinstance(state, dict) or state.get("version") != 1:
            raise ValueError("not a RemoteDataLoader state_dict (version 1)")
        for key, value in self._identity().items():
            if state.get(key) != value:
                raise ValueError(f"state_dict was saved with {key}={state.get(key)!r}, this loader has {key}={value!r}")
        differ = mismatches(state, self.info.identity())
        if differ:
            what = (f"state_dict of dataset {self.dataset!r} was saved where the batches were other bytes than "
                    f"{self.address} now serves: " + "; ".join(differ) + " (saved vs now)")
            if (self.strict if strict is None else strict):
                raise ValueError(what + "; load_state_dict(state, strict=False) resumes anyway")
            log.warning("%s; resuming anyway (strict=False)", what)
        epoch, next_batch = state.get("epoch"), state.get("next_batch")
        if not isinstance(epoch, int) or epoch < 0 or not isinstance(next_batch, int) or not 0 <= next_batch <= len(self):
            raise ValueError(f"state_dict has an invalid position: epoch={epoch!r}, next_batch={next_batch!r}")
        if next_batch == len(self):
            epoch, next_batch = epoch + 1, 0
        self.epoch, self._resume_batch, self._position = epoch, next_batch, None
