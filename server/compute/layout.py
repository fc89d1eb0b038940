"""Where a batch's tensors lie in its shared-memory slot: ``TensorLayout``s at 64-byte offsets.

Two layouts: a decoded batch (``batch_layout``: image, label, index, position) and a JPEG batch
for decoding on the client (``jpeg_layout``, ``server/compute/encoded.py``). The worker writes through
``view``; the server sends the layouts in ``BatchDone`` and on the wire, so the client maps the
same tensors without knowing which layout it got.
"""

from __future__ import annotations

import numpy as np

from batchd.server.compute.protocol import TensorLayout

ALIGN = 64  # bytes: every tensor starts on a cache line (and a SIMD-friendly boundary)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN`` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def batch_layout(batch_size: int, image_shape: tuple[int, ...], image_dtype: np.dtype) -> tuple[TensorLayout, ...]:
    """A batch's tensors in its slot, each at a 64-byte aligned offset: image [B, *image_shape] at 0,
    then label int64 [B], index int64 [B] (dataset sample indices) and position int64 [B] (each
    sample's position in the epoch's global order before sharding, ``batchd.sampler.global_positions``:
    what per-sample random streams are keyed by, e.g. for augmentations finished on the GPU)."""
    image = TensorLayout("image", np.dtype(image_dtype).name, (batch_size, *image_shape), 0)
    label = TensorLayout("label", "int64", (batch_size,), align(image.nbytes))
    index = TensorLayout("index", "int64", (batch_size,), label.offset + align(label.nbytes))
    position = TensorLayout("position", "int64", (batch_size,), index.offset + align(index.nbytes))
    return image, label, index, position


def jpeg_layout(samples: int, total_bytes: int) -> tuple[TensorLayout, ...]:
    """A JPEG batch's tensors in its slot, each 64-byte aligned: label, index, position int64 [B],
    jpeg_offsets int64 [B + 1], jpeg_resize int64 [2], jpeg_reduce int64 [B], jpeg uint8
    [total_bytes] (see ``server/compute/encoded.py``)."""
    out, offset = [], 0
    for name, dtype, shape in (("label", "int64", (samples,)), ("index", "int64", (samples,)),
                               ("position", "int64", (samples,)), ("jpeg_offsets", "int64", (samples + 1,)),
                               ("jpeg_resize", "int64", (2,)), ("jpeg_reduce", "int64", (samples,)),
                               ("jpeg", "uint8", (total_bytes,))):
        t = TensorLayout(name, dtype, shape, offset)
        out.append(t)
        offset = align(t.offset + t.nbytes)
    return tuple(out)


def layout_nbytes(layout: tuple[TensorLayout, ...]) -> int:
    """Bytes of slot the layout needs."""
    return max(t.offset + t.nbytes for t in layout)


def view(buf: memoryview, t: TensorLayout) -> np.ndarray:
    """A numpy array on ``buf`` for tensor ``t`` (no copy)."""
    return np.frombuffer(buf, dtype=t.dtype, count=int(np.prod(t.shape)), offset=t.offset).reshape(t.shape)
