"""What a sample's field may hold, and the array it becomes (one rule for datasets and batches).

A field is a numpy array of numbers or booleans (any shape), a Python or numpy scalar (int ->
int64, float -> float64, bool -> bool), a str (UTF-8) or bytes. Anything else (a dict, a list,
None, an object, an array of strings or objects) cannot travel in a batch. ``kind: python``
checks every field of every sample with it (a wrong one is that sample's SampleError, naming
the field: ``on_error: skip`` applies); the batch writer (server/compute/collate.py) turns
values into arrays with it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

_NOT_NUMBERS = "OUSVMm"  # numpy dtype kinds that are not numbers or booleans


def as_value(name: str, value: Any) -> tuple[np.ndarray, str]:
    """A field's value as (array, dtype name): arrays as they are, Python and numpy scalars as 0-d
    arrays (int -> int64, float -> float64, bool -> bool), str as its UTF-8 bytes (dtype "str") and
    bytes as uint8 (dtype "bytes"). Raises TypeError naming the field for anything else."""
    if isinstance(value, np.ndarray):
        if value.dtype.kind in _NOT_NUMBERS:
            raise TypeError(f"field {name!r} is a numpy array of dtype {value.dtype}; batchd sends numbers and "
                            "booleans (a str or bytes field is one Python str or bytes per sample)")
        return value, value.dtype.name
    if isinstance(value, (bool, np.bool_)):
        return np.asarray(value, np.bool_), "bool"
    if isinstance(value, int):
        try:
            return np.asarray(value, np.int64), "int64"
        except OverflowError:
            raise TypeError(f"field {name!r}: {value} does not fit in int64") from None
    if isinstance(value, float):
        return np.asarray(value, np.float64), "float64"
    if isinstance(value, np.generic) and value.dtype.kind not in _NOT_NUMBERS:
        return np.asarray(value), value.dtype.name
    if isinstance(value, str):
        return np.frombuffer(value.encode("utf-8"), np.uint8), "str"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return np.frombuffer(bytes(value), np.uint8), "bytes"
    raise TypeError(f"field {name!r} is a {type(value).__name__}; a field is a numpy array, a Python int, float, "
                    "bool, str or bytes (make lists numpy arrays)")
