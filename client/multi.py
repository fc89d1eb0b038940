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
  ``failover_timeout`` seconds (at most ``reconnect_timeout``), or it sends nothing for
  ``timeout`` seconds while others are up. It is marked down and the remaining servers share the
  remaining batches. Batches the others had prefetched under the old split are dropped and
  rebuilt (same bytes);
* a server that was down answers again: a background prober tries every down server (and, for a
  DNS name, every new address it resolves to) every ``probe_interval`` seconds, and the next
  batch starts a split that includes it.

With no server left, the loader keeps trying all of them for ``reconnect_timeout`` seconds and
then raises ConnectionError. Each server has its own ``ServerConnection`` (channel,
shared-memory session, reporter; ``transport="auto"`` picks shared memory per server: on for the
sidecar, inline for others); all share the loader's options (the device resolved in the
caller's thread) and its ``CudaTransfer``. A stream stopped by a new split or a failover is
reported abandoned with the leases received on it, so the server releases those gRPC buffered.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch

from batchd.client.addresses import is_name, server_addresses
from batchd.client.connection import ServerConnection, deliver
from batchd.client.datasets import mismatches
from batchd.client.options import LoaderOptions
from batchd.client.receiver import Receiver, _End

log = logging.getLogger(__name__)

_PROBE_CONNECT_S = 2.0  # connect timeout of one probe


@dataclass(eq=False)
class _Server:
    address: str
    conn: ServerConnection | None = None  # channel, shared memory, streams
    up: bool = False
    error: str = ""
    batches: int = 0  # batches delivered from this server (all iterations)
    failing_since: float | None = None  # first failure of a run of failures (reconnect window)


@dataclass(eq=False)
class _Split:
    """From batch ``start`` on, batch b comes from ``servers[(b - start) % n]``."""

    start: int
    servers: list[_Server]
    receivers: dict[int, Receiver] = field(default_factory=dict)  # position in servers -> its stream

    def slot(self, b: int) -> int:
        return (b - self.start) % len(self.servers)

    def stop(self) -> None:
        for receiver in self.receivers.values():
            receiver.stop()
        self.receivers.clear()


class MultiServerLoader:
    """The batches of several servers (see the module docstring); built by ``RemoteDataLoader``
    when ``address`` names several servers (a list, or a DNS name with several addresses; see
    ``batchd.client.addresses``), which reads through it (``loader.servers``).

    At least one server must answer at construction; the others are probed later. Raises
    ValueError if the servers disagree on the dataset's size, or (``strict``, the default) on
    its dataset or build fingerprint, naming the servers and what differs; a server that
    rejoins later with other fingerprints is left out. ``strict=False`` accepts them.
    """

    def __init__(self, source: Any, addresses: list[str], options: LoaderOptions, transfer: Any = None):
        self._source = source
        self.options = options
        self._transfer = transfer
        self._lock = threading.Lock()
        self._probe_lock = threading.Lock()  # one probe round at a time (prober thread or a failover)
        self._closed = False
        self._split: _Split | None = None
        self._rejoined = threading.Event()  # a server came (back) up: split again at the next batch
        self._stop_probing = threading.Event()
        self._servers = [_Server(a) for a in addresses]
        self.info = self._open_all()[0].conn.info
        self.address = source if isinstance(source, str) else ",".join(addresses)
        sizes = {s.address: s.conn.info.num_samples for s in self._servers if s.up}
        if len(set(sizes.values())) > 1:
            self.close()
            raise ValueError(f"the servers disagree on the size of dataset {options.dataset!r}: {sizes}")
        self._check_fingerprints([s for s in self._servers if s.up])
        self._prober = threading.Thread(target=_probe_loop, args=(weakref.ref(self), self._stop_probing),
                                        name="batchd-probe", daemon=True)
        self._prober.start()

    # --- servers -----------------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        return [s.address for s in self._servers]

    def server_stats(self) -> list[dict[str, Any]]:
        """Per server: address, up, batches delivered from it, last error."""
        with self._lock:
            return [{"address": s.address, "up": s.up, "batches": s.batches, "error": s.error} for s in self._servers]

    def _check_fingerprints(self, servers: list[_Server]) -> None:
        """Servers whose dataset or build fingerprint differ from the first's: ValueError naming
        them and what differs (strict), else a warning."""
        first = servers[0]
        differ = [f"{first.address} vs {s.address}: {'; '.join(d)}" for s in servers[1:]
                  if (d := mismatches(first.conn.info.identity(), s.conn.info.identity()))]
        if not differ:
            return
        msg = f"the servers would send different bytes for dataset {self.options.dataset!r}: " + " | ".join(differ)
        if self.options.strict:
            self.close()
            raise ValueError(msg + "; strict=False accepts them")
        log.warning("%s; mixing them anyway (strict=False)", msg)

    def _open_all(self) -> list[_Server]:
        def open_one(server: _Server) -> ServerConnection:
            return ServerConnection(server.address, self.options, self._transfer)

        with concurrent.futures.ThreadPoolExecutor(len(self._servers), thread_name_prefix="batchd-open") as pool:
            futures = {s: pool.submit(open_one, s) for s in self._servers}
        fatal: BaseException | None = None
        for s, fut in futures.items():
            try:
                s.conn, s.up = fut.result(), True
            except (ConnectionError, TimeoutError) as e:
                s.error = str(e)
            except BaseException as e:  # bad arguments, unknown dataset: the same on every server
                fatal = fatal or e
        up = [s for s in self._servers if s.up]
        if fatal is not None or not up:
            for s in up:
                s.conn.close()
            if fatal is not None:
                raise fatal
            raise ConnectionError("no batchd server answered at any of " + ", ".join(self.addresses) + ": "
                                  + "; ".join(s.error for s in self._servers))
        for s in self._servers:
            if not s.up:
                log.warning("batchd server %s is unavailable (%s); it gets work once it answers", s.address, s.error)
        return up

    def _probe(self, server: _Server) -> bool:
        """Try a down server: a fresh connection (new channel and shared memory)."""
        if server.up:
            return True
        options = dataclasses.replace(self.options, connect_timeout=min(self.options.connect_timeout, _PROBE_CONNECT_S))
        try:
            fresh = ServerConnection(server.address, options, self._transfer)
        except (ConnectionError, TimeoutError) as e:
            server.error = str(e)
            return False
        except Exception as e:  # the server is up but cannot serve this dataset
            if server.error != str(e):
                log.warning("batchd server %s answers but cannot serve this loader: %s", server.address, e)
            server.error = str(e)
            return False
        if fresh.info.num_samples != self.info.num_samples:
            msg = (f"dataset {self.options.dataset!r} has {fresh.info.num_samples} samples there, "
                   f"{self.info.num_samples} on the others")
            if server.error != msg:
                log.warning("batchd server %s is left out: %s", server.address, msg)
            server.error = msg
            fresh.close()
            return False
        differ = mismatches(self.info.identity(), fresh.info.identity())
        if differ and self.options.strict:
            msg = f"dataset {self.options.dataset!r} differs there from the other servers: {'; '.join(differ)} (strict=False accepts it)"
            if server.error != msg:
                log.warning("batchd server %s is left out: %s", server.address, msg)
            server.error = msg
            fresh.close()
            return False
        with self._lock:
            if self._closed:
                fresh.close()
                return False
            old, server.conn, server.up, server.error, server.failing_since = server.conn, fresh, True, "", None
            self._rejoined.set()
        log.info("batchd server %s is up; it gets work from the next batch", server.address)
        if old is not None:
            t0 = time.monotonic()
            old.close()
            log.debug("closed the old channel to %s in %.2f s", server.address, time.monotonic() - t0)
        return True

    def _probe_down(self) -> None:
        """One round of the prober: new addresses of a DNS name, then every down server."""
        with self._probe_lock:
            self._probe_round()

    def _probe_round(self) -> None:  # (under _probe_lock)
        if is_name(self._source):
            try:
                current = server_addresses(self._source)
            except ValueError:
                current = []
            with self._lock:
                known = {s.address for s in self._servers}
                for a in current:
                    if a not in known and not self._closed:
                        log.info("%s now also resolves to %s", self._source, a)
                        self._servers.append(_Server(a))
        down = [s for s in self._servers if not s.up]
        if not down or self._closed or self._stop_probing.is_set():
            return
        # in parallel: each probe may wait its whole connect timeout for a server that is gone
        with concurrent.futures.ThreadPoolExecutor(min(8, len(down)), thread_name_prefix="batchd-probe") as pool:
            list(pool.map(self._probe, down))

    def _mark_down(self, server: _Server, error: BaseException) -> None:
        with self._lock:
            server.up, server.error = False, str(error)
        if server.conn is not None:
            server.conn.stop_stream()

    # --- splits --------------------------------------------------------------------------------

    def _start_split(self, epoch: int, start: int, total: int, why: str, error: BaseException | None = None) -> _Split:
        if self._split is not None:
            self._split.stop()
            self._split = None
        if not any(s.up for s in self._servers):
            self._wait_for_any(epoch, start, error or ConnectionError("every server is down"))
        with self._lock:
            self._rejoined.clear()
            servers = [s for s in self._servers if s.up]
        split = self._split = _Split(start, servers)
        n = len(servers)
        try:
            for i, server in enumerate(servers):
                if start + i < total:
                    split.receivers[i] = server.conn.open_stream(epoch, start, n, i)
        except BaseException:
            split.stop()
            raise
        log.log(logging.INFO if why else logging.DEBUG, "epoch %d from batch %d: %d server%s (%s)%s", epoch, start, n,
                "" if n == 1 else "s", ", ".join(s.address for s in servers), f"; {why}" if why else "")
        return split

    def _reconnect_one(self, split: _Split, i: int, epoch: int, b: int) -> Receiver | None:
        """Server i of the split broke: a new stream of the same batches from b on, within the
        failover window, or None."""
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
                # same batches as before: b is this server's next one, the stride is unchanged
                return conn.open_stream(epoch, b, len(split.servers), 0)
            except ConnectionError:
                time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
        return None

    def _recover(self, split: _Split, i: int, epoch: int, b: int, total: int, error: BaseException) -> _Split:
        """Server i of ``split`` failed at batch b: reconnect to it, or split again without it."""
        server = split.servers[i]
        receiver = split.receivers.pop(i, None)
        if receiver is not None:
            receiver.stop()
        if isinstance(error, ConnectionError):
            again = self._reconnect_one(split, i, epoch, b)
            if again is not None:
                log.info("resumed the stream from %s at epoch %d, batch %d", server.address, epoch, b)
                split.receivers[i] = again
                return split
        self._mark_down(server, error)
        log.warning("batchd server %s failed at epoch %d, batch %d (%s); the other servers take its batches",
                    server.address, epoch, b, error)
        return self._start_split(epoch, b, total, f"{server.address} is down", error)

    def _wait_for_any(self, epoch: int, b: int, error: BaseException) -> None:
        """No server is up: try them all for reconnect_timeout seconds, else raise ConnectionError."""
        deadline = time.monotonic() + max(0.0, self.options.reconnect_timeout)
        while not self._closed:
            self._probe_down()
            if any(s.up for s in self._servers):
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

    def batches(self, epoch: int, start_batch: int, total: int) -> Iterator[dict[str, torch.Tensor]]:
        """Batches start_batch .. total - 1 of ``epoch``, in order, from the servers that are up."""
        if self._closed:
            raise RuntimeError("the loader is closed")
        split = self._start_split(epoch, start_batch, total, "")
        b = start_batch
        what = f"dataset {self.options.dataset!r}, epoch {epoch}"
        try:
            while b < total:
                if self._rejoined.is_set():
                    split = self._start_split(epoch, b, total, "a server came back")
                i = split.slot(b)
                server = split.servers[i]
                receiver = split.receivers[i]
                try:
                    item = receiver.get(self.options.timeout, f"{what}, batch {b}")
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
                    raise RuntimeError(f"the server at {server.address} sent batch {item.batch_index} where batch {b} was due")
                server.failing_since = None
                server.batches += 1
                b += 1
                yield deliver(item, receiver, self._transfer)
        finally:
            split.stop()  # (an abandoned iteration's split was already stopped by the next one)
            if self._split is split:
                self._split = None

    def close(self) -> None:
        """Cancel the streams, stop probing, close every server's channel. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._stop_probing.set()
        if self._split is not None:
            self._split.stop()
            self._split = None
        for s in self._servers:
            if s.conn is not None:
                s.conn.close()
        prober = getattr(self, "_prober", None)
        if prober is not None and prober is not threading.current_thread():
            prober.join(_PROBE_CONNECT_S + 1.0)


def _probe_loop(ref: "weakref.ref[MultiServerLoader]", stop: threading.Event) -> None:
    """Every probe_interval seconds, probe the down servers (holding the loader only meanwhile)."""
    while True:
        loader = ref()
        if loader is None:
            return
        interval = loader.options.probe_interval
        del loader
        if stop.wait(interval):
            return
        loader = ref()
        if loader is None or loader._closed:
            return
        try:
            loader._probe_down()
        except Exception:  # never die silently: log and keep probing
            log.exception("probing batchd servers failed")
        del loader
