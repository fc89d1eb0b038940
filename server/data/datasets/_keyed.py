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
fork; the cache stores only samples whose ``__getitem__`` drew nothing (``Drawn.any``). A python
pipeline (a preset ``{python: module:fn}``) is called under the same seed-and-restore
(``keyed_run``), seeded from (seed, epoch, position) under another tag, so the torchvision
transforms inside one (they draw from torch's default generator) are keyed too. What cannot be
keyed (a generator the dataset made in ``__init__`` or at module level, one made in
``__getitem__`` from the operating system's entropy...) is found by ``_unkeyable``.
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
GETITEM, PIPELINE = b"batchd-getitem", b"batchd-pipeline"  # sample_seeds' domain tags: __getitem__, python presets


def takes_rng(getitem: Callable) -> bool:
    """True if ``__getitem__`` has a parameter named ``rng`` after the index."""
    try:
        params = list(inspect.signature(getitem).parameters.values())
    except (TypeError, ValueError):
        return False
    return any(p.name == "rng" for p in params[1:])


def sample_seeds(key: np.ndarray, index: int, tag: bytes = GETITEM) -> tuple[int, np.ndarray, int]:
    """(Python ``random`` seed, a 128-bit int; numpy's global seed, uint32 [4]; torch seed, 63
    bits) of sample ``index`` (a python pipeline: the sample's position) under ``key`` (uint64
    [2]): BLAKE2b (40 bytes, ``hashlib``) of the key, the number and a domain ``tag``
    (``GETITEM``, ``PIPELINE``), cut in three (16, 16 and 8 bytes). A keyed hash as a seed
    derivation: independent seeds for the three generators, unrelated to every pipeline stream
    (Philox under the same key); 0.3 us where a Philox stream costs 15 us to set up."""
    digest = hashlib.blake2b(np.asarray(key, "<u8").tobytes() + int(index).to_bytes(8, "little") + tag,
                             digest_size=40).digest()
    return (int.from_bytes(digest[:16], "little"), np.frombuffer(digest[16:32], "<u4").copy(),
            int.from_bytes(digest[32:40], "little") >> 1)


def sample_rng(key: np.ndarray, index: int) -> np.random.Generator:
    """The Generator handed to ``__getitem__(index, rng)``: Philox under ``key`` at counter
    ``[0, 0, index, DOMAIN]``, disjoint from the pipelines' ``[0, 0, position, 0]``."""
    state = sample_stream_state(key, index)
    state["state"]["counter"][3] = DOMAIN
    bit_generator = np.random.Philox(0)  # (a seed, so numpy reads no entropy from the OS; the state replaces it)
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


class _Seeded:
    """Python's ``random``, numpy's global generator and torch's default generator (torch only
    when the process has imported it) seeded from ``sample_seeds(key, number, tag)`` inside the
    ``with`` block, and restored to their states before it on leaving (also on a raise);
    ``drawn()`` says, inside the block, which of them were drawn from since."""

    def __init__(self, key: np.ndarray, number: int, tag: bytes):
        self.seeds = sample_seeds(key, number, tag)
        self.torch = sys.modules.get("torch")

    def __enter__(self) -> "_Seeded":
        py_seed, np_seed, torch_seed = self.seeds
        torch = self.torch
        self.saved = random.getstate(), _NUMPY.save(), torch.default_generator.get_state() if torch is not None else None
        random.seed(py_seed)
        np.random.seed(np_seed)
        self.python, self.numpy = None if _PYTHON_CHECKED else random.getstate(), _NUMPY.save()
        if torch is not None:
            torch.default_generator.manual_seed(torch_seed)
            self.torch_state = torch.default_generator.get_state()
        return self

    def drawn(self) -> tuple[bool, bool, bool]:
        """(python, numpy, torch): whether each was drawn from since the block began."""
        after, torch = random.getstate(), self.torch
        return (not _python_seeded(after) if self.python is None else after != self.python,
                not _NUMPY.same(self.numpy),
                torch is not None and not torch.equal(torch.default_generator.get_state(), self.torch_state))

    def __exit__(self, *exc) -> None:
        saved_python, saved_numpy, saved_torch = self.saved
        random.setstate(saved_python)
        _NUMPY.restore(saved_numpy)
        if saved_torch is not None:
            self.torch.default_generator.set_state(saved_torch)


def keyed_call(getitem: Callable, index: int, key: np.ndarray | None, with_rng: bool) -> tuple[Any, Drawn]:
    """``getitem(index)`` (or ``getitem(index, rng=...)``) with the global generators seeded
    for sample ``index`` under ``key`` (None: ``DEFAULT_KEY``) and restored afterwards (also when
    it raises, which it may). Returns (what it returned, which generators it drew from). If the
    call imported torch, it is run again, torch seeded this time. Cost: about 40 us a call
    (Python's ``getstate`` most of it)."""
    key = DEFAULT_KEY if key is None else key
    had_torch = "torch" in sys.modules
    with _Seeded(key, index, GETITEM) as seeded:
        rng = sample_rng(key, index) if with_rng else None
        rng_state = repr(rng.bit_generator.state) if rng is not None else None
        out = getitem(index, rng=rng) if with_rng else getitem(index)
        drawn = Drawn(*seeded.drawn(), rng=rng is not None and repr(rng.bit_generator.state) != rng_state)
    if not had_torch and "torch" in sys.modules:  # imported by this very call: its draws were not keyed
        return keyed_call(getitem, index, key, with_rng)
    return out, drawn


def keyed_run(fn: Callable[[], Any], key: np.ndarray, number: int, tag: bytes = PIPELINE) -> Any:
    """``fn()`` under the same seed-and-restore as ``keyed_call``, the global generators seeded
    from (``key``, ``number``, ``tag``): what a python pipeline (``tag`` ``PIPELINE``, ``number``
    the sample's position) is called under. ``fn`` starts whatever stream of its own it uses
    (it is called again, torch seeded, if the first call imported torch). Returns what it returns."""
    had_torch = "torch" in sys.modules
    with _Seeded(key, number, tag):
        out = fn()
    if not had_torch and "torch" in sys.modules:
        return keyed_run(fn, key, number, tag)
    return out
