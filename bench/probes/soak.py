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
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from bench import ROOT, module_argv, module_env
os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")

FMNIST_ROOT = pathlib.Path("/usr/share/datasets/fashion-mnist")
SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
TRANSPORTS = ("shm", "inline", "lz4")
TOLERANCE = {"fds": 10, "threads": 5, "segments": 8}  # absolute growth allowed
RSS_TOLERANCE = 0.30  # relative growth allowed


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


# --- measuring the server ---------------------------------------------------------------------


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return None if fields[0] in "ZX" else int(fields[1])


def process_tree(root: int) -> dict[int, int]:
    """{pid: ppid} of ``root`` and its live descendants."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                parents[int(entry)] = ppid
    tree, todo = {root: parents.get(root, 0)}, [root]
    while todo:
        p = todo.pop()
        for child, parent in parents.items():
            if parent == p and child not in tree:
                tree[child] = parent
                todo.append(child)
    return tree


def worker_pids(server_pid: int) -> list[int]:
    """The server's workers: children of its forkserver, i.e. its grandchildren."""
    tree = process_tree(server_pid)
    return sorted(p for p, parent in tree.items() if parent != server_pid and p != server_pid)


def _status(pid: int, key: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def sample(server_pid: int) -> dict[str, float]:
    tree = process_tree(server_pid)
    try:
        fds = len(os.listdir(f"/proc/{server_pid}/fd"))
    except OSError:
        fds = 0
    segments = list(SHM_DIR.glob(f"batchd-{server_pid}-*"))
    seg_bytes = 0
    for s in segments:
        try:
            seg_bytes += s.stat().st_size
        except OSError:
            pass
    return {
        "rss_mb": sum(_status(p, "VmRSS") for p in tree) / 1024,
        "processes": len(tree),
        "fds": fds,
        "threads": _status(server_pid, "Threads"),
        "segments": len(segments),
        "segment_mb": seg_bytes / (1 << 20),
    }


def measure(server_pid: int, n: int = 5, interval: float = 0.4) -> dict[str, float]:
    """The median of ``n`` samples (a batch in flight or a worker restarting is not a trend)."""
    samples = []
    for i in range(n):
        samples.append(sample(server_pid))
        if i < n - 1:
            time.sleep(interval)
    return {k: statistics.median(s[k] for s in samples) for k in samples[0]}


def verdicts(start: dict, end: dict) -> dict[str, tuple[str, bool]]:
    """metric -> (allowed growth, within it?)"""
    out = {k: (f"+{v}", end[k] - start[k] <= v) for k, v in TOLERANCE.items()}
    out["rss_mb"] = (f"+{RSS_TOLERANCE:.0%}", end["rss_mb"] <= start["rss_mb"] * (1 + RSS_TOLERANCE))
    return out


def table(start: dict, end: dict) -> str:
    checks = verdicts(start, end)
    rows = [("metric", "start", "end", "change", "allowed", "ok")]
    for k in ("rss_mb", "processes", "fds", "threads", "segments", "segment_mb"):
        allowed, ok = checks.get(k, ("-", None))
        fmt = "{:.1f}" if k.endswith("_mb") else "{:.0f}"
        rows.append((k, fmt.format(start[k]), fmt.format(end[k]), ("{:+.1f}" if k.endswith("_mb") else "{:+.0f}").format(
            end[k] - start[k]), allowed, "-" if ok is None else ("yes" if ok else "NO")))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


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


def run(minutes: float, n_clients: int, seed: int) -> int:
    from bench.fixtures.server_proc import ServerProcess

    import albumentations as A

    rng = random.Random(seed)
    duration = minutes * 60
    warmup = min(60.0, max(20.0, duration / 4))  # the slot pool grows to its working set first
    tmp = tempfile.TemporaryDirectory(prefix="batchd-soak-")
    logdir = pathlib.Path(tmp.name)
    datasets = {"fmnist-test": {"kind": "fashion-mnist", "root": str(FMNIST_ROOT), "split": "test"}}
    pipelines = {"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))}
    print(f"soak: {minutes:g} min, {n_clients} clients, seed {seed}, warm-up {warmup:.0f} s", flush=True)

    server = ServerProcess(datasets=datasets, pipelines=pipelines, workers=2, cache_dir=logdir / "cache").start()
    pid = server.pid
    print(f"server pid {pid} on {server.address}, workers {worker_pids(pid)}", flush=True)
    clients: list[Client] = []
    stats = collections.Counter()
    failures: list[str] = []
    start_m = end_m = None
    t0 = time.monotonic()
    next_client_kill = t0 + rng.uniform(4, 12)
    next_worker_kill = t0 + rng.uniform(3, 10)
    client_seeds = iter(range(seed * 1000, seed * 1000 + 100000))

    def new_client(slot: int) -> Client:
        return Client(slot, server.address, TRANSPORTS[(slot + stats["clients_started"]) % len(TRANSPORTS)],
                      next(client_seeds), logdir)

    try:
        for slot in range(n_clients):
            clients.append(new_client(slot))
            stats["clients_started"] += 1
        while time.monotonic() - t0 < duration:
            time.sleep(0.2)
            now = time.monotonic()
            if server.proc.poll() is not None:
                failures.append(f"the server exited with {server.proc.returncode}:\n" + "".join(list(server.lines)[-30:]))
                break
            for i, c in enumerate(clients):
                c.poll_epochs()
                if c.proc.poll() is not None:  # exited by itself: an error
                    failures.append(f"client {c.slot} ({c.transport}, seed {c.seed}) exited with "
                                    f"{c.proc.returncode}:\n{c.tail()}")
                    stats["epochs"] += c.epochs
                    c.close()
                    clients[i] = new_client(c.slot)
                    stats["clients_started"] += 1
            if now >= next_client_kill:
                i = rng.randrange(len(clients))
                sig = rng.choice([signal.SIGKILL, signal.SIGTERM])
                clients[i].kill(sig)
                stats["epochs"] += clients[i].epochs
                stats[f"clients_{signal.Signals(sig).name}"] += 1
                clients[i] = new_client(clients[i].slot)
                stats["clients_started"] += 1
                next_client_kill = now + rng.uniform(4, 12)
            if now >= next_worker_kill:
                workers = worker_pids(pid)
                if workers:
                    try:
                        os.kill(rng.choice(workers), signal.SIGKILL)
                        stats["workers_killed"] += 1
                    except ProcessLookupError:
                        pass
                next_worker_kill = now + rng.uniform(3, 10)
            if start_m is None and now - t0 >= warmup:
                start_m = measure(pid)
                print(f"baseline after {now - t0:.0f} s: {start_m}", flush=True)
        if start_m is None:  # a run shorter than its warm-up
            start_m = measure(pid)
        if server.proc.poll() is None:
            end_m = measure(pid)
    finally:
        for c in clients:
            c.kill(signal.SIGKILL)
            stats["epochs"] += c.epochs
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
        left = [p for p in tree if p != pid and _ppid(p) is not None]
        while left and time.monotonic() < deadline:
            time.sleep(0.1)
            left = [p for p in left if _ppid(p) is not None]
        if left:
            failures.append(f"processes of the server still running 10 s after it exited: {left}")
        segments = list(SHM_DIR.glob(f"batchd-{pid}-*"))
        if segments and server.proc.returncode == 0:
            failures.append(f"shared-memory segments left after a clean stop: {[s.name for s in segments]}")
        server.stop()
        tmp.cleanup()

    elapsed = time.monotonic() - t0
    print(f"\nran {elapsed:.0f} s: {stats['epochs']} complete epochs, {stats['clients_started']} clients started "
          f"({stats['clients_SIGKILL']} SIGKILLed, {stats['clients_SIGTERM']} SIGTERMed at random), "
          f"{stats['workers_killed']} workers SIGKILLed")
    ok = not failures
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
