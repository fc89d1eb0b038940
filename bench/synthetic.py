"""A ``kind: python`` dataset of ready-made frames, for benchmarks of the path from server to trainer.

``Frames``: sample i is ``{"image": uint8 [size, size, 3], "label": i % 10}``, its image one of
``distinct`` fixed random frames (seed 0). Nothing is decoded or augmented: a worker only copies
the frames into the batch's slot (64 x 224 x 224 x 3 = 9.6 MB in about 2-4 ms), so a server of two
workers offers well over 1 GB/s and a benchmark measures the transport, not the pipeline.
Served as ``{kind: python, factory: "bench.synthetic:Frames"}`` with the repository root on the
server's ``python_path``.
"""

from __future__ import annotations

import numpy as np


class Frames:
    def __init__(self, n: int = 200_000, size: int = 224, distinct: int = 16):
        self.n, self.size = n, size
        rng = np.random.default_rng(0)
        self._frames = [rng.integers(0, 256, (size, size, 3), dtype=np.uint8) for _ in range(distinct)]

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)
        return {"image": self._frames[i % len(self._frames)], "label": i % 10}

    def fingerprint(self) -> str:
        return f"frames-{self.n}-{self.size}-{len(self._frames)}"
