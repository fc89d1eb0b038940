"""A received field as the batch holds it (``field``): stacked, ragged (one flat buffer, split into
per-sample views), or strings; a malformed one raises ValueError naming it, never a crash or a misread.

loader.proto's ``Tensor`` lays out each field of a batch for all B samples at once:

* stacked (``sample_ndim`` 0): one tensor [B, ...];
* ragged (``sample_ndim`` > 0, the samples' shapes differ): the values back to back, 1-D, with
  each sample's shape and B + 1 element offsets, as Arrow's list arrays;
* "str" / "bytes": ragged uint8 values, one UTF-8 string or byte string per sample.

A ``Ragged`` stays one tensor until the batch is where it is used: a copy to a GPU copies its
values once (``map_values``), and ``unpack`` then splits it into B views of those values, on
whatever device they are.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Union

import numpy as np
import torch

from batchd import wire

STRINGS = ("str", "bytes")


@dataclass(frozen=True, slots=True)
class Ragged:
    """A ragged field of B samples: ``values`` 1-D (every sample's elements back to back, C order),
    sample i is ``values[offsets[i]:offsets[i + 1]].view(shapes[i])``."""

    values: torch.Tensor
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]

    def split(self) -> list[torch.Tensor]:
        """The B samples: views of ``values`` (no copy), on its device."""
        v = self.values
        return [v[a:b].view(shape) for shape, a, b in zip(self.shapes, self.offsets, self.offsets[1:])]


Field = Union[torch.Tensor, Ragged, list]  # a list of B str or B bytes
Unpacked = Union[torch.Tensor, list]  # a stacked tensor [B, ...], or a list of B tensors / str / bytes


@functools.lru_cache(maxsize=64)  # (a few names, looked up per field and batch)
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a tensor's elements ("str" and "bytes" are uint8).

    Raises ValueError for a dtype name torch does not have.
    """
    if name in STRINGS:
        return torch.uint8
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"the server sent a tensor of dtype {name!r}, which torch does not have")
    return dtype


@functools.lru_cache(maxsize=64)
def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of a tensor's elements ("str" and "bytes" are uint8). Raises ValueError."""
    if name in STRINGS:
        return np.dtype(np.uint8)
    try:
        return np.dtype(name)
    except TypeError:
        raise ValueError(f"the server sent a tensor of dtype {name!r}, which numpy does not have") from None


def elements(t: wire.WireTensor) -> int:
    """Elements of the tensor's values (a negative dimension raises ValueError)."""
    if any(d < 0 for d in t.shape):
        raise ValueError(f"the server sent field {t.name!r} with shape {list(t.shape)}")
    return math.prod(t.shape)


def nbytes(t: wire.WireTensor) -> int:
    """Bytes of the tensor's values. Raises ValueError (a bad shape or dtype)."""
    return elements(t) * torch_dtype(t.dtype).itemsize


def from_bytes(t: wire.WireTensor, data) -> torch.Tensor:
    """The values of ``t`` as a 1-D tensor on ``data`` (bytes or a buffer, no copy).

    Raises ValueError if ``data`` does not hold exactly ``nbytes(t)`` bytes.
    """
    dtype, n = torch_dtype(t.dtype), nbytes(t)
    if len(data) != n:
        raise ValueError(f"the server sent {len(data)} bytes for field {t.name!r} of {t.dtype} {list(t.shape)}, "
                         f"which needs {n}")
    return torch.frombuffer(data, dtype=dtype) if n else torch.empty(0, dtype=dtype)


def field(t: wire.WireTensor, values: torch.Tensor) -> Field:
    """The field ``t`` over its 1-D ``values`` (``elements(t)`` of its dtype): a stacked tensor
    [B, ...] (a view of values), a ``Ragged`` (values with checked shapes and offsets), or a list of
    B str / bytes (copies).

    Raises ValueError naming the field (and the sample) if the layout is malformed: offsets not
    starting at 0, decreasing or not ending at the values' length, a count of shapes other than B x
    sample_ndim, a shape with a negative dimension or whose size is not its offsets' difference,
    str/bytes stacked or of more than one dimension, or a "str" sample that is not UTF-8.
    """
    if values.dim() != 1 or values.numel() != elements(t):
        raise ValueError(f"field {t.name!r}: {values.numel()} values for shape {list(t.shape)}")
    if t.sample_ndim == 0:
        if t.dtype in STRINGS:
            raise ValueError(f"the server sent {t.dtype} field {t.name!r} stacked; str and bytes fields are ragged")
        return values.view(t.shape)
    shapes, offsets = _layout(t)
    if t.dtype not in STRINGS:
        return Ragged(values, shapes, offsets)
    raw = values.numpy().tobytes()  # strings are copies: they never hold a shared-memory slot
    parts = [raw[a:b] for a, b in zip(offsets, offsets[1:])]
    if t.dtype == "bytes":
        return parts
    out = []
    for i, part in enumerate(parts):
        try:
            out.append(part.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise ValueError(f"field {t.name!r}: sample {i} is not UTF-8 ({e.reason} at byte {e.start})") from None
    return out


def views(batch: wire.WireBatch, base: np.ndarray) -> dict[str, Field]:
    """The batch's fields as views of ``base``, a uint8 array holding its payload (no copy; ragged
    fields one flat tensor each, str / bytes lists are copies). Raises ValueError naming a field the
    server sent malformed or ending beyond ``base``."""
    out = {}
    read_only = not base.flags.writeable  # (a slot mapped for copies to a GPU, never written: torch warns)
    with warnings.catch_warnings() if read_only else contextlib.nullcontext():
        if read_only:
            warnings.simplefilter("ignore", UserWarning)
        for t in batch.tensors:
            end = t.offset + nbytes(t)
            if end > len(base):
                raise ValueError(f"field {t.name!r} ends at byte {end}, beyond the payload's {len(base)}")
            out[t.name] = field(t, torch.from_numpy(base[t.offset : end].view(numpy_dtype(t.dtype))))
    return out


def _layout(t: wire.WireTensor) -> tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]:
    """The checked per-sample shapes and element offsets of ragged field ``t``."""
    name, ndim, offsets, flat = t.name, t.sample_ndim, t.sample_offsets, t.sample_shapes
    if len(t.shape) != 1:
        raise ValueError(f"the server sent ragged field {name!r} with values of shape {list(t.shape)} (must be 1-D)")
    if t.dtype in STRINGS and ndim != 1:
        raise ValueError(f"the server sent {t.dtype} field {name!r} with {ndim} dimensions per sample (must be 1)")
    b = len(offsets) - 1
    if b < 0 or offsets[0] != 0 or offsets[-1] != t.shape[0]:
        raise ValueError(f"the server sent ragged field {name!r} with offsets {_head(offsets)} that do not run "
                         f"from 0 to its {t.shape[0]} elements")
    if len(flat) != b * ndim:
        raise ValueError(f"the server sent ragged field {name!r} with {len(flat)} shape dimensions for {b} samples "
                         f"of {ndim} dimensions")
    shapes = tuple(tuple(flat[i * ndim:(i + 1) * ndim]) for i in range(b))
    for i, shape in enumerate(shapes):
        size = offsets[i + 1] - offsets[i]
        if size < 0 or any(d < 0 for d in shape) or math.prod(shape) != size:
            raise ValueError(f"the server sent ragged field {name!r} whose sample {i} has shape {list(shape)} "
                             f"but {size} elements (offsets {offsets[i]}..{offsets[i + 1]})")
    return shapes, tuple(offsets)


def _head(values, n: int = 8) -> str:
    return str(list(values[:n]))[:-1] + (", ...]" if len(values) > n else "]")


def unpack(batch: dict[str, Field]) -> dict[str, Unpacked]:
    """The batch as the loader hands it out: each ``Ragged`` split into its B views (no copy);
    stacked tensors and lists of str / bytes as they are."""
    return {name: value.split() if isinstance(value, Ragged) else value for name, value in batch.items()}


def map_values(value: Field, fn: Callable[[torch.Tensor], torch.Tensor]) -> Field:
    """``fn`` applied to a field's one tensor: a stacked tensor, or a ragged field's flat values
    (copied as one tensor, its layout kept); a list of str / bytes is returned as it is."""
    if isinstance(value, Ragged):
        return replace(value, values=fn(value.values))
    if isinstance(value, torch.Tensor):
        return fn(value)
    return value


def tensors(batch: dict[str, Field]) -> dict[str, torch.Tensor]:
    """The batch's tensors as they lie in memory: stacked tensors and ragged fields' flat values."""
    out = {}
    for name, value in batch.items():
        if isinstance(value, Ragged):
            out[name] = value.values
        elif isinstance(value, torch.Tensor):
            out[name] = value
    return out
