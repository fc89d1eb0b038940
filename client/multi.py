"""Several batchd servers feeding one loader (``RemoteDataLoader`` given several addresses).

The rule. An iteration is cut into *splits*. A split starts at batch ``start`` with the servers
``s_0 .. s_{n-1}`` that are up (in address order) and asks server ``s_i`` for the batches
``b >= start`` with ``(b - start) % n == i`` (StreamBatchesRequest ``start_batch=start,
batch_stride=n, batch_offset=i``). The loader yields batch ``b`` from stream ``(b - start) % n``,
so batches still come in order, each once. Batch b's bytes are a pure function of the request
and b, whichever server builds it, so a stream over several servers is byte for byte the stream
one server would send, and ``state_dict``/``load_state_dict``, ``len`` and ``set_epoch`` mean
what they mean with one server.

A new split starts at the next batch to deliver when

* a server fails: its stream breaks (ConnectionError) and it does not take a new one within
  ``failover_timeout`` seconds (at most ``reconnect_timeout``), or it comes back serving what the
  prober would leave out (``ServerConnection.check_unchanged``: another number of samples, or
  other fingerprints under ``strict``; named in its ``server_stats`` error), or it sends nothing for
  ``timeout`` seconds while others are up. It is marked down and the remaining servers share the
  remaining batches. Batches the others had prefetched under the old split are dropped and
  rebuilt (same bytes);
* a server joins: a background prober tries every down server every ``probe_interval`` seconds,
  and reads the address again (``AddressSource``: a DNS name resolved anew, a ``file:`` list
  re-read when it changed) to find new servers. One that answers (health SERVING, the same
  dataset size and fingerprints) gets work from the next batch not yet asked of the others:
  the split in place goes on up to ``start + n * (prefetch + 1)``, the batches its servers have
  most likely built or are building, and the new split (opened at once, so its servers start
  building) takes over from there;
* a server leaves the address (no longer resolved or listed): the next batch starts a split
  without it (a server that stops is a failure, above).

Hedged requests (``batchd.client.hedge``): a batch late from its server is also asked of another
one of the split, within a budget; the first copy is yielded.

With no server left, the loader keeps trying all of them for ``reconnect_timeout`` seconds and
then raises ConnectionError. Each server has its own ``ServerConnection`` (channel,
shared-memory session, reporter; ``transport="auto"`` picks shared memory per server: on for the
sidecar, inline for others); all share the loader's options (the device resolved in the
caller's thread) and its ``CudaTransfer``. A stream stopped by a new split or a failover is
reported abandoned with the leases received on it, so the server releases those gRPC buffered.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from batchd.client.addresses import AddressSource
from batchd.client.connection import deliver
from batchd.client.hedge import Hedger
from batchd.client.loader_stats import LoaderStats
from batchd.client.membership import PROBE_CONNECT_S, ServerSet, _Server
from batchd.client.options import LoaderOptions
from batchd.client.receiver import Receiver, _End
from batchd.errors import DatasetChangedError, DatasetNotFoundError

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Split:
    """From batch ``start`` on, batch b comes from ``servers[(b - start) % n]``."""

    start: int
    servers: list[_Server]
    start_position: int = 0  # the epoch's remainder read (elastic resume; batchd.sampler)
    receivers: dict[int, Receiver] = field(default_factory=dict)  # position in servers -> its stream

    def slot(self, b: int) -> int:
        return (b - self.start) % len(self.servers)

    def stop(self) -> None:
        for receiver in self.receivers.values():
            receiver.stop()
        self.receivers.clear()


class MultiServerLoader(ServerSet):
    """The batches of several servers (see the module docstring); built by ``RemoteDataLoader``
    when ``address`` names several servers (a list, or a DNS name with several addresses; see
    ``batchd.client.addresses``), which reads through it (``loader.servers``).

    At least one server must answer at construction; the others are probed later. Raises
    ValueError if the servers disagree on the dataset's size, or (``strict``, the default) on
    its dataset or build fingerprint, naming the servers and what differs; a server that
    rejoins later (probed) or comes back after a broken stream (reconnected) with another
    dataset size, or other fingerprints, is left out (``difference``, the same check both ways)
    and the others take its batches. ``strict=False`` accepts other fingerprints.
    """

    def __init__(self, source: Any, addresses: list[str], options: LoaderOptions, transfer: Any = None,
                 stats: LoaderStats | None = None):
        self._source = source
        self._address_source = AddressSource(source)
        self.options = options
        self._transfer = transfer
        self.loader_stats = stats if stats is not None else LoaderStats()
        self._hedger = Hedger(options.hedge, self.loader_stats) if options.hedge is not None else None
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one probe round at a time (prober thread or a failover)
        self._closed = False
        self._split: _Split | None = None
        self._next_split: _Split | None = None  # takes over from its start (a server joined)
        self._rejoined = threading.Event()  # a server came (back) up: it joins the split
        self._retired = threading.Event()  # a server up was removed from the address: split again now
        self._stop_probing = threading.Event()
        self._servers = [_Server(a) for a in addresses]
        self.info = self._open_all()[0].conn.info
        self.address = source if isinstance(source, str) else ",".join(addresses)
        sizes = {s.address: s.conn.info.num_samples for s in self._servers if s.up}
        if len(set(sizes.values())) > 1:
            self.close()
            raise ValueError(f"the servers disagree on the size of dataset {options.dataset!r}: {sizes}")
        self._check_fingerprints([s for s in self._servers if s.up])
        self.start_probing()

    # --- splits --------------------------------------------------------------------------------

    def _start_split(self, epoch: int, start: int, total: int, why: str, error: BaseException | None = None, *,
                     start_position: int = 0) -> _Split:
        for old in (self._split, self._next_split):
            if old is not None:
                old.stop()
        self._split = self._next_split = None
        if not self._working():
            self._wait_for_any(epoch, start, error or ConnectionError("every server is down"))
        self._rejoined.clear()
        self._retired.clear()
        split = self._split = self._open_split(epoch, start, total, start_position, why)
        return split

    def _open_split(self, epoch: int, start: int, total: int, start_position: int, why: str) -> _Split:
        """Streams of every working server for the batches from ``start`` on (module docstring)."""
        servers = self._working()
        split = _Split(start, servers, start_position)
        n = len(servers)
        try:
            for i, server in enumerate(servers):
                if start + i < total:
                    split.receivers[i] = server.conn.open_stream(epoch, start, n, i, start_position=start_position)
        except BaseException:
            split.stop()
            raise
        log.log(logging.INFO if why else logging.DEBUG, "epoch %d from batch %d: %d server%s (%s)%s", epoch, start, n,
                "" if n == 1 else "s", ", ".join(s.address for s in servers), f"; {why}" if why else "")
        return split

    def _adjust(self, split: _Split, epoch: int, b: int, total: int) -> _Split:
        """Before batch b: take over the next split at its start, split again without a server
        that left the address, or plan a split with a server that joined."""
        if self._next_split is not None and b >= self._next_split.start:
            split.stop()
            split, self._split, self._next_split = self._next_split, self._next_split, None
        if self._retired.is_set():
            return self._start_split(epoch, b, total, "a server left the address", start_position=split.start_position)
        if self._rejoined.is_set() and self._next_split is None:
            self._rejoined.clear()
            working = self._working()
            if working and working != split.servers:
                start = b + len(split.servers) * (self.options.prefetch + 1)  # the batches built ahead go on
                if start < total:
                    self._next_split = self._open_split(epoch, start, total, split.start_position,
                                                        "a server joined")
        return split

    def _reconnect_one(self, split: _Split, i: int, epoch: int, b: int) -> Receiver | None:
        """Server i of the split broke: a new stream of the same batches from b on, within the
        failover window, or None. Raises DatasetChangedError / DatasetNotFoundError where the
        server came back with another dataset (``check_unchanged``), before any stream on it."""
        server = split.servers[i]
        now = time.monotonic()
        if server.failing_since is None:
            server.failing_since = now
        o = self.options
        window = min(o.failover_timeout, o.reconnect_timeout) if o.reconnect_timeout > 0 else 0.0
        deadline = server.failing_since + window
        conn = server.conn
        conn.new_session()  # a restarted server has new shared memory; the old session is closed
        while not self._closed:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not conn.wait_ready(remaining):
                return None
            try:
                conn.check_unchanged(min(remaining, o.connect_timeout))
                # same batches as before: b is this server's next one, the stride is unchanged
                return conn.open_stream(epoch, b, len(split.servers), 0, start_position=split.start_position)
            except (ConnectionError, TimeoutError):
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _check_unchanged(self) -> None:
        """Before an epoch: describe the dataset again on each working server that streamed
        since it was last described (it may have restarted over other data between epochs);
        one that changed is left out, as on a reconnect. One that does not answer is left to
        its stream's failure (and to ``_reconnect_one``'s check)."""
        for server in self._working():
            if not server.conn.streamed:
                continue
            try:
                server.conn.check_unchanged(self.options.connect_timeout)
            except (DatasetChangedError, DatasetNotFoundError) as e:
                log.warning("batchd server %s is left out: %s", server.address, e)
                self._mark_down(server, e)
            except (ConnectionError, TimeoutError):
                pass

    def _recover(self, split: _Split, i: int, epoch: int, b: int, total: int, error: BaseException) -> _Split:
        """Server i of ``split`` failed at batch b: reconnect to it, or split again without it."""
        server = split.servers[i]
        receiver = split.receivers.pop(i, None)
        if receiver is not None:
            receiver.stop()
        if isinstance(error, ConnectionError):
            try:
                again = self._reconnect_one(split, i, epoch, b)
            except (DatasetChangedError, DatasetNotFoundError) as e:  # left out, as _probe leaves it out
                again, error = None, e
            if again is not None:
                log.info("resumed the stream from %s at epoch %d, batch %d", server.address, epoch, b)
                self.loader_stats.count("reconnects")
                split.receivers[i] = again
                return split
        self._mark_down(server, error)
        self.loader_stats.count("failovers")
        log.warning("batchd server %s failed at epoch %d, batch %d (%s); the other servers take its batches",
                    server.address, epoch, b, error)
        return self._start_split(epoch, b, total, f"{server.address} is down", error,
                                 start_position=split.start_position)

    def _wait_for_any(self, epoch: int, b: int, error: BaseException) -> None:
        """No server is up: try them all for reconnect_timeout seconds, else raise ConnectionError."""
        deadline = time.monotonic() + max(0.0, self.options.reconnect_timeout)
        while not self._closed:
            self._probe_down()
            if self._working():
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            time.sleep(min(0.5, remaining))
        if self._closed:
            raise RuntimeError("the loader is closed")
        raise ConnectionError(
            f"lost every batchd server ({', '.join(self.addresses)}) at epoch {epoch}, batch {b}, and none came back "
            f"within reconnect_timeout={self.options.reconnect_timeout:g} s: {error}"
        ) from None

    # --- iteration -----------------------------------------------------------------------------

    def batches(self, epoch: int, start_batch: int, total: int, start_position: int = 0
                ) -> Iterator[dict[str, torch.Tensor]]:
        """Batches start_batch .. total - 1 of ``epoch`` (its remainder from global position
        ``start_position``), in order, from the servers that are up."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        self._check_unchanged()
        split = self._start_split(epoch, start_batch, total, "", start_position=start_position)
        hedger = self._hedger
        if hedger is not None:
            iteration = hedger.begin(lambda server, b: server.conn.open_stream(
                epoch, b, start_position=start_position, end_batch=b + 1, hedge=True))
        b = start_batch
        what = f"dataset {self.options.dataset!r}, epoch {epoch}"
        try:
            while b < total:
                split = self._adjust(split, epoch, b, total)
                i = split.slot(b)
                server = split.servers[i]
                receiver = split.receivers[i]
                others = lambda: [s for s in split.servers if s is not server and s.up and not s.retired]  # noqa: E731
                try:
                    if hedger is None:
                        item, source, sender = receiver.get(self.options.timeout, f"{what}, batch {b}"), receiver, server
                    else:
                        peers = [r for j, r in split.receivers.items() if j != i]
                        item, source, sender = hedger.wait(b, server, receiver, peers, self.options.timeout,
                                                           f"{what}, batch {b}", others)
                except ConnectionError as e:
                    e.__traceback__ = None  # its frames would keep this generator's last batch (and lease)
                    split = self._recover(split, i, epoch, b, total, e)
                    continue
                except TimeoutError as e:
                    if sum(s.up for s in self._servers) < 2:
                        raise
                    e.__traceback__ = None
                    split = self._recover(split, i, epoch, b, total, e)
                    continue
                if isinstance(item, _End):
                    raise RuntimeError(f"the server at {server.address} ended its stream before batch {b} of epoch {epoch}")
                if item.batch_index != b:
                    raise RuntimeError(f"the server at {sender.address} sent batch {item.batch_index} where batch {b} was due")
                if sender is server:
                    server.failing_since = None
                sender.batches += 1
                batch = deliver(item, source, self._transfer)
                if hedger is not None:
                    after = b + len(split.servers)
                    limit = total if self._next_split is None else self._next_split.start
                    hedger.settled(b, source is not receiver, server, receiver, after if after < limit else None, others)
                b += 1
                yield batch
                item = batch = None  # (not kept by this frame once the loop has it)
        finally:
            if hedger is not None:
                hedger.end(iteration)
            split.stop()  # (an abandoned iteration's split was already stopped by the next one)
            if self._split is split:
                self._split = None
            if self._next_split is not None and self._split is None:
                self._next_split.stop()
                self._next_split = None

    def close(self) -> None:
        """Cancel the streams, stop probing, close every server's channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_probing.set()
        for split in (self._split, self._next_split):
            if split is not None:
                split.stop()
        self._split = self._next_split = None
        for s in self._servers:
            if s.conn is not None:
                s.conn.close()
        prober = getattr(self, "_prober", None)
        if prober is not None and prober is not threading.current_thread():
            prober.join(PROBE_CONNECT_S + 1.0)
