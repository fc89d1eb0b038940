"""``loader.profile()``: where the time went this epoch, and what to do about it.

The totals of ``batchd.client.loader.timings.LoopTimings`` become per-stage seconds and shares, and a
verdict from five rules, applied in order (the thresholds are the constants below):

1. **trainer-bound**: the training loop waited for data less than ``TRAINER_BOUND_WAIT`` (5%)
   of its time (``wait_ratio``). Nothing to do: the model is the slow part.
2. **storage-bound**: the workers were busy at least ``WORKERS_BUSY`` (85%) of their time
   since the stream opened (``BatchTimings.workers_busy_ratio`` of its latest batch) and waiting for storage
   (``read``) took at least ``READ_SHARE`` (50%) of their time on these batches.
3. **cpu-bound**: the workers were that busy, and reads took less: decoding, the pipeline,
   the cache or writing kept them busy.
4. **copy-bound**: the host-to-device copy and ``gpu_transform`` (device time, one after the
   other on the copy's stream) took at least ``COPY_SHARE`` (50%) of the loop's time per batch.
5. **transport-bound**: none of the above: the workers had time to spare, so batches were
   ready but reached the loop late (waiting in the reorder buffer, on the network, in
   unpacking). The evidence names the largest of those stages.

Shares are within groups (``GROUPS``, of the stages ``batchd.client.loader.timings`` defines),
each adding up to 1: ``loop`` (the training loop's time), ``server`` (each batch's time on the server,
from its task being sent to a worker to its message being ready) and ``client`` (the client's threads').
"""

from __future__ import annotations

from batchd.client.loader.timings import CLIENT_STAGES, LOOP_STAGES, SERVER_STAGES, WORKER_STAGES, LoopTimings
from batchd.links import docs_link

TRAINER_BOUND_WAIT = 0.05  # wait_ratio below this: trainer-bound
WORKERS_BUSY = 0.85  # workers busy at least this fraction of their time: they are the limit
READ_SHARE = 0.5  # ... and reads at least this share of their time: storage-bound (else cpu-bound)
COPY_SHARE = 0.5  # copy + gpu_transform at least this share of the loop's time per batch: copy-bound
MIN_BATCHES = 2  # fewer batches taken this epoch: no verdict yet ("unknown")

VERDICTS = ("trainer-bound", "storage-bound", "cpu-bound", "transport-bound", "copy-bound")
_WHAT_TO_DO = {
    "trainer-bound": "Nothing to do: the training step is the slow part, and data arrives in time.",
    "storage-bound": "Enable the server's cache (cache: memory_bytes), raise reads_in_flight, or pack the "
                     "files into tar shards (batchd shards).",
    "cpu-bound": "Add workers (workers: N or {min, max}) or servers, or move the pipeline's last steps to the "
                 "GPU (gpu_transform, batchd.GpuTransform).",
    "transport-bound": "Use shared memory (same host: transport='shm'), lz4 compression on slow links, or "
                       "decode_on_client to send JPEG files instead of pixels.",
    "copy-bound": "Copy less: send uint8 and normalise on the GPU (gpu_transform), crop smaller, or use "
                  "pinned shared-memory batches (same host).",
}
# each verdict's advice ends with the address of its section of docs/tuning.md on the docs site
ADVICE = {
    **{verdict: f"{what} See {docs_link('tuning', verdict)}." for verdict, what in _WHAT_TO_DO.items()},
    "unknown": f"Iterate the loader first: a verdict needs {MIN_BATCHES} batches of this epoch.",
}
GROUPS = {"loop": LOOP_STAGES, "server": SERVER_STAGES, "client": CLIENT_STAGES}


class Profile(dict):
    """``loader.profile()``'s result: a dict, printed as a table (``print(profile)``, ``.table()``).

    Keys: ``verdict`` (one of ``VERDICTS``, "unknown" before ``MIN_BATCHES`` batches), ``advice``
    (one sentence), ``evidence`` (the figures behind the verdict, in words), ``wait_ratio`` (the
    loop's wait / its time, 0..1, the first batch left out), ``workers_busy_ratio`` (0..1),
    ``stages`` ({stage: seconds, totals this epoch}), ``shares`` ({stage: ratio within its group,
    see ``GROUPS``}), ``batches``, ``epoch``, ``startup_seconds`` (the first batch's wait).
    """

    def table(self) -> str:
        """The profile as text: verdict, advice, evidence, then seconds, ms per batch and share per stage."""
        n = max(1, self["batches"])
        lines = [
            f"batchd profile: epoch {self['epoch']}, {self['batches']} batches, "
            f"{self['stages']['wait'] + self['stages']['step']:.2f} s of training loop "
            f"(+ {self['startup_seconds']:.2f} s for the first batch)",
            f"verdict:  {self['verdict']}: {self['evidence']}",
            f"advice:   {self['advice']}",
            f"wait:     {self['wait_ratio']:.1%} of the loop's time; workers {self['workers_busy_ratio']:.0%} busy",
            "",
            f"{'group':<7} {'stage':<14} {'seconds':>9} {'ms/batch':>9} {'share':>6}",
        ]
        for group, stages in GROUPS.items():
            for i, stage in enumerate(stages):
                seconds = self["stages"][stage]
                lines.append(f"{group if i == 0 else '':<7} {stage:<14} {seconds:>9.3f} {1000 * seconds / n:>9.2f} "
                             f"{self['shares'][stage]:>6.0%}")
        return "\n".join(lines)

    __str__ = table


def make_profile(t: LoopTimings) -> Profile:
    """The profile of the totals ``t`` (a ``LoopTimings.snapshot()``)."""
    stages = dict(t.totals)
    shares = {}
    for members in GROUPS.values():
        total = sum(stages[s] for s in members)
        shares.update({s: stages[s] / total if total > 0 else 0.0 for s in members})
    verdict, evidence = judge(t)
    return Profile(verdict=verdict, advice=ADVICE[verdict], evidence=evidence, wait_ratio=t.wait_ratio,
                   workers_busy_ratio=t.workers_busy_ratio, stages=stages, shares=shares, batches=t.batches,
                   epoch=t.epoch if t.epoch is not None else 0, startup_seconds=t.startup)


def judge(t: LoopTimings) -> tuple[str, str]:
    """(verdict, evidence in words) by the rules of the module docstring."""
    s = t.totals
    if t.batches < MIN_BATCHES:
        return "unknown", f"{t.batches} batches taken this epoch"
    n = t.batches
    loop = s["wait"] + s["step"]
    wait = t.wait_ratio
    ms = lambda seconds: f"{1000 * seconds / n:.1f} ms"  # noqa: E731  (per batch)
    if wait < TRAINER_BOUND_WAIT:
        return "trainer-bound", f"the loop waited {wait:.1%} of its time (< {TRAINER_BOUND_WAIT:.0%}); its step took {ms(s['step'])} per batch"
    work = sum(s[k] for k in WORKER_STAGES)
    busy = t.workers_busy_ratio
    if busy >= WORKERS_BUSY:
        read = s["read"] / work if work > 0 else 0.0
        if read >= READ_SHARE:
            return "storage-bound", (f"workers {busy:.0%} busy, {read:.0%} of their time waiting for storage "
                                     f"(read {ms(s['read'])} per batch); the loop waited {wait:.0%}")
        top = max(("decode", "pipeline", "cache", "write"), key=lambda k: s[k])
        return "cpu-bound", (f"workers {busy:.0%} busy, {s[top] / work if work else 0:.0%} of their time in {top} "
                             f"({ms(s[top])} per batch), reads {read:.0%}; the loop waited {wait:.0%}")
    device = s["copy"] + s["gpu_transform"]
    if loop > 0 and device / loop >= COPY_SHARE:
        return "copy-bound", (f"the host-to-device copy and gpu_transform took {ms(device)} per batch, "
                              f"{device / loop:.0%} of the loop's {ms(loop)}; the loop waited {wait:.0%}")
    top = max(("reorder", "send", "receive", "unpack"), key=lambda k: s[k])
    return "transport-bound", (f"workers only {busy:.0%} busy, yet the loop waited {wait:.0%}: batches were ready "
                               f"but late; {top} took {ms(s[top])} per batch (reorder {ms(s['reorder'])}, "
                               f"receive {ms(s['receive'])}, unpack {ms(s['unpack'])})")
