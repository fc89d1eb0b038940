"""Timing helpers: medians, steady-state stream rates, per-process CPU time from /proc."""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Iterable

_CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = 4096


def median(xs: Iterable[float]) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def spread(xs: Iterable[float]) -> float:
    """(max - min) / median: how much the repeats disagree."""
    xs = list(xs)
    if len(xs) < 2:
        return 0.0
    m = statistics.median(xs)
    return (max(xs) - min(xs)) / m if m else float("nan")


def pin_threads() -> None:
    """One OpenCV thread and one torch thread in this process, as in batchd's workers."""
    import cv2
    import torch

    cv2.setNumThreads(1)
    torch.set_num_threads(1)


def consume(batch) -> None:
    """What a trainer does at least: read the batch (one byte per page of every tensor).

    Shared-memory tensors are mapped lazily, so without this their page faults would not be
    counted at all; a GPU copy would read every byte. ``batch``: a dict, list or tuple of tensors,
    nested (a ragged field's list, detection's (images, targets)); other values are skipped.
    """
    tensors = batch.values() if isinstance(batch, dict) else batch
    for t in tensors:
        if isinstance(t, (dict, list, tuple)):
            consume(t)
        elif hasattr(t, "element_size") and t.numel():
            flat = t.reshape(-1)
            step = max(1, PAGE // t.element_size())
            flat[::step].sum()


def batch_images(batch) -> int:
    """Images in a batch: a dict's ``image`` or a tuple's first entry, a tensor [B, ...] or B tensors."""
    image = batch["image"] if isinstance(batch, dict) else batch[0]
    return len(image) if isinstance(image, (list, tuple)) else int(image.shape[0])


@dataclass
class StreamTiming:
    seconds: float
    images: int
    batches: int
    cpu: float = float("nan")  # CPU seconds of this process and every process under it, same window

    @property
    def rate(self) -> float:
        return self.images / self.seconds

    @property
    def cpu_per_image(self) -> float:
        return self.cpu / self.images


def scan_processes() -> dict[int, tuple[int, float]]:
    """pid -> (ppid, CPU seconds so far: utime + stime from /proc/PID/stat) of every process."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(entry)] = (int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLK_TCK)
    return out


def tree_cpu_seconds(root: int | None = None) -> float:
    """CPU seconds so far of process ``root`` (default: this one) and all its descendants
    (workers, servers, their workers), from /proc/PID/stat."""
    root = os.getpid() if root is None else root
    procs = scan_processes()
    parent = {pid: ppid for pid, (ppid, _) in procs.items()}
    cpu = {pid: c for pid, (_, c) in procs.items()}
    total = 0.0
    for pid, c in cpu.items():
        p = pid
        for _ in range(64):
            if p == root:
                total += c
                break
            if p <= 1:
                break
            p = parent.get(p, 0)
    return total


def time_stream(batches: Iterable, warmup: int, timed: int, *,
                on_start: Callable[[], None] | None = None,
                on_end: Callable[[], None] | None = None) -> StreamTiming:
    """Consume ``warmup`` batches untimed, then time ``timed`` more (each ``consume``-d).

    The clock starts when the last warm-up batch has been consumed, so with ``warmup`` and
    ``timed`` multiples of the worker count the window covers whole rounds of the workers.
    """
    it = iter(batches)
    for _ in range(warmup):
        b = next(it)
        consume(b)
        del b
    if on_start:
        on_start()
    c0 = tree_cpu_seconds()
    t0 = time.perf_counter()
    images = 0
    for _ in range(timed):
        b = next(it)
        consume(b)
        images += batch_images(b)
        del b
    t1 = time.perf_counter()
    c1 = tree_cpu_seconds()
    if on_end:
        on_end()
    return StreamTiming(t1 - t0, images, timed, c1 - c0)


def cpu_seconds(pid: int, skip: set[int] | frozenset[int] = frozenset()) -> float:
    """CPU seconds of process ``pid`` so far: the sum over its live threads (but those whose native
    id is in ``skip``) of /proc/PID/task/TID/schedstat (nanoseconds; /proc/PID/stat counts 10 ms
    ticks only)."""
    total = 0
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        tids = []
    for tid in tids:
        if int(tid) in skip:
            continue
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass  # the thread ended
    if total == 0:  # no schedstat (kernel without CONFIG_SCHEDSTATS): clock ticks
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _CLK_TCK
    return total / 1e9


def self_cpu_seconds() -> float:
    return time.process_time()


def harness_tids() -> set[int]:
    """Native ids of this process's benchmark-harness threads (named ``bench-*``: the noise
    meter, ``bench.noise.NoiseMeter``): no trainer runs them, so a trainer's CPU leaves them out."""
    import threading

    return {t.native_id for t in threading.enumerate() if t.name.startswith("bench-") and t.native_id is not None}


def trainer_cpu_seconds() -> float:
    """CPU seconds of this process so far, every thread but the harness's (``harness_tids``): what
    a training process running the same loop would spend. Per thread, as ``cpu_seconds``."""
    return cpu_seconds(os.getpid(), skip=harness_tids())


def proc_status(pid: int) -> dict[str, int]:
    """Memory fields of /proc/PID/status in bytes (VmRSS, VmHWM, RssAnon, RssFile, RssShmem)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def smaps_rollup(pid: int) -> dict[str, int]:
    """/proc/PID/smaps_rollup in bytes (Rss, Pss, Pss_Anon, Pss_File, Pss_Shmem, ...)."""
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 3 and parts[0].endswith(":") and parts[2] == "kB":
                out[parts[0][:-1]] = int(parts[1]) * 1024
    return out


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def maps_file(pid: int, needle: str) -> bool:
    """Whether process ``pid`` has a file whose path contains ``needle`` mapped."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            return any(needle in line for line in f)
    except OSError:
        return False
