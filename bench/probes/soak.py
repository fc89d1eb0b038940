"""Soak test: a batchd server under churn for a while; its resources must stay flat.

    python -m bench.probes.soak                      # 10 minutes, 3 clients
    python -m bench.probes.soak --minutes 1 --clients 3 --seed 1

Starts ``batchd serve`` (Fashion-MNIST, ``--workers 2``) as a subprocess, then, until the time is
up:

* ``--clients`` client processes read epochs of ``fmnist-test`` without pause, each with its own
  transport (shared memory, inline, inline + LZ4, in turn), random batch sizes, prefetch and
  augmentation, and now and then abandon an epoch half-way; every complete epoch is checked to
  hold every sample exactly once;
* at random intervals a random client is killed (SIGKILL or SIGTERM) and a new one started;
* at random intervals a random worker process of the server is SIGKILLed (the server replaces it
  and rebuilds its batches).

After a warm-up, and again at the end (clients still running, so both in the same state), it
samples the server's process tree: RSS (sum over the server, its forkserver, workers and
resource tracker), the server's open file descriptors (``/proc/PID/fd``) and threads, and the
server's shared-memory segments (``/dev/shm/batchd-PID-*``: count and bytes). Each is the median
of a few samples. Finally it stops everything and checks the server exits 0, leaves no process
and no segment behind.

Exit status: 0 if nothing grew beyond its tolerance (fds +10, threads +5, segments +8, RSS +30%),
no client saw an error, the server stayed up and stopped cleanly; 1 otherwise; 2 if
Fashion-MNIST is not installed. Every wait is bounded: the run stops by itself within
``--minutes`` plus about a minute (a watchdog ends it at ``--minutes`` + 3 minutes whatever
happens).
"""

from __future__ import annotations

import argparse
import collections
import os
import pathlib
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

from bench import module_argv, module_env
from bench.probes.soak_tree import SHM_DIR, measure, ppid, process_tree, table, verdicts, worker_pids
FMNIST_ROOT = pathlib.Path("/usr/share/datasets/fashion-mnist")
TRANSPORTS = ("shm", "inline", "lz4")


# --- client process ---------------------------------------------------------------------------


def client_main(address: str, transport: str, seed: int) -> int:
    """Read epochs forever; print one line per complete epoch; exit 1 on any error."""
    import albumentations as A
    import numpy as np

    import batchd

    rng = random.Random(seed)
    augment = A.Compose([A.HorizontalFlip(p=0.5), A.Affine(rotate=(-15, 15), p=0.5)])

    def on_term(*_):  # SIGTERM: leave the way a trainer that is told to stop does (loader.close runs)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    while True:
        ld = batchd.RemoteDataLoader(
            address, "fmnist-test", batch_size=rng.choice([32, 64, 128, 256]), shuffle=True,
            seed=rng.randrange(1 << 16), transform=rng.choice([None, augment, "flip"]),
            prefetch=rng.choice([1, 2, 4]), transport="inline" if transport == "lz4" else transport,
            compression="lz4" if transport == "lz4" else None, reconnect_timeout=30, timeout=120,
        )
        try:
            for _ in range(rng.randint(1, 4)):
                abandon_at = rng.randrange(len(ld)) if rng.random() < 0.25 else None
                indices = []
                for i, batch in enumerate(ld):
                    indices.append(batch["index"].numpy().copy())
                    if i == abandon_at:
                        break
                else:
                    got = np.concatenate(indices)
                    counts = np.bincount(got, minlength=ld.info.num_samples)
                    if len(got) != ld.info.num_samples or not (counts == 1).all():
                        print(f"epoch {ld.epoch - 1}: {len(got)} indices, not every sample exactly once",
                              file=sys.stderr, flush=True)
                        return 1
                    print(f"epoch {len(indices)} batches", flush=True)
        finally:
            ld.close()


# --- the run ----------------------------------------------------------------------------------


class Client:
    def __init__(self, slot: int, address: str, transport: str, seed: int, logdir: pathlib.Path):
        self.slot, self.transport, self.seed = slot, transport, seed
        self.log_path = logdir / f"client-{slot}-{seed}.log"
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            module_argv("bench.probes.soak", "--client", address, "--transport", transport, "--seed", str(seed)),
            stdout=subprocess.PIPE, stderr=self._log, stdin=subprocess.DEVNULL, text=True, env=module_env(),
        )
        self.epochs = 0
        self.killed = False
        self._reader = threading.Thread(target=self._read, name=f"soak-client-{slot}", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for line in self.proc.stdout:
                if line.startswith("epoch"):
                    self.epochs += 1
        except (OSError, ValueError):
            pass

    def poll_epochs(self) -> None:
        """Wait (briefly) for the reader once the process has exited, so its last lines count."""
        if self.proc.poll() is not None:
            self._reader.join(2)

    def kill(self, sig: int) -> None:
        self.killed = True
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.close()

    def close(self) -> None:
        self.poll_epochs()
        self._log.close()

    def tail(self, n: int = 15) -> str:
        try:
            return "\n".join(self.log_path.read_text().splitlines()[-n:])
        except OSError:
            return ""


class Churn:
    """The clients and the kills of a soak run: ``n_clients`` client processes kept running, a
    random client killed every 4-12 s and a random worker every 3-10 s; ``stats`` counts them."""

    def __init__(self, server, n_clients: int, rng: random.Random, seed: int, logdir: pathlib.Path):
        self.server, self.rng, self.logdir = server, rng, logdir
        self.stats: collections.Counter = collections.Counter()
        self.failures: list[str] = []
        self._seeds = iter(range(seed * 1000, seed * 1000 + 100000))
        now = time.monotonic()
        self.next_client_kill = now + rng.uniform(4, 12)
        self.next_worker_kill = now + rng.uniform(3, 10)
        self.clients = [self._new_client(slot) for slot in range(n_clients)]

    def _new_client(self, slot: int) -> Client:
        transport = TRANSPORTS[(slot + self.stats["clients_started"]) % len(TRANSPORTS)]
        self.stats["clients_started"] += 1
        return Client(slot, self.server.address, transport, next(self._seeds), self.logdir)

    def _replace(self, i: int) -> None:
        self.stats["epochs"] += self.clients[i].epochs
        self.clients[i] = self._new_client(self.clients[i].slot)

    def step(self, now: float) -> None:
        """Replace clients that exited by themselves (each an error); kill a client or a worker when due."""
        for i, c in enumerate(self.clients):
            c.poll_epochs()
            if c.proc.poll() is not None:
                self.failures.append(f"client {c.slot} ({c.transport}, seed {c.seed}) exited with "
                                     f"{c.proc.returncode}:\n{c.tail()}")
                c.close()
                self._replace(i)
        if now >= self.next_client_kill:
            i = self.rng.randrange(len(self.clients))
            sig = self.rng.choice([signal.SIGKILL, signal.SIGTERM])
            self.clients[i].kill(sig)
            self.stats[f"clients_{signal.Signals(sig).name}"] += 1
            self._replace(i)
            self.next_client_kill = now + self.rng.uniform(4, 12)
        if now >= self.next_worker_kill:
            workers = worker_pids(self.server.pid)
            if workers:
                try:
                    os.kill(self.rng.choice(workers), signal.SIGKILL)
                    self.stats["workers_killed"] += 1
                except ProcessLookupError:
                    pass
            self.next_worker_kill = now + self.rng.uniform(3, 10)

    def stop(self) -> None:
        for c in self.clients:
            c.kill(signal.SIGKILL)
            self.stats["epochs"] += c.epochs


def stop_server(server) -> list[str]:
    """SIGTERM the server; what went wrong: not 2 workers at the end, no clean exit within 30 s,
    processes of its tree still running 10 s later, segments left after a clean stop."""
    failures = []
    pid = server.pid
    tree = process_tree(pid) if server.proc.poll() is None else {}
    if server.proc.poll() is None:
        workers_now = worker_pids(pid)
        if len(workers_now) != 2:
            failures.append(f"the server has {len(workers_now)} workers at the end, not 2")
        server.proc.send_signal(signal.SIGTERM)
        try:
            code = server.proc.wait(30)
            if code != 0:
                failures.append(f"the server exited with {code} on SIGTERM")
        except subprocess.TimeoutExpired:
            failures.append("the server did not exit within 30 s of SIGTERM")
            server.proc.kill()
            server.proc.wait(10)
    deadline = time.monotonic() + 10
    left = [p for p in tree if p != pid and ppid(p) is not None]
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = [p for p in left if ppid(p) is not None]
    if left:
        failures.append(f"processes of the server still running 10 s after it exited: {left}")
    segments = list(SHM_DIR.glob(f"batchd-{pid}-*"))
    if segments and server.proc.returncode == 0:
        failures.append(f"shared-memory segments left after a clean stop: {[s.name for s in segments]}")
    return failures


def churn(server, n_clients: int, seed: int, duration: float, warmup: float, logdir: pathlib.Path):
    """Run the clients and the kills for ``duration`` seconds; (churn, readings after the warm-up
    and at the end; the end is None if the server died)."""
    rng = random.Random(seed)
    ch = Churn(server, n_clients, rng, seed, logdir)
    start_m = end_m = None
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < duration:
            time.sleep(0.2)
            now = time.monotonic()
            if server.proc.poll() is not None:
                ch.failures.append(f"the server exited with {server.proc.returncode}:\n"
                                   + "".join(list(server.lines)[-30:]))
                break
            ch.step(now)
            if start_m is None and now - t0 >= warmup:
                start_m = measure(server.pid)
                print(f"baseline after {now - t0:.0f} s: {start_m}", flush=True)
        if start_m is None:  # a run shorter than its warm-up
            start_m = measure(server.pid)
        if server.proc.poll() is None:
            end_m = measure(server.pid)
    finally:
        ch.stop()
    return ch, start_m, end_m


def run(minutes: float, n_clients: int, seed: int) -> int:
    from bench.fixtures.server_proc import ServerProcess

    import albumentations as A

    duration = minutes * 60
    warmup = min(60.0, max(20.0, duration / 4))  # the slot pool grows to its working set first
    tmp = tempfile.TemporaryDirectory(prefix="batchd-soak-")
    logdir = pathlib.Path(tmp.name)
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(FMNIST_ROOT), "split": "test"}}
    pipelines = {"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))}
    print(f"soak: {minutes:g} min, {n_clients} clients, seed {seed}, warm-up {warmup:.0f} s", flush=True)

    server = ServerProcess(datasets=datasets, pipelines=pipelines, workers=2, cache_dir=logdir / "cache").start()
    print(f"server pid {server.pid} on {server.address}, workers {worker_pids(server.pid)}", flush=True)
    t0 = time.monotonic()
    try:
        ch, start_m, end_m = churn(server, n_clients, seed, duration, warmup, logdir)
    finally:
        failures = stop_server(server)
        server.stop()
        tmp.cleanup()
    return report(ch, failures, start_m, end_m, time.monotonic() - t0)


def report(ch: Churn, failures: list[str], start_m: dict, end_m: dict | None, elapsed: float) -> int:
    """Print what ran and every failure; the exit status (0: PASS)."""
    stats, failures = ch.stats, ch.failures + failures
    print(f"\nran {elapsed:.0f} s: {stats['epochs']} complete epochs, {stats['clients_started']} clients started "
          f"({stats['clients_SIGKILL']} SIGKILLed, {stats['clients_SIGTERM']} SIGTERMed at random), "
          f"{stats['workers_killed']} workers SIGKILLed")
    if end_m is not None:
        print("\nserver process tree (median of 5 samples, clients running):")
        print(table(start_m, end_m))
        grew = [k for k, (_, fine) in verdicts(start_m, end_m).items() if not fine]
        if grew:
            failures.append(f"grew beyond tolerance: {', '.join(grew)}")
    if stats["epochs"] == 0:
        failures.append("no client completed an epoch")
    for f in failures:
        print(f"\nFAIL: {f}")
    ok = not failures
    print("\nsoak: " + ("PASS" if ok else "FAIL"))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="how long to run (default 10)")
    parser.add_argument("--clients", type=int, default=3, help="client processes at a time (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random kills and client settings")
    parser.add_argument("--client", metavar="ADDRESS", help=argparse.SUPPRESS)  # internal: run one client
    parser.add_argument("--transport", default="shm", choices=TRANSPORTS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.client:
        return client_main(args.client, args.transport, args.seed)
    if not (FMNIST_ROOT / "t10k-images-idx3-ubyte.gz").exists():
        print(f"soak: Fashion-MNIST is not installed in {FMNIST_ROOT}", file=sys.stderr)
        return 2
    if args.minutes <= 0 or args.clients < 1:
        parser.error("--minutes must be positive and --clients at least 1")

    def watchdog(*_):
        raise SystemExit("soak: watchdog: the run took far longer than --minutes; stopping")

    signal.signal(signal.SIGALRM, watchdog)
    signal.alarm(int(args.minutes * 60 + 180))
    try:
        return run(args.minutes, args.clients, args.seed)
    finally:
        signal.alarm(0)


if __name__ == "__main__":
    sys.exit(main())
