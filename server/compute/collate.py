"""A batch of samples (dicts of fields) written into its slot: each field stacked or ragged.

Per field, over the batch (README "Samples and targets"):

* **stacked** [B, ...] when every sample's value has one shape and dtype, as torch's
  ``default_collate`` stacks them: numpy arrays, numpy scalars, and Python scalars (int -> int64,
  float -> float64, bool -> bool);
* **ragged** (``TensorLayout.sample_shapes``: the values back to back, each sample's shape) when
  the shapes differ (images of different sizes: nothing is padded or cropped), always for
  per-object fields (``FieldSpec.per_object``: ``boxes`` [N_i, 4], ``masks``... arrive as lists
  even when N agrees by chance), and always for str (UTF-8) and bytes (uint8 per sample).

``index`` and ``position`` (int64 [B]) come first, so ``tensors[0]`` is always stacked [B].

Fast path: a field is written straight into the slot as each sample comes (one copy, as before
samples were dicts) until a sample disagrees in shape; it then turns ragged and its earlier
samples are copied out of the slot (the rare path). Ragged values are kept by reference and
copied once, after the last sample.

Errors: ``ShapeMismatchError`` (a ValueError) when a field's dtype (or number of dimensions)
differs between samples, or a field is missing from some samples, naming the field and both
samples; ValueError when a sample's per-object fields disagree on N; TypeError for a value of
another type (list, dict, None...), naming the field (``values.as_value``, server/data/datasets/).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np

from batchd.errors import ResourceExhaustedError, ShapeMismatchError
from batchd.server.compute.layout import align
from batchd.server.compute.protocol import TensorLayout, storage_dtype
from batchd.server.data.datasets.values import as_value

RESERVED = ("index", "position", "skipped")  # batch tensors batchd adds; samples may not have these fields
_STRINGS = ("str", "bytes")


class _Field:
    __slots__ = ("name", "dtype", "np_dtype", "shape", "ndim", "first", "ragged", "region", "offset", "values",
                 "per_object", "scalar")

    def __init__(self, name: str, dtype: str, value: np.ndarray, first: int, ragged: bool, per_object: bool):
        self.name, self.dtype, self.shape, self.ndim = name, dtype, value.shape, value.ndim
        self.np_dtype = storage_dtype(dtype)
        self.first, self.ragged, self.per_object = first, ragged, per_object
        self.scalar = _SCALARS_OF.get(dtype)  # the Python type written as it is into a stacked scalar field
        self.region: np.ndarray | None = None  # stacked: [capacity, *shape] on the slot
        self.offset = 0
        self.values: list[np.ndarray] = []  # ragged: each sample's value


_SCALARS_OF = {"int64": int, "float64": float, "bool": bool}


class BatchWriter:
    """Writes up to ``capacity`` samples into one slot; ``finish`` returns the tensors' layouts.

    per_object(name): whether a field is per-object (always ragged). describe(index): "sample 5
    (cat/x.jpg)" for messages. alloc(nbytes, keep) -> memoryview: a buffer of at least ``nbytes``
    whose first ``keep`` bytes are those of the previous one (the slot, or a grown segment).
    max_bytes: a batch larger than this raises ResourceExhaustedError before it is written (0: no
    limit). specs: the dataset's fields (``Dataset.fields``), for a batch whose every sample was
    skipped.
    """

    def __init__(self, capacity: int, *, per_object: Callable[[str], bool], describe: Callable[[int], str],
                 alloc: Callable[[int, int], memoryview], max_bytes: int = 0, specs: Sequence[Any] = (),
                 dataset: str = ""):
        self.capacity, self.n = capacity, 0
        self.per_object, self.describe, self.alloc, self.max_bytes = per_object, describe, alloc, max_bytes
        self.specs, self.dataset = specs, dataset
        self.index = np.empty(capacity, np.int64)
        self.position = np.empty(capacity, np.int64)
        self.fields: dict[str, _Field] = {}
        self.buf: memoryview | None = None
        self.end = 0  # bytes of the slot used by index, position and the stacked regions
        self._objects: tuple[str, int] | None = None

    def add(self, sample: dict, index: int, position: int) -> None:
        """Write one sample's fields. Raises ShapeMismatchError, TypeError (see the module docstring)."""
        if self.buf is None:
            self._start(sample, index)
        elif sample.keys() != self.fields.keys():
            self._missing(sample, index)
        n = self.n
        self._objects = None  # (field, N) of the sample's first per-object field
        for f in self.fields.values():
            value = sample[f.name]
            if f.region is not None:  # the fast path: stacked so far, a value like the first sample's
                if type(value) is np.ndarray:
                    if value.shape == f.shape and value.dtype == f.np_dtype:
                        f.region[n] = value
                        continue
                elif type(value) is f.scalar:
                    try:
                        f.region[n] = value
                    except OverflowError:
                        raise TypeError(f"{self._where(index)}: field {f.name!r}: {value} does not fit in int64") from None
                    continue
            self._write(f, *as_value(f.name, value), n, index)
        self.index[n], self.position[n] = index, position
        self.n = n + 1

    def _write(self, f: _Field, value: np.ndarray, dtype: str, n: int, index: int) -> None:
        """One value that is not a stacked field's like-shaped array: checked, then written or kept."""
        if dtype != f.dtype or (f.ragged and value.ndim != f.ndim):
            raise ShapeMismatchError(
                f"{self._where(index)}: field {f.name!r} is {dtype}{list(value.shape)} but in "
                f"{self.describe(f.first)} it is {f.dtype}{list(f.shape)}; a field must have one dtype "
                f"{'and number of dimensions ' if f.ragged else ''}in every sample of a batch")
        if f.per_object:
            self._check_objects(f.name, value, index)
        if f.ragged:
            f.values.append(value)
        elif value.shape == f.shape:
            f.region[n] = value
        elif value.ndim != f.ndim:
            raise ShapeMismatchError(
                f"{self._where(index)}: field {f.name!r} is {dtype}{list(value.shape)} but in "
                f"{self.describe(f.first)} it is {f.dtype}{list(f.shape)}; samples of different shapes come "
                "as a list, but they must have the same number of dimensions")
        else:  # the rare path: shapes differ, the field becomes a list of arrays
            f.values = [np.array(v) for v in f.region[:n]] + [value]
            f.ragged, f.region = True, None

    def finish(self) -> tuple[TensorLayout, ...]:
        """The batch's layouts (index, position, then the fields in the first sample's order), after
        writing the ragged fields. Raises ResourceExhaustedError over ``max_bytes``."""
        if self.buf is None:
            return self._empty()
        n = self.n
        layouts = [TensorLayout("index", "int64", (n,), 0), TensorLayout("position", "int64", (n,), align(8 * self.capacity))]
        offset, ragged = align(self.end), []
        for f in self.fields.values():
            if f.ragged:
                total = sum(v.size for v in f.values)
                t = TensorLayout(f.name, f.dtype, (total,), offset, tuple(tuple(v.shape) for v in f.values))
                offset = align(offset + t.nbytes)
                ragged.append((t, f.values))
            else:
                t = TensorLayout(f.name, f.dtype, (n, *f.shape), f.offset)
            layouts.append(t)
        self._check_bytes(offset)
        if offset > len(self.buf):
            for f in self.fields.values():
                f.region = None  # views of the old buffer go before it is replaced
            self.buf = self.alloc(offset, self.end)
        for t, values in ragged:
            flat = np.frombuffer(self.buf, storage_dtype(t.dtype), t.shape[0], t.offset)
            start = 0
            for v in values:
                np.copyto(flat[start:start + v.size].reshape(v.shape), v)
                start += v.size
        np.frombuffer(self.buf, np.int64, n, 0)[:] = self.index[:n]
        np.frombuffer(self.buf, np.int64, n, layouts[1].offset)[:] = self.position[:n]
        for f in self.fields.values():
            f.region, f.values = None, []
        self.buf = None
        return tuple(layouts)

    # -- inside ---------------------------------------------------------------------------------

    def _start(self, sample: dict, index: int) -> None:
        """Plan the slot from the first sample: index, position, then each stacked field [capacity, ...];
        room for the ragged fields estimated as capacity x the first sample's."""
        for name in sample:
            if name in RESERVED:
                raise ValueError(f"{self._where(index)}: field {name!r} is reserved (batchd adds index, position "
                                 "and skipped to every batch); rename it")
        offset = 2 * align(8 * self.capacity)
        estimate = 0
        for name, raw in sample.items():
            value, dtype = as_value(name, raw)
            per_object = self.per_object(name)
            f = _Field(name, dtype, value, index, ragged=per_object or dtype in _STRINGS, per_object=per_object)
            if f.ragged:
                estimate += align(value.nbytes * self.capacity)
            else:
                f.offset = offset
                offset = align(offset + value.nbytes * self.capacity)
            self.fields[name] = f
        self.end = offset
        self._check_bytes(self.end)
        want = self.end + estimate
        if self.max_bytes:
            want = min(want, max(self.max_bytes, self.end))
        self.buf = self.alloc(want, 0)
        for f in self.fields.values():
            if not f.ragged:
                f.region = np.ndarray((self.capacity, *f.shape), storage_dtype(f.dtype), self.buf, f.offset)

    def _check_objects(self, name: str, value: np.ndarray, index: int) -> None:
        """Per-object fields of one sample must agree on N, their first dimension (ValueError)."""
        if not value.ndim:
            raise ValueError(f"{self._where(index)}: per-object field {name!r} has no first dimension (one entry per "
                             f"object), it is a scalar")
        if self._objects is None:
            self._objects = (name, value.shape[0])
        elif value.shape[0] != self._objects[1]:
            first, n = self._objects
            raise ValueError(f"{self._where(index)}: per-object fields disagree on the number of objects: {first!r} has "
                             f"{n}, {name!r} has {value.shape[0]} ({list(value.shape)})")

    def _missing(self, values: dict, index: int) -> None:
        """Raise ShapeMismatchError naming a field one sample has and another lacks."""
        lacks = sorted(self.fields.keys() - values.keys())
        extra = sorted(values.keys() - self.fields.keys())
        first = next(iter(self.fields.values())).first
        what = f"has no field {lacks[0]!r}" if lacks else f"has a field {extra[0]!r}"
        raise ShapeMismatchError(f"{self._where(index)} {what} but {self.describe(first)} "
                                 f"{'has' if lacks else 'has not'}; every sample of a dataset must have the same fields "
                                 f"(here {sorted(values)} vs {sorted(self.fields)})")

    def _empty(self) -> tuple[TensorLayout, ...]:
        """Every sample was skipped: the dataset's fields with 0 samples."""
        layouts = [TensorLayout("index", "int64", (0,), 0), TensorLayout("position", "int64", (0,), 0)]
        for spec in self.specs:
            if spec.per_object or spec.dtype in _STRINGS:
                layouts.append(TensorLayout(spec.name, spec.dtype, (0,), 0, ()))
            else:
                layouts.append(TensorLayout(spec.name, spec.dtype, (0, *(max(d, 0) for d in spec.shape)), 0))
        self.alloc(64, 0)
        return tuple(layouts)

    def _check_bytes(self, nbytes: int) -> None:
        if self.max_bytes and nbytes > self.max_bytes:
            sizes = ", ".join(f"{f.name} {f.dtype}{list(f.shape)}" for f in self.fields.values())
            raise ResourceExhaustedError(
                f"dataset {self.dataset!r}: a batch of {self.capacity} samples ({sizes}, as the first sample comes out "
                f"of the pipeline) is {nbytes} bytes or more, over the server's limit of {self.max_bytes} "
                "(max_batch_bytes); use a smaller batch_size or output size")

    def _where(self, index: int) -> str:
        return f"dataset {self.dataset!r}: {self.describe(index)}"
