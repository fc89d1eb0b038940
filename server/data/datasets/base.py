"""What every dataset kind provides: a sized, indexable source of samples, each a dict of named fields.

A sample is a dict of fields (``load_sample``): numpy arrays of any dtype and shape, Python
ints and floats, str or bytes. Fields with a geometric meaning use the field's usual names and
conventions (README "Samples and targets"): ``image`` uint8 [H, W, C]; ``mask`` integer [H, W];
``masks`` uint8 [N, H, W]; ``boxes`` float32 [N, 4] xyxy in pixels; ``labels`` int64 [N];
``keypoints`` float32 [N, K, 2 or 3]; ``label`` int64 (classification). Every other field passes
through the pipeline untouched. ``fields`` describes them (``FieldSpec``, -1 for a dimension that
varies per sample).

A dataset is opened twice: once in the server (which builds its index into ``cache_dir`` if
needed and answers DescribeDataset) and once in every worker process (which maps that index
read-only). The index must be small per process: numpy arrays on memory-mapped files, never a
Python object per sample, so a 10-million-sample dataset costs each worker only the pages it
touches.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import numpy as np

from batchd.errors import SampleError


# Fields that hold one entry per object of the sample (their first dimension is N, the same in
# each): when the pipeline drops an object (a box cropped away), each of them drops it too, and
# they always arrive as lists of B tensors (ragged), even when N agrees across a batch.
PER_OBJECT_FIELDS = frozenset({"boxes", "labels", "masks", "keypoints", "iscrowd", "area"})


@dataclass(frozen=True, slots=True)
class FieldSpec:
    """One field of a sample: numpy dtype name ("uint8", "int64", "float32", "bool", "str",
    "bytes") and shape, -1 for a dimension that varies per sample ([] for a scalar such as
    ``label``; [-1, 4] for ``boxes``).

    per_object: the field has one entry per object along its first dimension (see
    ``PER_OBJECT_FIELDS``); None (default) means "if its name is one of PER_OBJECT_FIELDS".
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    per_object: bool | None = None

    def __post_init__(self):
        if self.per_object is None:
            object.__setattr__(self, "per_object", self.name in PER_OBJECT_FIELDS)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))


@dataclass(frozen=True, slots=True)
class SampleSpec:
    """One sample before any pipeline: image [H, W, C] of ``image_dtype``; -1 marks a varying dim."""

    image_shape: tuple[int, int, int]
    image_dtype: str = "uint8"


class Dataset(abc.ABC):
    """A map-style dataset of images with integer labels.

    Subclasses are cheap to open in every worker; all per-sample state lives in numpy arrays
    (memory-mapped where large). A kind whose samples live in storage implements ``read_bytes``
    (I/O, thread-safe) and ``decode`` (CPU) and gets ``load_image`` as their composition; a kind
    whose samples are in memory implements ``load_image`` alone.
    """

    name: str
    kind: str
    # whether the last ``load_sample`` drew random numbers (kind python: ``__getitem__``, keyed to
    # the sample); such a sample depends on the epoch, and the worker does not cache it
    last_sample_drew: bool = False

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of samples."""

    @property
    @abc.abstractmethod
    def classes(self) -> list[str]:
        """Class names; label ``l`` is ``classes[l]``."""

    @property
    @abc.abstractmethod
    def sample_spec(self) -> SampleSpec:
        """What a decoded sample looks like."""

    @abc.abstractmethod
    def label(self, index: int) -> int:
        """The label of sample ``index`` (0 <= index < len), without reading the image."""

    @property
    def fields(self) -> tuple[FieldSpec, ...]:
        """The fields of a sample as ``load_sample`` returns it, before any pipeline. Default:
        ``image`` (``sample_spec``) and ``label`` int64 []."""
        spec = self.sample_spec
        return (FieldSpec("image", spec.image_dtype, tuple(spec.image_shape)), FieldSpec("label", "int64", ()))

    def load_sample(self, index: int, min_size: tuple[int, int] | None = None, key: np.ndarray | None = None) -> dict:
        """Sample ``index`` as a dict of fields (see the module docstring). Default: ``{"image":
        load_image(index, min_size), "label": label(index)}``; kinds whose samples carry more
        (targets, extra fields) override it, or ``decode_sample`` when they read from storage.
        ``key``: uint64 [2], ``batchd.sampler.sample_key(seed, epoch)``, for kinds whose samples
        draw random numbers (kind python keys them to (key, index)); others ignore it.

        Raises IndexError out of range; SampleError (naming dataset, index and file) if the
        sample cannot be read or decoded.
        """
        if self.concurrent_reads:
            return self.decode_sample(index, self.read_bytes(index), min_size)
        return {"image": self.load_image(index, min_size), "label": self.label(index)}

    def decode_sample(self, index: int, data, min_size: tuple[int, int] | None = None,
                      eighths: int | None = None, window: tuple[int, int, int, int] | None = None,
                      jpeg_index=None) -> dict:
        """CPU only: sample ``index`` as a dict of fields from ``data`` (what ``read_bytes(index)``
        returned). Default: ``{"image": decode(index, data, min_size), "label": label(index)}``.
        ``eighths`` (1-8, only for a sample whose ``decoded_size`` is known): the image decoded at
        that m/8 of that size; with ``window`` (x1, y1, x2, y2, full-size pixels) only the
        rectangle ``scaled_jpeg.scaled_window`` gives (every other field as at full size), from
        ``jpeg_index`` (``scaled_jpeg.JpegIndex`` of ``data``) when given: the same pixels, less read.

        Raises SampleError (naming dataset, index and file) if it cannot be decoded.
        """
        if eighths is None:
            return {"image": self.decode(index, data, min_size), "label": self.label(index)}
        return {"image": self.decode(index, data, min_size, eighths=eighths, window=window, jpeg_index=jpeg_index),
                "label": self.label(index)}

    def decoded_size(self, index: int, data) -> tuple[int, int] | None:
        """``(height, width)`` of sample ``index``'s image as ``decode_sample`` returns it at full
        size, read from the headers of ``data`` without decoding, when the kind can also decode it
        at m/8 of that size (``decode_sample``'s ``eighths``; server/compute/region.py); None
        otherwise (the default; not a JPEG; ``reduced_decode`` off). Never raises."""
        return None

    def read_bytes(self, index: int) -> bytes:
        """I/O only: the encoded bytes of sample ``index`` (a file's or an object's content).

        Called from a worker's I/O threads, many at once (``reads_in_flight``, see
        ``server/data/reader.py``), so it must be thread-safe and do no CPU-heavy work: decoding
        belongs in ``decode``, which runs on the worker's own thread, one per core. Any
        bytes-like object (``bytes``, ``memoryview``, uint8 ndarray) may be returned.

        Raises IndexError out of range; SampleError (naming dataset, index and the path or URL
        without credentials, see ``sample_error``) if it cannot be read. A kind that does not
        override it (samples already in memory) is read with ``load_image`` instead.
        """
        raise NotImplementedError(f"dataset kind {self.kind!r} has no read_bytes; use load_image")

    def decode(self, index: int, data, min_size: tuple[int, int] | None = None) -> np.ndarray:
        """CPU only: turn ``data`` (what ``read_bytes(index)`` returned) into uint8 [H, W, C]
        (RGB for colour images). ``index`` is for error messages and per-sample metadata.

        ``min_size`` (height, width): the pipeline resizes to this first, so a kind may decode
        at reduced resolution as long as the image stays at least this large (or ignore it).

        Raises SampleError (naming dataset, index and file) if it cannot be decoded.
        """
        raise NotImplementedError(f"dataset kind {self.kind!r} has no decode; use load_image")

    @property
    def concurrent_reads(self) -> bool:
        """True when this kind implements ``read_bytes`` (its samples come from storage): the
        worker then reads samples on I/O threads ahead of decoding them. False for kinds whose
        samples are in memory (``load_image`` only)."""
        return type(self).read_bytes is not Dataset.read_bytes

    def load_image(self, index: int, min_size: tuple[int, int] | None = None) -> np.ndarray:
        """Read and decode sample ``index``: uint8 [H, W, C] (RGB for colour images); by default
        ``decode(index, read_bytes(index), min_size)``. Kinds without ``read_bytes`` override it.

        Raises IndexError out of range; SampleError (naming dataset, index and file) if it
        cannot be read or decoded.
        """
        return self.decode(index, self.read_bytes(index), min_size)

    def source(self, index: int) -> str:
        """Where sample ``index`` comes from, relative to the dataset root (for error messages)."""
        return f"#{index}"

    @property
    def fingerprint(self) -> str:
        """What the samples are: 32 hex characters, computed with the index (see ``_fingerprint``).

        Equal fingerprints: the same samples in the same order with the same labels. "" if the
        kind computes none.
        """
        index = getattr(self, "_index", None)
        return str(index.meta.get("fingerprint", "")) if index is not None else ""

    def labels(self) -> np.ndarray | None:
        """Every sample's label, int64 [n], for kinds that hold them in an index (cheap: no sample is
        read); None for the others (coco and segmentation samples have no single label; a python
        dataset's only through a ``labels`` attribute)."""
        labels = getattr(self, "_labels", None)
        return None if labels is None else np.asarray(labels, np.int64)

    def weights(self) -> np.ndarray | None:
        """The dataset's own weights for weighted sampling, float64 [n] (a manifest's ``weight_column``,
        a python dataset's ``weights``), or None (the default)."""
        return None

    @property
    def info(self) -> dict[str, str]:
        """Facts about the dataset a trainer may need beyond its fields, name -> value as text:
        e.g. segmentation's ``ignore_index``, coco's counts of dropped annotations. {} by default."""
        return {}

    @property
    def decode_settings(self) -> dict[str, str]:
        """Settings of this dataset that change decoded pixels (part of the server's build
        fingerprint, see ``batchd.server.compute.build``): name -> value as text. None by default."""
        return {}

    def _check(self, index: int) -> int:
        """``index`` as an int; raises IndexError naming the dataset unless 0 <= index < len(self)."""
        index = int(index)
        if not 0 <= index < len(self):
            raise IndexError(f"dataset {self.name!r}: index {index} out of range [0, {len(self)})")
        return index

    def sample_error(self, index: int, reason: str) -> SampleError:
        return SampleError(dataset=self.name, index=index, path=self.source(index), reason=reason)
