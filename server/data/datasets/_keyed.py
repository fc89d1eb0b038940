"""Randomness inside a python dataset's ``__getitem__``, keyed to the sample.

A map-style dataset may augment in ``__getitem__`` with the global generators (torchvision's
detection tutorial flips with ``random.random()``; others use ``numpy.random`` or ``torch.rand``).
PyTorch's DataLoader seeds ``random`` and torch once per worker process, so such draws depend on
which worker built the sample and what it built before. batchd keys them to the sample instead:
around each ``__getitem__(index)``, ``keyed_call``

1. saves the states of Python's ``random``, numpy's global ``RandomState`` and torch's
   ``default_generator`` (torch only when the process has imported it: batchd never imports it);
2. seeds each of them from (seed, epoch, index) (``sample_seeds``: BLAKE2b of the epoch's key
   ``batchd.sampler.sample_key(seed, epoch)`` and the index), independently of the pipeline's
   stream for the sample (Philox under that key at the sample's position);
3. calls ``__getitem__``, handing it ``rng`` too if it takes one (``def __getitem__(self, index,
   rng=None)``: a numpy Generator over its own Philox stream ``[0, 0, index, DOMAIN]``, disjoint
   from the pipelines' ``[0, 0, position, 0]``; grain hands a random map an ``rng`` the same way);
4. notes whether any of those generators was drawn from (their states compared), and restores
   the saved states.

So a sample's bytes are a function of (seed, epoch, index) whatever the worker, its history or the
fork; the cache stores only samples whose ``__getitem__`` drew nothing (``Drawn.any``). What
cannot be keyed (a generator the dataset made in ``__init__``, an albumentations Compose with its
own generators) is caught at start by ``python.PythonDataset`` (``held_generators`` and two
builds of sample 0).
"""

from __future__ import annotations

import ctypes
import hashlib
import inspect
import random
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from batchd.sampler import sample_key, sample_stream_state

DOMAIN = 1  # counter word 3 of the rng handed to __getitem__ (pipelines use 0, position)
DEFAULT_KEY = sample_key(seed=0, epoch=0)  # outside a stream (the server reading sample 0's fields)


def takes_rng(getitem: Callable) -> bool:
    """True if ``__getitem__`` has a parameter named ``rng`` after the index."""
    try:
        params = list(inspect.signature(getitem).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.name == "rng" for p in params[1:])


def sample_seeds(key: np.ndarray, index: int) -> tuple[int, np.ndarray, int]:
    """(Python ``random`` seed, a 128-bit int; numpy's global seed, uint32 [4]; torch seed, 63
    bits) of sample ``index`` under ``key`` (uint64 [2]): BLAKE2b (40 bytes, ``hashlib``) of the
    key, the index and a domain tag, cut in three (16, 16 and 8 bytes). A keyed hash as a seed
    derivation: independent seeds for the three generators, unrelated to every pipeline stream
    (Philox under the same key); 0.3 us where a Philox stream costs 15 us to set up."""
    digest = hashlib.blake2b(np.asarray(key, "<u8").tobytes() + int(index).to_bytes(8, "little") + b"batchd-getitem",
                             digest_size=40).digest()
    return (int.from_bytes(digest[:16], "little"), np.frombuffer(digest[16:32], "<u4").copy(),
            int.from_bytes(digest[32:40], "little") >> 1)


def sample_rng(key: np.ndarray, index: int) -> np.random.Generator:
    """The Generator handed to ``__getitem__(index, rng)``: Philox under ``key`` at counter
    ``[0, 0, index, DOMAIN]``, disjoint from the pipelines' ``[0, 0, position, 0]``."""
    state = sample_stream_state(key, index)
    state["state"]["counter"][3] = DOMAIN
    bit_generator = np.random.Philox(key=np.asarray(key, np.uint64))
    bit_generator.state = state
    return np.random.Generator(bit_generator)


class _NumpyGlobal:
    """numpy's global generator (``np.random.mtrand._rand``, an MT19937): its state saved,
    compared and restored as the 625 words of the bit generator's C struct (``s_mt19937_state``
    in numpy's ``random/src/mt19937/mt19937.h``: ``uint32_t key[624]; int pos``) through
    ``BitGenerator.ctypes.state_address``, 1 us where ``get_state``/``set_state`` cost 40-50 us
    each (measured on a development machine); the layout is checked against
    ``bit_generator.state`` once, else those are used. Seeding (``np.random.seed``) clears the legacy
    generator's cached normal deviate, and ``restore`` clears the one a sample left; a deviate the
    caller had cached before is not brought back (a worker has none: nothing else draws there)."""

    def __init__(self):
        self.bit_generator = np.random.mtrand._rand._bit_generator
        self.words = None
        try:
            words = np.ctypeslib.as_array((ctypes.c_uint32 * 625).from_address(self.bit_generator.ctypes.state_address))
            state = self.bit_generator.state["state"]
            if np.array_equal(words[:624], state["key"]) and int(words[624]) == int(state["pos"]):
                self.words = words
        except (AttributeError, TypeError, ValueError, KeyError):
            pass

    def save(self):
        return self.words.copy() if self.words is not None else np.random.get_state()

    def restore(self, saved) -> None:
        if self.words is not None:
            np.random.seed(0)  # drops a normal deviate the sample's draws left cached (the legacy Box-Muller pair)
            self.words[:] = saved
        else:
            np.random.set_state(saved)

    def same(self, saved) -> bool:
        if self.words is not None:
            return np.array_equal(self.words, saved)
        now = np.random.get_state()
        return now[2:] == saved[2:] and np.array_equal(now[1], saved[1])


_NUMPY = _NumpyGlobal()


def _python_seeded(state: tuple) -> bool:
    """Whether Python's Mersenne Twister ``state`` (``getstate()``) is as ``seed`` leaves it:
    ``init_by_array`` ends with ``mt[0] = 0x80000000`` (Matsumoto and Nishimura's mt19937ar.c,
    which CPython's ``_randommodule.c`` follows), the index is 624 (nothing drawn) and no normal
    deviate is cached. Any draw moves the index, and 624 of them regenerate ``mt[0]``. Checked on
    a generator once (``_PYTHON_CHECKED``), else states are compared whole."""
    return state[1][0] == 0x80000000 and state[1][-1] == 624 and state[2] is None


_PYTHON_CHECKED = _python_seeded(random.Random(0x5EED).getstate()) and not _python_seeded(
    (lambda r: (r.random(), r.getstate())[1])(random.Random(0x5EED)))


@dataclass(slots=True)
class Drawn:
    """Which keyed generators one ``__getitem__`` drew from."""

    python: bool = False
    numpy: bool = False
    torch: bool = False
    rng: bool = False

    @property
    def any(self) -> bool:
        return self.python or self.numpy or self.torch or self.rng


def keyed_call(getitem: Callable, index: int, key: np.ndarray | None, with_rng: bool) -> tuple[Any, Drawn]:
    """``getitem(index)`` (or ``getitem(index, rng=...)``) with the global generators seeded
    for sample ``index`` under ``key`` (None: ``DEFAULT_KEY``) and restored afterwards (also when
    it raises, which it may). Returns (what it returned, which generators it drew from). If the
    call imported torch, it is run again, torch seeded this time. Cost: about 40 us a call
    (Python's ``getstate`` most of it)."""
    key = DEFAULT_KEY if key is None else key
    py_seed, np_seed, torch_seed = sample_seeds(key, index)
    torch = sys.modules.get("torch")
    saved_python, saved_numpy = random.getstate(), _NUMPY.save()
    saved_torch = torch.default_generator.get_state() if torch is not None else None
    try:
        random.seed(py_seed)
        np.random.seed(np_seed)
        python, numpy = None if _PYTHON_CHECKED else random.getstate(), _NUMPY.save()
        if torch is not None:
            torch.default_generator.manual_seed(torch_seed)
            torch_state = torch.default_generator.get_state()
        rng = sample_rng(key, index) if with_rng else None
        rng_state = repr(rng.bit_generator.state) if rng is not None else None
        out = getitem(index, rng=rng) if with_rng else getitem(index)
        after = random.getstate()
        drawn = Drawn(python=not _python_seeded(after) if python is None else after != python,
                      numpy=not _NUMPY.same(numpy),
                      torch=torch is not None and not torch.equal(torch.default_generator.get_state(), torch_state),
                      rng=rng is not None and repr(rng.bit_generator.state) != rng_state)
    finally:
        random.setstate(saved_python)
        _NUMPY.restore(saved_numpy)
        if saved_torch is not None:
            torch.default_generator.set_state(saved_torch)
    if torch is None and "torch" in sys.modules:  # imported by this very call: its draws were not keyed
        return keyed_call(getitem, index, key, with_rng)
    return out, drawn


# --- randomness the dataset holds itself (it cannot be keyed) ---------------------------------


def _generator_state(obj: Any) -> Any:
    """A comparable snapshot of a generator's state, or None if ``obj`` is not a generator."""
    if isinstance(obj, np.random.Generator):
        return repr(obj.bit_generator.state)
    if isinstance(obj, np.random.RandomState):
        state = obj.get_state()
        return (state[0], state[1].tobytes(), *state[2:])
    if isinstance(obj, random.Random):
        try:
            return obj.getstate()
        except NotImplementedError:  # one that keeps its state elsewhere (pipeline._GeneratorRandom)
            return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Generator):
        return obj.get_state().numpy().tobytes()
    return None


def held_generators(obj: Any, where: str = "self", depth: int = 4, seen: set | None = None) -> dict[str, Any]:
    """Generators reachable from ``obj``'s attributes (and the lists, tuples and dicts in them),
    ``depth`` levels down: path (``self.transform.random_generator``) -> state snapshot. Numpy
    Generators and RandomStates, ``random.Random`` and torch Generators are what albumentations,
    numpy and torch draw from; a dataset that holds one draws from a stream batchd cannot key."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return {}
    seen.add(id(obj))
    state = _generator_state(obj)
    if state is not None:
        return {where: state}
    found: dict[str, Any] = {}
    if isinstance(obj, dict):
        items = [(f"{where}[{k!r}]", v) for k, v in list(obj.items())[:64]]
    elif isinstance(obj, (list, tuple)):
        items = [(f"{where}[{i}]", v) for i, v in enumerate(obj[:64])]
    elif isinstance(obj, (str, bytes, int, float, bool, np.ndarray)) or obj is None:
        return {}
    else:
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return {}
        items = [(f"{where}.{k}", v) for k, v in attrs.items()]
    for path, value in items:
        found.update(held_generators(value, path, depth - 1, seen))
    return found
