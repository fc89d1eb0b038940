"""StageClock: seconds per stage of a batch, with one sample in `every` timed, against sleeps of known
length; the stage board a server reads."""

from __future__ import annotations

import os
import time

import pytest

from batchd.server.compute.stages import (DECODE, PIPELINE, READ, STAGES, WRITE, StageBoard, StageClock,
                                          work_seconds)


def run_batch(clock: StageClock, samples: int, read_s: float, pipeline_s: float) -> dict[str, float]:
    """A worker's calls for one batch of ``samples``: each reads for ``read_s``, runs its pipeline
    for ``pipeline_s`` (sleeps), as the worker guards them (only timed samples call the clock)."""
    clock.start(PIPELINE)
    for _ in clock.samples(samples, WRITE):  # the worker's own loop
        on = clock.on
        if on:
            clock.enter(READ)
        if read_s:
            time.sleep(read_s)
        if on:
            clock.enter(DECODE)
        if on:
            clock.enter(PIPELINE)
        if pipeline_s:
            time.sleep(pipeline_s)
        if on:
            clock.enter(WRITE)
    return clock.stop()


@pytest.mark.parametrize("every", [1, 4])
def test_sampled_stages_add_up_to_the_batch(every):
    clock = StageClock()
    clock.every = every
    t0 = time.perf_counter()
    totals = run_batch(clock, 16, read_s=0.002, pipeline_s=0.006)
    elapsed = time.perf_counter() - t0
    assert set(totals) == set(STAGES)
    # the loop's whole time is shared out: the stages add up to the batch's time
    assert work_seconds(totals) == pytest.approx(elapsed, rel=0.02)
    # and in the measured proportions (a sleep lasts at least what it asks for, a little more on a busy host)
    assert totals["read"] >= 16 * 0.002 * 0.9 and totals["pipeline"] >= 16 * 0.006 * 0.9
    assert totals["pipeline"] / totals["read"] == pytest.approx(3.0, rel=0.35)
    assert totals["cache"] == 0


def test_every_adapts_to_the_work_per_sample():
    clock = StageClock()
    # no work at all: few samples of the next batch are timed (one a batch, but for the moments another
    # process takes this core, which count as the loop's time)
    run_batch(clock, 64, read_s=0.0, pipeline_s=0.0)
    assert clock.every >= 8
    run_batch(clock, 64, read_s=0.0, pipeline_s=0.0)
    assert clock.every >= 8
    run_batch(clock, 8, read_s=0.001, pipeline_s=0.003)  # 4 ms a sample: every one is worth timing
    assert clock.every == 1


def test_the_board_shows_each_workers_stage():
    board = StageBoard.create(f"batchd-test-{os.getpid()}-", 3)
    reader = StageBoard.attach(f"batchd-test-{os.getpid()}-")
    try:
        assert [board.get(i) for i in range(3)] == ["idle"] * 3
        clock = StageClock(reader, 2)
        clock.start(READ)
        assert board.get(2) == "read" and board.get(0) == "idle"
        clock.enter(PIPELINE)
        assert board.get(2) == "pipeline"
        clock.stop()
        assert board.get(2) == "idle"
        assert StageBoard.attach("batchd-test-no-such-") is None
    finally:
        reader.close()
        board.close()
