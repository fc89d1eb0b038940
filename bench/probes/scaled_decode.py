"""Decode time of a JPEG at each libjpeg-turbo scaling factor m/8, against a full decode.

    python -m bench.probes.scaled_decode [--images N] [--rounds R]

About a minute on a 2-core machine; prints a table (nothing written). The figures behind
``server/data/scaled_jpeg.py``'s ``COST``: which M/8 factors are worth decoding at; and what
decoding only a RandomResizedCrop(224) window's MCUs saves over decoding the whole image at the
same m/8 (``scaled_jpeg.decode_region``). The work:
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


def windows(bufs: list[np.ndarray], seed: int = 0) -> list[tuple[int, tuple[int, int, int, int], tuple[int, int]]]:
    """Per image: (m, window, (height, width)) of a RandomResizedCrop(224) draw (albumentations'
    defaults: 8-100% of the area, aspect 3:4-4:3) and the cheapest m/8 that keeps 224 px."""
    import albumentations as A
    import random

    from batchd.server.compute import region
    from batchd.server.data.decode import upright_size

    crop = A.Compose([A.RandomResizedCrop(size=(224, 224))])
    crop.set_random_state(np.random.default_rng(seed), random.Random(seed))
    step = region.FirstStep(crop)
    out = []
    for b in bufs:
        shape = upright_size(b)
        drawn = step.draw(*shape)
        out.append((drawn.eighths, drawn.window, shape))
    return out


def run(images: int, rounds: int) -> dict[str, list[float]]:
    """``{case: [ms per image, one per round]}``: ``"m/8"`` (m = 1..8, whole images), ``"opencv"``,
    and for RandomResizedCrop(224) windows at their m/8: ``"crop: whole at m/8"`` and ``"crop:
    region at m/8"`` (only the window's MCUs, when the region decoder is built)."""
    folder = data.ensure_large_photos()
    bufs = [np.fromfile(folder / f, np.uint8) for f in data.photo_files(folder)[:images]]
    cases = {f"{m}/8": (lambda m: lambda b, w: scaled_jpeg.decode_eighths(b, m))(m) for m in scaled_jpeg.factors()}
    cases["opencv"] = lambda b, w: cv2.cvtColor(cv2.imdecode(b, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    cases["crop: whole at m/8"] = lambda b, w: scaled_jpeg.decode_eighths(b, w[0])
    if scaled_jpeg.region_available():
        cases["crop: region at m/8"] = lambda b, w: scaled_jpeg.decode_region(
            b, w[0], scaled_jpeg.scaled_window(w[1], w[0], *w[2]))
    crops = windows(bufs)
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for name in names[k:] + names[:k]:
            t0 = time.perf_counter()
            for b, w in zip(bufs, crops):
                cases[name](b, w)
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
