"""Decode time of a JPEG at each libjpeg-turbo scaling factor m/8, against a full decode.

    python -m bench.probes.scaled_decode [--images N] [--rounds R]

About a minute on a 2-core machine; prints a table (nothing written). The figures behind
``server/data/scaled_jpeg.py``'s ``COST``: which M/8 factors are worth decoding at. The work:
the first ``images`` large photos (bench/fixtures: 1,000-1,600 px wide, quality 90), one thread,
each factor in turn within a round, the order rotated every round (the machine is shared: other
processes slow every factor alike); medians of the rounds. Also OpenCV's full decode + BGR->RGB,
what ``decode.decode_rgb`` does with ``reduced_decode: false``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import cv2
import numpy as np

from batchd.server.data import scaled_jpeg

from bench.fixtures import data
from bench.report import md_table


def run(images: int, rounds: int) -> dict[str, list[float]]:
    """``{case: [ms per image, one per round]}`` for ``"m/8"`` (m = 1..8) and ``"opencv"``."""
    folder = data.ensure_large_photos()
    bufs = [np.fromfile(folder / f, np.uint8) for f in data.photo_files(folder)[:images]]
    cases = {f"{m}/8": (lambda m: lambda b: scaled_jpeg.decode_eighths(b, m))(m) for m in scaled_jpeg.factors()}
    cases["opencv"] = lambda b: cv2.cvtColor(cv2.imdecode(b, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            for b in bufs:
                cases[name](b)
            out[name].append((time.perf_counter() - t0) * 1e3 / len(bufs))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--images", type=int, default=48)
    p.add_argument("--rounds", type=int, default=7)
    args = p.parse_args(argv)
    cv2.setNumThreads(1)
    out = run(args.images, args.rounds)
    full = statistics.median(out["8/8"]) if "8/8" in out else statistics.median(out["opencv"])
    rows = [[name, f"{statistics.median(v):.2f}", f"{statistics.median(v) / full:.2f}"] for name, v in out.items()]
    print(f"backend: {scaled_jpeg.backend()}; {args.images} large photos, {args.rounds} alternated rounds, medians\n")
    print(md_table(["factor", "ms per image", "of a full decode"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
