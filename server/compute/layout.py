"""Where a batch's tensors lie in its shared-memory slot: ``TensorLayout``s at 64-byte offsets.

Two layouts: a decoded batch, laid out by ``server/compute/collate.py`` (index, position, then
the samples' fields, stacked or ragged) and a JPEG batch for decoding on the client
(``jpeg_layout``, ``server/compute/encoded.py``). The server sends the layouts in ``BatchDone``
and on the wire, so the client maps the same tensors without knowing which layout it got.
"""

from __future__ import annotations

from batchd.server.compute.protocol import TensorLayout

ALIGN = 64  # bytes: every tensor starts on a cache line (and a SIMD-friendly boundary)


def align(n: int) -> int:
    """``n`` rounded up to a multiple of ``ALIGN`` bytes."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


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
