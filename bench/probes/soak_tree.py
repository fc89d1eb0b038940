"""The soak test's view of a server: its process tree, and what must stay flat under churn.

RSS summed over the server, its forkserver, workers and resource tracker; the server's open file
descriptors and threads; its shared-memory segments (``/dev/shm/batchd-PID-*``: count and bytes).
``measure`` takes the median of a few samples, ``verdicts`` holds the end against the start
within ``TOLERANCE`` and ``RSS_TOLERANCE``, ``table`` prints both (bench/probes/soak.py).
"""

from __future__ import annotations

import os
import pathlib
import statistics
import tempfile
import time

SHM_DIR = pathlib.Path("/dev/shm") if os.path.isdir("/dev/shm") else pathlib.Path(tempfile.gettempdir())
TOLERANCE = {"fds": 10, "threads": 5, "segments": 8}  # absolute growth allowed
RSS_TOLERANCE = 0.30  # relative growth allowed


def ppid(pid: int) -> int | None:
    """The parent of ``pid``; None once it has exited (or is a zombie)."""
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
            parent = ppid(int(entry))
            if parent is not None:
                parents[int(entry)] = parent
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
    """One reading of the server's process tree (sizes in MB)."""
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
    """The start and end readings side by side, with the growth allowed and whether it held."""
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
