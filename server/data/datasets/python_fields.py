"""The fields of a ``kind: python`` dataset: declared or read from sample 0, each sample checked.

``PythonFields`` is mixed into ``PythonDataset`` (``python.py``, which builds the samples): it
needs the dataset's ``obj``, ``name``, ``cfg``, ``_len``, ``_build`` and ``sample_error``, and
its ``_fields``, ``_raw`` and ``_declared_fields``, None until first read.

Fields: ``fields`` on the dataset (an attribute or a method) mapping name -> (dtype, shape) or
name -> {"dtype", "shape", "per_object"}, with -1 for a dimension that varies; else read from
sample 0 (its dtypes and shapes; a per-object field's first dimension is -1). Every sample is
checked against them (``check_fields``: the same names, each field's dtype and number of
dimensions, a declared field's fixed dimensions; ``boxes`` and ``keypoints`` of any number
dtype): a sample that differs is its own SampleError. ``fields`` (what DescribeDataset reports)
gives ``boxes`` and ``keypoints`` as float32, as they leave the worker. Per-object fields: the
config's ``per_object_fields``, else the standard names (``PER_OBJECT_FIELDS``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from .base import FieldSpec
from .values import as_value

GEOMETRIC = ("boxes", "keypoints")  # fields that leave the worker as float32 whatever their dtype
_NUMBER_DTYPES = frozenset(np.dtype(c).name for c in "?bBhHiIlLqQefd")


class PythonFields:
    """A python dataset's fields (``fields``) and the check of each sample against them
    (``check_fields``); see the module docstring."""

    def check_fields(self, index: int, sample: dict) -> None:
        """Raise SampleError (naming dataset, index, field, expected and got) unless ``sample``
        has exactly the dataset's fields, each of its dtype and number of dimensions (and, for
        declared fields, of its fixed dimensions): declared (``fields`` on the dataset) or as
        sample 0 has them. ``boxes`` and ``keypoints`` may be of any number dtype (they leave
        the worker as float32 whatever it is)."""
        specs = self._raw_fields()
        where = "as the dataset declares it" if self._declared_fields is not None else \
            "as sample 0 has it (declare fields on the dataset to say otherwise)"
        if sample.keys() != specs.keys():
            lacks, extra = sorted(specs.keys() - sample.keys()), sorted(sample.keys() - specs.keys())
            what = f"has no field {lacks[0]!r}" if lacks else f"has a field {extra[0]!r} that the dataset's fields lack"
            raise self.sample_error(index, f"the sample {what}: expected the fields {sorted(specs)}, {where}; got "
                                           f"{sorted(sample)}")
        for name, value in sample.items():
            spec = specs[name]
            dtype, shape = _dtype_and_shape(value)
            same_dtype = dtype == spec.dtype or (name in GEOMETRIC and dtype in _NUMBER_DTYPES)
            fixed = all(want in (-1, got) for want, got in zip(spec.shape, shape)) \
                if self._declared_fields is not None else True
            if not same_dtype or len(shape) != len(spec.shape) or not fixed:
                raise self.sample_error(index, f"field {name!r} is {dtype} {list(shape)}: expected "
                                               f"{spec.dtype} {list(spec.shape)} (-1: any size), {where}")

    def _raw_fields(self) -> dict[str, FieldSpec]:
        """name -> FieldSpec of the samples as ``__getitem__`` gives them (before boxes and
        keypoints become float32): declared, or read from sample 0."""
        if self._raw is None:
            declared = getattr(self.obj, "fields", None)
            declared = declared() if callable(declared) else declared
            self._declared_fields = declared
            specs = self._declared(declared) if declared is not None else self._from_sample(0)
            self._raw = {spec.name: spec for spec in specs}
        return self._raw

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        """The fields as they leave the worker: ``_raw_fields``, boxes and keypoints float32."""
        if self._fields is None:
            self._fields = tuple(FieldSpec(f.name, "float32", f.shape, f.per_object) if f.name in GEOMETRIC else f
                                 for f in self._raw_fields().values())
        return self._fields

    def _per_object(self, name: str) -> bool | None:
        chosen = self.cfg.per_object_fields
        return None if chosen is None else name in chosen

    def _declared(self, declared: Any) -> tuple[FieldSpec, ...]:
        if not isinstance(declared, Mapping):
            raise TypeError(f"dataset {self.name!r}: fields must map name -> (dtype, shape), got {type(declared).__name__}")
        out = []
        for name, spec in declared.items():
            if isinstance(spec, Mapping):
                dtype, shape, per_object = spec.get("dtype"), spec.get("shape", ()), spec.get("per_object")
            else:
                (dtype, shape), per_object = spec, None
            if per_object is None:
                per_object = self._per_object(name)
            out.append(FieldSpec(str(name), _dtype_name(dtype), tuple(shape), per_object))
        return tuple(out)

    def _from_sample(self, index: int) -> tuple[FieldSpec, ...]:
        if self._len == 0:
            return ()
        out = []
        for name, value in self._build(index, None).items():
            if isinstance(value, str):
                dtype, shape = "str", ()
            elif isinstance(value, (bytes, bytearray)):
                dtype, shape = "bytes", ()
            elif isinstance(value, bool):
                dtype, shape = "bool", ()
            elif isinstance(value, int):
                dtype, shape = "int64", ()
            elif isinstance(value, float):
                dtype, shape = "float64", ()
            elif isinstance(value, (np.ndarray, np.generic)):
                dtype, shape = value.dtype.name, tuple(value.shape)
            else:
                raise TypeError(f"dataset {self.name!r}, sample {index}: field {name!r} is a {type(value).__name__}; "
                                "a field is a numpy array (or torch tensor), a Python int, float, bool, str or bytes")
            spec = FieldSpec(name, dtype, shape, self._per_object(name))
            if spec.per_object and shape:
                spec = FieldSpec(name, dtype, (-1, *shape[1:]), True)
            out.append(spec)
        return tuple(out)


def _dtype_name(dtype: Any) -> str:
    """A declared dtype's canonical name: numpy's ("float" -> "float64"), or "str" / "bytes"."""
    if str(dtype) in ("str", "bytes"):
        return str(dtype)
    try:
        return np.dtype(dtype).name
    except TypeError:
        return str(dtype)


def _dtype_and_shape(value: Any) -> tuple[str, tuple[int, ...]]:
    """A field's dtype name and shape as ``FieldSpec`` gives them (str and bytes: scalars)."""
    dtype = as_value("", value)[1]
    return dtype, tuple(np.shape(value)) if dtype not in ("str", "bytes") else ()
