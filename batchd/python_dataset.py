"""``PythonDataset``: the shape of a ``kind: python`` dataset, as a typing ``Protocol``.

A server config's ``{kind: python, factory: "mymodule:MyDataset", args: {...}}`` makes the
server call ``MyDataset(**args)`` (once in the server, once in each worker) and read samples from
what it returns (``batchd.server.data.datasets.python``). This is what it uses of that object, so
that an IDE or a type checker can check a dataset before a server does::

    class Squares(batchd.PythonDataset):   # or no base at all: the protocol is structural
        def __len__(self) -> int: ...
        def __getitem__(self, index: int) -> dict[str, Any]: ...

No heavy imports: server worker processes import ``batchd``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class PythonDataset(Protocol):
    """A map-style dataset the server reads samples from (``kind: python``).

    Required:

    * ``__len__() -> int``: the number of samples, N >= 0.
    * ``__getitem__(index) -> Mapping[str, value]``: sample ``index`` (an int in [0, N)) as a dict
      of fields, e.g. ``{"image": uint8 ndarray [H, W, C], "label": int}``. Values: numpy arrays
      and scalars, Python ints, floats, bools, str and bytes; torch tensors and PIL images become
      numpy arrays. It must be a pure function of ``index``: the cache and every guarantee rely
      on it. It may take the sample's own generator, ``__getitem__(index, rng=None)`` (a
      ``numpy.random.Generator`` keyed to (seed, epoch, index)), or draw from Python's
      ``random``, ``numpy.random`` or torch's default generator, which batchd seeds per sample.
      What it raises becomes a ``batchd.SampleError`` naming the dataset and index, with the
      dataset's traceback.

    Optional (looked up with ``getattr``, so not members of the protocol):

    * ``fields``: an attribute, or a method taking no argument, mapping each field's name to
      ``(dtype, shape)`` (a numpy dtype name such as ``"uint8"``, a tuple of ints with -1 for a
      dimension that varies) or to ``{"dtype", "shape", "per_object"}``. Without it, sample 0
      shows the fields.
    * ``fingerprint() -> str``: the data's version, part of the dataset's fingerprint (change it
      when the data changes). Without it, the factory's source file stands in for it.
    * ``weights``: an attribute, or a method taking no argument, of one finite non-negative
      number per sample (not all zero): the dataset's own weights for weighted sampling
      (``batchd.WeightedRandomSampler("dataset", num_samples)``). The server refuses bad ones at
      start.
    * ``labels``: an attribute, or a method taking no argument, of one non-negative integer per
      sample: the class counts (``DatasetInfo.class_counts``) and labels without reading samples.
      Ignored when it is not that.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Mapping[str, Any]: ...
