"""bench.placement.loop_alone (Table 18's part 3): the calling thread alone on the first CPU, the
rest of the process tree (its other threads, a child process) on the others, and every CPU back
after the block."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from bench import placement

pytestmark = [pytest.mark.timeout(60),
              pytest.mark.skipif(not placement.possible(), reason="needs two CPUs and sched_setaffinity")]


def test_loop_alone_splits_the_tree_and_gives_it_back():
    cpus = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, daemon=True)
    helper.start()
    try:
        assert child.pid in placement.tree(os.getpid())
        with placement.loop_alone():
            assert os.sched_getaffinity(threading.get_native_id()) == {cpus[0]}
            assert os.sched_getaffinity(helper.native_id) == set(cpus[1:])
            assert os.sched_getaffinity(child.pid) == set(cpus[1:])
            seen: list[set[int]] = []  # a thread the loop's thread starts inherits its CPU
            started = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            started.start()
            started.join()
            assert seen == [{cpus[0]}]
        for tid in (threading.get_native_id(), helper.native_id, child.pid):
            assert os.sched_getaffinity(tid) == set(cpus)
    finally:
        stop.set()
        child.kill()
        child.wait()
