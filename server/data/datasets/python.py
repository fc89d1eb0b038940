"""``kind: python``: the operator's own map-style dataset, imported from the server's environment.

Config: ``{kind: python, factory: "mypkg.data:MyDataset", args: {root: /data/x}}``. The server
imports ``factory`` (installed, on ``PYTHONPATH``, or on ``python_path`` / ``batchd serve
--python-path DIR``) and calls it with ``args`` once in the server (length, fields, fingerprint)
and once in each worker process. The result has ``__len__`` and ``__getitem__(i) -> dict`` of
fields (README "Samples and targets"); torch tensors and PIL images in it become numpy arrays
(``.numpy()`` / ``np.asarray``, without importing torch here). It runs on the worker's own
thread, one sample at a time.

Randomness: a sample must be a pure function of (seed, epoch, index) (the cache and the
invariant rely on it). ``__getitem__`` may draw from Python's ``random``, ``numpy.random`` and
torch's default generator: batchd seeds them for each sample from (seed, epoch, index) and
restores them afterwards; and it may take a generator of its own, ``def __getitem__(self,
index, rng=None)`` (a numpy Generator keyed the same way, as grain hands a random map its
``rng``). See ``_keyed``. Randomness batchd cannot key is found by construction
(``check_keyed``, ``_unkeyable``): a sample is built twice under the same key, and a generator
reachable from the dataset (its attributes, class, closures, module globals) that moved between
the two builds, the operating system's entropy read during the second, or a difference between
them refuses the dataset (``UnkeyableRandomnessError``, naming it, what was found and where the
randomness must go), or only warns with ``deterministic: false`` (whose samples are then never
cached nor checked). The server checks sample 0 and ``KEYED_CHECKS - 1`` others at start-up;
each worker checks a sample at random intervals while serving (``recheck.RECHECK_EVERY``,
server/compute/recheck.py).
Samples whose ``__getitem__`` drew are never cached either (their bytes depend on the epoch).

Fields: declared by the dataset or read from sample 0, and every sample checked against them
(``python_fields.py``, mixed in: ``PythonFields``).

Fingerprint: a hash of the factory's name, ``args``, ``len`` and the dataset's own
``fingerprint()`` when it has one (it names the data version); without it, the factory's source
file instead, which misses changes to the files the dataset reads, to other modules it imports
and to the libraries it uses (README).

Errors: a factory that cannot be imported or built raises its own error (the server stops at
start-up); a raise in ``__getitem__`` is a SampleError naming dataset and index whose reason
carries the exception and the user's traceback (``on_error: skip`` applies); so is a field that
cannot become an array (a dict, a list, None, an object, a bfloat16 tensor: ``values.as_value``),
or one of another dtype or rank than the dataset's fields, naming the field.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import random
import sys
import traceback
from collections.abc import Mapping
from typing import Any

import logging

import numpy as np

from batchd.sampler import sample_key

from ._keyed import keyed_call, takes_rng
from ._unkeyable import EntropyWatch, moved, reachable_generators
from batchd.errors import SampleError

from .base import Dataset, FieldSpec, SampleSpec
from .python_fields import PythonFields
from .values import as_value

log = logging.getLogger(__name__)

KEYED_CHECKS = 5  # samples the server builds twice at start-up (check_keyed); workers check more while serving


class UnkeyableRandomnessError(ValueError):
    """A ``kind: python`` dataset draws randomness batchd cannot key to (seed, epoch, index): the
    message names the dataset, what was found and where the randomness must go."""


def add_python_path(dirs) -> None:
    """Put ``dirs`` (``python_path`` / ``--python-path``) at the front of ``sys.path``, once each."""
    for d in reversed([os.path.abspath(os.fspath(d)) for d in dirs]):
        if d not in sys.path:
            sys.path.insert(0, d)


def import_factory(spec: str) -> Any:
    """The object ``"package.module:attribute"`` names (attribute may be dotted). Raises what the
    import raises (ModuleNotFoundError, the module's own error), or AttributeError naming it."""
    module_name, _, attr = spec.partition(":")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise AttributeError(f"{spec}: module {module_name!r} has no attribute {attr!r}") from None
    return obj


def to_numpy(value: Any) -> Any:
    """A torch tensor or PIL image as a numpy array (torch is not imported here); anything else as
    it is. Raises TypeError for a tensor numpy cannot hold (bfloat16...), naming its dtype."""
    module = type(value).__module__
    if module == "torch" or module.startswith("torch."):
        try:
            return value.detach().cpu().numpy()
        except TypeError as e:
            raise TypeError(f"is a torch tensor of dtype {value.dtype}, which numpy cannot hold ({e}); convert it "
                            "in __getitem__ (e.g. .float())") from None
    if module.startswith("PIL."):
        return np.asarray(value)
    return value


class PythonDataset(PythonFields, Dataset):
    """A dataset object built by the operator's factory (see the module docstring; its fields:
    ``PythonFields``)."""

    kind = "python"

    def __init__(self, name: str, cfg, cache_dir, *, build: bool, max_pixels: int | None = None):
        self.name, self.cfg = name, cfg
        try:
            factory = import_factory(cfg.factory)
            self.obj = factory(**cfg.args)
        except Exception as e:
            e.add_note(f"while building dataset {name!r} (kind python): {cfg.factory}(**{cfg.args!r})")
            raise
        for method in ("__len__", "__getitem__"):
            if not hasattr(self.obj, method):
                raise TypeError(f"dataset {name!r}: {cfg.factory}(...) returned a {type(self.obj).__name__}, "
                                f"which has no {method} (a map-style dataset has __len__ and __getitem__)")
        self._len = int(len(self.obj))
        self._factory = factory
        self._fields: tuple[FieldSpec, ...] | None = None
        self._raw: dict[str, FieldSpec] | None = None  # _raw_fields
        self._declared_fields: Any = None
        self._fingerprint: str | None = None
        self._takes_rng = takes_rng(self.obj.__getitem__)
        self.deterministic = bool(getattr(cfg, "deterministic", True))
        self.last_sample_drew = False
        if build:  # the server: fail at start-up, not at the first batch
            _ = self.fields, self.fingerprint
            self._check_keyable()

    def __len__(self) -> int:
        return self._len

    def load_sample(self, index: int, min_size: tuple[int, int] | None = None, key: np.ndarray | None = None) -> dict:
        """``dataset[index]`` as a dict of fields (torch tensors and PIL images as numpy arrays),
        its randomness keyed to (``key``, index) (``_keyed.keyed_call``; ``key``: uint64 [2],
        ``sampler.sample_key(seed, epoch)``; None: seed 0, epoch 0); ``last_sample_drew`` says
        whether it drew. Raises IndexError out of range; SampleError if ``__getitem__`` raises
        (the reason carries its exception and traceback), returns something other than a dict
        with str keys, a field that cannot become an array, or fields other than the dataset's
        (``check_fields``), naming the field."""
        out = self._build(index, key)
        self.check_fields(index, out)
        return out

    def _build(self, index: int, key: np.ndarray | None) -> dict:
        """``load_sample`` but ``check_fields``."""
        index = self._check(index)
        try:
            sample, drawn = keyed_call(self.obj.__getitem__, index, key, self._takes_rng)
        except Exception as e:
            frames = traceback.extract_tb(e.__traceback__)[1:]  # the dataset's own, from its __getitem__ on
            frames = [f for f in frames if not f.filename.endswith("_keyed.py")]
            where = "".join(traceback.format_list(frames)).rstrip()
            raise self.sample_error(index, f"{type(e).__name__}: {e}\nin the dataset (most recent call last):\n{where}") \
                from None
        self.last_sample_drew = drawn.any
        if not isinstance(sample, Mapping):
            raise self.sample_error(index, f"__getitem__ returned a {type(sample).__name__}, not a dict of fields")
        out = {}
        for name, value in sample.items():
            if not isinstance(name, str):
                raise self.sample_error(index, f"__getitem__ returned a dict with key {name!r}; field names are str")
            try:
                out[name] = to_numpy(value)
            except TypeError as e:
                raise self.sample_error(index, f"field {name!r} {e}") from None
            try:
                as_value(name, out[name])
            except TypeError as e:
                raise self.sample_error(index, str(e)) from None
        return out

    def check_keyed(self, index: int, key: np.ndarray | None, first: dict) -> None:
        """Build sample ``index`` a second time under ``key`` (``first``: its first build, just
        made) and raise UnkeyableRandomnessError (a ValueError naming the dataset, what was found
        and where the randomness must go) if a generator reachable from the dataset moved
        between the two builds, the second read the operating system's entropy, or the two
        differ (``_unkeyable``); with ``deterministic: false``, a warning instead."""
        roots = (("self", self.obj), (self.cfg.factory, self._factory))
        before = reachable_generators(*roots)
        again: dict | SampleError
        with EntropyWatch() as watch:
            try:
                again = self._build(index, key)
            except SampleError as e:
                again = e
        found = [f"generator {path} moved between two builds of sample {index} under the same key"
                 for path in moved(before, reachable_generators(*roots))]
        found += [f"sample {index} drew from {what}" for what in watch.found]
        differ = again.reason if isinstance(again, SampleError) else _first_difference(first, again)
        if isinstance(again, SampleError):
            found.append(f"sample {index} was built once, and the second build under the same key raised: {differ}")
        elif differ is not None:
            found.append(f"field {differ!r} of sample {index} differs between two builds under the same seed, epoch "
                         "and index")
        if found:
            self._unkeyable(found)

    def _check_keyable(self) -> None:
        """The server's check at start-up: ``check_keyed`` on sample 0 and on up to
        ``KEYED_CHECKS - 1`` others drawn at random (by the operating system: the check
        must not depend on the seed), each built twice under the same key."""
        if not self._len:
            return
        key = sample_key(seed=0, epoch=0)
        others = range(1, self._len)
        indices = [0, *random.SystemRandom().sample(others, min(len(others), KEYED_CHECKS - 1))]
        for index in indices:
            try:
                first = self._build(index, key)
            except SampleError:  # a bad sample: on_error decides while serving; not this check's business
                continue
            self.check_keyed(index, key, first)

    def _unkeyable(self, found: list[str]) -> None:
        message = (
            f"dataset {self.name!r} (kind python, {self.cfg.factory}) draws randomness batchd cannot key to the "
            f"sample: {'; '.join(found)}. Its batches would differ from run to run, with the worker count and "
            "after a resume (and a cache would freeze one draw into every epoch). Draw in __getitem__ from "
            "Python's random, numpy.random or torch's default generator (batchd seeds them per sample from "
            "(seed, epoch, index)), or take the sample's own generator: def __getitem__(self, index, rng=None) "
            "(a numpy Generator); seed an albumentations Compose from it (compose.set_random_seed(int("
            "rng.integers(2**32)))) or make it the server's pipeline. Or set deterministic: false in the "
            "dataset's config (batches then differ run to run, and are never cached)")
        if self.deterministic:
            raise UnkeyableRandomnessError(message)
        log.warning("%s (deterministic: false: serving it anyway)", message)

    @property
    def classes(self) -> list[str]:
        return [str(c) for c in getattr(self.obj, "classes", None) or ()]

    @property
    def sample_spec(self) -> SampleSpec:
        image = next((f for f in self.fields if f.name == "image"), None)
        if image is None or len(image.shape) != 3:
            return SampleSpec((-1, -1, -1))
        return SampleSpec(image.shape, image.dtype)

    def label(self, index: int) -> int:
        sample = self.load_sample(index)
        if "label" not in sample:
            raise ValueError(f"dataset {self.name!r}: samples have no 'label' field ({sorted(sample)})")
        return int(sample["label"])

    @property
    def fingerprint(self) -> str:
        if self._fingerprint is None:
            parts: dict[str, Any] = {"factory": self.cfg.factory, "args": self.cfg.args, "len": self._len}
            own = getattr(self.obj, "fingerprint", None)
            if callable(own):
                parts["fingerprint"] = str(own())
            else:
                parts["source"] = _source_digest(self._factory)
            text = json.dumps(parts, sort_keys=True, default=str)
            self._fingerprint = hashlib.sha256(f"batchd-python/1\0{text}".encode()).hexdigest()[:32]
        return self._fingerprint

    def source(self, index: int) -> str:
        return f"#{index}"

    def weights(self) -> np.ndarray | None:
        """The object's ``weights`` (an attribute, or a method taking no argument): one number per
        sample, for weighted sampling; None without one."""
        return self._array("weights", np.float64)

    def labels(self) -> np.ndarray | None:
        """The object's ``labels`` (an attribute, or a method taking no argument) when it is one
        non-negative integer per sample; None otherwise (without one, or one of another meaning:
        ``labels`` is a common name, so it is not an error)."""
        try:
            labels = self._array("labels", np.float64)
        except ValueError:
            return None
        if labels is None or not np.isfinite(labels).all() or (labels != np.round(labels)).any() or (labels < 0).any():
            return None
        return labels.astype(np.int64)

    def _array(self, attribute: str, dtype) -> np.ndarray | None:
        """The object's ``attribute`` (called if callable) as a 1-D array of ``dtype`` with one entry
        per sample, or None if it has none. Raises ValueError naming the dataset otherwise."""
        value = getattr(self.obj, attribute, None)
        value = value() if callable(value) else value
        if value is None:
            return None
        try:
            array = np.asarray(to_numpy(value), dtype=dtype)
        except (TypeError, ValueError) as e:
            raise ValueError(f"dataset {self.name!r}: {attribute} must be numbers, one per sample: {e}") from None
        if array.shape != (self._len,):
            raise ValueError(f"dataset {self.name!r}: {attribute} must have one entry per sample ({self._len}), "
                             f"got shape {list(array.shape)}")
        return array


def _first_difference(a: dict, b: dict) -> str | None:
    """The first field (name order) whose value differs between two builds of a sample, or None."""
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())[0]
    for name in sorted(a):
        x, y = a[name], b[name]
        if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
            x, y = np.asarray(x), np.asarray(y)
            if x.dtype != y.dtype or x.shape != y.shape or x.tobytes() != y.tobytes():
                return name
        elif type(x) is not type(y) or (x != y and repr(x) != repr(y)):  # (NaN == NaN here)
            return name
    return None


def _source_digest(factory: Any) -> str:
    """SHA-256 of the file that defines ``factory`` ("" if it has none, e.g. a C extension)."""
    try:
        path = inspect.getsourcefile(factory) or inspect.getfile(factory)
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except (TypeError, OSError):
        return ""
