"""Randomness batchd cannot key to the sample, found by construction between two builds of it.

``_keyed`` seeds the generators a ``__getitem__`` may draw from (Python's ``random``, numpy's
global generator, torch's default one, its ``rng`` argument) and restores them. Any other
source makes a sample differ from run to run, with the worker count and after a resume, and the
cache would freeze one draw of it into every epoch. ``python.PythonDataset.check_keyed`` builds a
sample a second time under the same key and, around and during that second build, looks for
every such source that can be seen, whatever the draws happened to give:

* ``reachable_generators``: every generator (numpy ``Generator``, ``BitGenerator``,
  ``RandomState``, ``SeedSequence``, ``random.Random``, ``torch.Generator``) reachable from the
  dataset object (its attributes, containers, bound methods, ``functools.partial``), from its
  class and the functions it holds (their closures, defaults and module globals), and from the
  modules those reach (but the standard library's and the big libraries' in ``SKIP_MODULES``),
  with a snapshot of its state. A generator whose state after the second build differs from
  its state after the first was drawn from (or reseeded) by the build, without a key: a
  generator made in ``__init__`` or at module level, or reached through a closure. One
  reseeded in ``__getitem__`` from the sample's own ``rng`` (``compose.set_random_seed(...)``)
  is in the same state after both builds, and passes.
* ``EntropyWatch``: during the second build, ``sys.setprofile`` on this thread sees every
  Python call and every call of a C function from Python: a read of the operating system's
  entropy (``os.urandom``, ``random.SystemRandom``, ``secrets``, numpy's ``SeedSequence()``
  without entropy, so ``np.random.default_rng()`` without a seed), a draw from a
  ``random.Random`` seeded from it (``random.Random()``, ``random.seed()``), and a torch
  generator seeded from it (``Generator.seed()``, ``torch.seed()``). albumentations'
  transforms seed generators of their own from the operating system when they are built, then
  draw from them: building one in ``__getitem__`` is noted at its first draw, not when it is
  built (and one reseeded before drawing passes).

What this cannot see (docs/targets.md, "What the check cannot find"): draws in other threads or
processes; generators in C extensions' own state (OpenCV's ``cv2.randn``), and numpy
generators' draws themselves (numpy's methods are invisible to the profiler: an unseeded numpy
generator is seen where it is made, a held one by its state); randomness from the clock,
``id()``, hash randomisation of ``str`` (``PYTHONHASHSEED``), dict or set order, or file and
network contents; generators past ``DEPTH`` levels, past the first ``MAX_ITEMS`` entries of a
container, inside ``SKIP_MODULES``' module globals, or in a module no reachable function lives
in.
"""

from __future__ import annotations

import functools
import os
import random
import sys
import types
from typing import Any

import numpy as np

DEPTH = 6  # levels of attributes / items followed from each root
MAX_ITEMS = 64  # entries of a container (list, tuple, dict, set) followed
MAX_MODULE_ITEMS = 4096  # globals of a module followed
MAX_OBJECTS = 100_000  # objects visited in one walk at most
# Top-level packages whose module globals are not walked: the standard library (its one global
# generator, random's, is keyed) and libraries whose global generators batchd keys (numpy,
# torch) or that hold none a sample draws from. Their objects a dataset holds are still walked.
SKIP_MODULES = frozenset(sys.stdlib_module_names) | {
    "numpy", "torch", "torchvision", "cv2", "albumentations", "albucore", "scipy", "PIL", "batchd", "pydantic",
    "pydantic_core", "grpc", "google", "pandas", "pyarrow", "typing_extensions", "_pytest", "pytest", "pluggy",
    "hypothesis",
}
_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), np.ndarray, np.generic, memoryview, range)


def generator_state(obj: Any) -> Any:
    """A comparable snapshot of a generator's state, or None if ``obj`` is not a generator."""
    if isinstance(obj, np.random.Generator):
        return repr(obj.bit_generator.state)
    if isinstance(obj, np.random.BitGenerator):
        return repr(obj.state)
    if isinstance(obj, np.random.RandomState):
        state = obj.get_state()
        return (state[0], state[1].tobytes(), *state[2:])
    if isinstance(obj, np.random.SeedSequence):  # spawn() moves it
        return ("SeedSequence", obj.n_children_spawned)
    if isinstance(obj, random.Random):
        try:
            return obj.getstate()
        except NotImplementedError:  # one that keeps its state elsewhere (pipeline._GeneratorRandom)
            return None
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Generator):
        return obj.get_state().numpy().tobytes()
    return None


def reachable_generators(*roots: tuple[str, Any]) -> dict[str, Any]:
    """path -> state snapshot of every generator reachable from ``roots`` ((name, object) pairs:
    the dataset object as ``"self"``, its factory), as the module docstring says: e.g.
    ``self.transform.py_random``, ``batchd_testdata.RNG``, ``self.augment (closure) rng``. A
    generator reached by two paths is listed under the first."""
    walk = _Walk()
    for name, obj in roots:
        walk.visit(obj, name, DEPTH)
    return walk.found


def moved(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The paths of ``after`` whose generator's state differs from ``before``'s (sorted)."""
    return sorted(path for path, state in after.items() if path in before and before[path] != state)


class _Walk:
    def __init__(self):
        self.found: dict[str, Any] = {}
        self.seen: set[int] = set()
        self.keep: list[Any] = []  # the visited objects stay alive, so no id is reused during the walk
        self.ids: set[int] = set()  # generators found (by id: listed once)

    def visit(self, obj: Any, path: str, depth: int) -> None:
        if depth < 0 or id(obj) in self.seen or len(self.seen) >= MAX_OBJECTS or isinstance(obj, _SCALARS):
            return
        self.seen.add(id(obj))
        self.keep.append(obj)
        state = generator_state(obj)
        if state is not None:
            if id(obj) not in self.ids:
                self.ids.add(id(obj))
                self.found[path] = state
            return
        for child, where in self._children(obj, path):
            self.visit(child, where, depth - 1)

    def _children(self, obj: Any, path: str):
        if isinstance(obj, types.ModuleType):
            yield from self._module(vars(obj), obj.__name__)
        elif isinstance(obj, dict):
            for k, v in list(obj.items())[:MAX_ITEMS]:
                yield v, f"{path}[{k!r}]"
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for i, v in enumerate(list(obj)[:MAX_ITEMS]):
                yield v, f"{path}[{i}]"
        elif isinstance(obj, types.FunctionType):
            code = obj.__code__
            for name, cell in zip(code.co_freevars, obj.__closure__ or ()):
                try:
                    yield cell.cell_contents, f"{path} (closure {name})"
                except ValueError:  # an empty cell
                    pass
            for i, v in enumerate(obj.__defaults__ or ()):
                yield v, f"{path} (default {i})"
            for k, v in (obj.__kwdefaults__ or {}).items():
                yield v, f"{path} (default {k})"
            module = obj.__globals__.get("__name__")
            if isinstance(module, str) and id(obj.__globals__) not in self.seen:
                self.seen.add(id(obj.__globals__))
                yield from self._module(obj.__globals__, module)
        elif isinstance(obj, types.MethodType):
            yield obj.__self__, path + ".__self__"
            yield obj.__func__, path
        elif isinstance(obj, functools.partial):
            yield obj.func, path + ".func"
            for i, v in enumerate(obj.args):
                yield v, f"{path}.args[{i}]"
            for k, v in obj.keywords.items():
                yield v, f"{path}.keywords[{k!r}]"
        elif isinstance(obj, (staticmethod, classmethod)):
            yield obj.__func__, path
        elif isinstance(obj, property):
            for f in (obj.fget, obj.fset, obj.fdel):
                if f is not None:
                    yield f, path
        elif isinstance(obj, type):
            if _skipped(obj.__module__):
                return
            for k, v in list(vars(obj).items()):
                if not (k.startswith("__") and k.endswith("__")) or k in ("__getitem__", "__init__", "__call__"):
                    yield v, f"{obj.__qualname__}.{k}"
        else:
            attrs = getattr(obj, "__dict__", None)
            if isinstance(attrs, dict):
                for k, v in list(attrs.items()):
                    yield v, f"{path}.{k}"
            for cls in type(obj).__mro__:
                for k in getattr(cls, "__slots__", ()) if isinstance(getattr(cls, "__slots__", ()), tuple) else ():
                    try:
                        yield object.__getattribute__(obj, k), f"{path}.{k}"
                    except AttributeError:
                        pass
            for cls in type(obj).__mro__[:-1]:  # its methods, so their closures and module globals
                yield cls, cls.__qualname__

    def _module(self, names: dict, module: str):
        """A module's globals (unless ``SKIP_MODULES`` has its package), as ``module.name``."""
        if _skipped(module):
            return
        for k, v in list(names.items())[:MAX_MODULE_ITEMS]:
            if not (k.startswith("__") and k.endswith("__")):
                yield v, f"{module}.{k}"


def _skipped(module: str | None) -> bool:
    return not module or module.partition(".")[0] in SKIP_MODULES


# --- the operating system's entropy, seen while a sample is built --------------------------------


def _codes(*functions: Any) -> frozenset:
    return frozenset(f.__code__ for f in functions if hasattr(f, "__code__"))


# SystemRandom's own methods (secrets and numpy's SeedSequence() read the OS through them)
_SYSTEM_RANDOM = _codes(*(v for k, v in vars(random.SystemRandom).items() if callable(v) and not k.startswith("__")))
_RANDOM_SEED = random.Random.seed.__code__
_DRAWS = ("random", "getrandbits")  # the C methods of random.Random that draw (all others are built on them)
_URANDOM = tuple(f for f in (getattr(os, "urandom", None), getattr(os, "getrandom", None)) if f is not None)


def _albumentations_seeding() -> frozenset:
    """The code of albumentations' ``set_random_seed`` methods: a transform being built seeds
    generators from the OS, which it then replaces (a seed) or draws from (noted there)."""
    try:
        from albumentations.core.composition import BaseCompose
        from albumentations.core.transforms_interface import BasicTransform
    except ImportError:
        return frozenset()
    return _codes(BasicTransform.set_random_seed, BaseCompose.set_random_seed)


class EntropyWatch:
    """``with EntropyWatch() as watch: build()``: ``watch.found`` lists where the build took
    randomness from the operating system (module docstring), each as "what (file:line)", the
    line being the dataset's own (the first frame, from the event up, outside ``SKIP_MODULES``). Only this thread is watched. A profiler set before (``sys.getprofile``)
    is put back on leaving; while the block runs it sees nothing."""

    def __init__(self):
        self.found: list[str] = []
        self._unseeded: dict[int, Any] = {}  # id -> random.Random seeded from the OS in this block
        self._quiet = _albumentations_seeding()
        torch = sys.modules.get("torch")
        self._torch_generator = torch.Generator if torch is not None else None

    def __enter__(self) -> "EntropyWatch":
        self._previous = sys.getprofile()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(self._previous)

    def _hook(self, frame, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            if code in _SYSTEM_RANDOM:
                if not self._within(frame, self._quiet):
                    self._note("the operating system's entropy (random.SystemRandom, secrets, or a numpy generator "
                               "made without a seed: np.random.default_rng())", frame)
            elif code is _RANDOM_SEED:
                instance, a = frame.f_locals.get("self"), frame.f_locals.get("a")
                if a is None:
                    self._unseeded[id(instance)] = instance
                else:
                    self._unseeded.pop(id(instance), None)
        elif event == "c_call":
            owner = getattr(arg, "__self__", None)
            if owner is not None and self._unseeded.get(id(owner)) is owner and getattr(arg, "__name__", "") in _DRAWS:
                self._note("a random.Random seeded from the operating system (random.Random() or random.seed() "
                           "without a seed)", frame)
            elif arg in _URANDOM and frame.f_code not in _SYSTEM_RANDOM and not self._within(frame, self._quiet):
                self._note("the operating system's entropy (os.urandom)", frame)
            elif (self._torch_generator is not None and isinstance(owner, self._torch_generator)
                  and getattr(arg, "__name__", "") == "seed"):
                self._note("a torch generator seeded from the operating system (Generator.seed(), torch.seed())", frame)

    @staticmethod
    def _within(frame, codes: frozenset) -> bool:
        while frame is not None:
            if frame.f_code in codes:
                return True
            frame = frame.f_back
        return False

    def _note(self, what: str, frame) -> None:
        where = frame
        while where is not None and _skipped(where.f_globals.get("__name__")):
            where = where.f_back
        at = f" ({where.f_code.co_filename}:{where.f_lineno})" if where is not None else ""
        text = what + at
        if text not in self.found:
            self.found.append(text)
