"""Table 17's servers and loaders (bench/tables/table_fullspeed.py): ``batchd serve`` processes
whose operator pipeline "pace" sleeps a fixed time per sample (tests/pydata/batchd_testdata.py),
so that each server's speed is set by its config and several run on 2 cores, and the
``RemoteDataLoader`` every row reads them with (shuffled, a new seed per loader).
"""

from __future__ import annotations

import itertools

import batchd
from bench import ROOT
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess

PYDATA = ROOT / "tests" / "pydata"
N = 200_000  # samples of the Paced dataset for the throughput and stall rows (never read to the end)
BATCH = 8  # unequal servers of one worker


def server(seconds: float, workers: int = 1, *, n: int = N, private_shm: bool = False) -> ServerProcess:
    """A server of ``workers`` whose pipeline "pace" takes ``seconds`` per sample."""
    return ServerProcess(
        datasets={"paced": {"kind": "python", "factory": "batchd_testdata:Paced", "args": {"n": n}}},
        pipelines={"pace": {"python": "batchd_testdata:paced", "args": {"seconds": seconds}}},
        workers=workers, cache_dir=data.CACHE, extra={"python_path": [str(PYDATA)]}, private_shm=private_shm)


def _batches(loader, first_epoch: int = 0):
    for epoch in itertools.count(first_epoch):
        loader.set_epoch(epoch)
        yield from loader


_seeds = itertools.count(1)


def _loader(addresses, **kw) -> batchd.RemoteDataLoader:
    kw = {"batch_size": BATCH, "shuffle": True, "seed": next(_seeds), "transform": "pace", "timeout": 300,
          "probe_interval": 60, **kw}
    return batchd.RemoteDataLoader(addresses, "paced", **kw)
