"""The sequential baseline: read, decode, transform and stack batches in this one process.

The same code as a batchd worker (``batchd.server.compute.worker._Worker.run``): ``Dataset.load_image``
(``read_rgb``: ``np.fromfile`` + ``cv2.imdecode`` + BGR->RGB, reduced JPEG decoding where the
pipeline starts by resizing to at most half the size, as the worker asks for), the label, the
pipeline seeded once per batch, and a copy into a preallocated [B, H, W, C] array; then torch
tensors.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from bench.common import decode_min_size, load_image


def build_batch(ds, compose, indices, seed: int = 0, min_size=None) -> dict[str, torch.Tensor]:
    if compose is not None:
        compose.set_random_seed(seed)
    labels = np.empty(len(indices), np.int64)
    images = None
    for i, index in enumerate(indices):
        image = load_image(ds, int(index), min_size)
        labels[i] = ds.label(int(index))
        if compose is not None:
            image = compose(image=image)["image"]
        if images is None:
            images = np.empty((len(indices), *image.shape), image.dtype)
        images[i] = image
    return {"image": torch.from_numpy(images), "label": torch.from_numpy(labels),
            "index": torch.as_tensor(np.asarray(indices, np.int64))}


def batches(ds, compose, batch_size: int, num_batches: int, seed: int = 0):
    """``num_batches`` batches of a shuffled order (wrapping around the dataset if needed)."""
    rng = np.random.default_rng(seed)
    need = batch_size * num_batches
    order = np.concatenate([rng.permutation(len(ds)) for _ in range(-(-need // len(ds)))])[:need]
    min_size = decode_min_size(compose)
    for b in range(num_batches):
        yield build_batch(ds, compose, order[b * batch_size:(b + 1) * batch_size], seed + b, min_size)


def batch_seconds(ds, compose, batch_size: int, num_batches: int, seed: int = 0) -> list[float]:
    """Wall seconds to build each of ``num_batches`` batches in this process."""
    out = []
    it = batches(ds, compose, batch_size, num_batches, seed)
    for _ in range(num_batches):
        t0 = time.perf_counter()
        next(it)
        out.append(time.perf_counter() - t0)
    return out
