"""Where the installed albumentations draws random numbers from, read from its source (ast).

Besides a transform's own ``random_generator`` and ``py_random`` (which the server re-keys per
sample, and seals in a cached prefix), albumentations can only draw from OpenCV's generator
(``cv2.setRNGSeed``/``randn``/``randu``...), a numpy or Python module-level generator
(``np.random.rand``, ``random.random``...) or a generator it creates (``np.random.default_rng``,
``random.Random``). These tests list every such call in the installed package (and albucore) and:

- fail when the list changes (an upgrade must be read again: KNOWN);
- check that the allowlisted transforms reaching one of them are exactly those
  server/compute/entropy.py widens (but for EXEMPT, checked by running);
- check that no type the cache may hold (server/compute/prefix.py ``CACHEABLE``) reaches any.

"Reaches" follows calls by name, transitively, from every method of the class and its
albumentations base classes: an over-approximation (two functions of one name count as one).
"""

from __future__ import annotations

import ast
import functools
import gc
import inspect
import pathlib
import sys

import albucore
import albumentations as A
import cv2
import numpy as np
import pytest

from batchd.server.compute import entropy, prefix
from batchd.server.compute import pipeline as pipelines
from batchd.server.compute.allowlist import ALLOWED, COMPOSITIONS

ROOT = pathlib.Path(A.__file__).parent
_CV2_RNG = {"setRNGSeed", "randn", "randu", "randShuffle", "theRNG", "RNG"}

# (file under albumentations/, function or Class.method): what it draws from
KNOWN = {
    ("augmentations/dropout/transforms.py", "BaseDropout.apply"): "numpy.default_rng(seed)",
    ("augmentations/dropout/transforms.py", "BaseDropout.apply_to_images"): "numpy.default_rng(seed)",
    ("augmentations/dropout/transforms.py", "BaseDropout.apply_to_volumes"): "numpy.default_rng(seed)",
    ("augmentations/dropout/transforms.py", "BaseDropout.apply_to_mask"): "numpy.default_rng(seed)",
    ("augmentations/dropout/transforms.py", "BaseDropout.apply_to_mask3d"): "numpy.default_rng(seed)",
    ("augmentations/dropout/transforms.py", "BaseDropout.apply_to_masks3d"): "numpy.default_rng(seed)",
    ("augmentations/pixel/functional.py", "generate_noise"): "opencv",
    ("augmentations/pixel/functional.py", "sample_gaussian"): "opencv",
    ("augmentations/pixel/transforms.py", "ISONoise.apply"): "numpy.default_rng(seed)",
    ("augmentations/pixel/transforms.py", "ShotNoise.apply"): "numpy.default_rng(seed)",
    # a transform's own generators, (re)made by set_random_seed: the server uses set_random_state
    ("core/composition.py", "BaseCompose.set_random_seed"): "numpy.default_rng(seed), random.Random",
    ("core/transforms_interface.py", "BasicTransform.set_random_seed"): "numpy.default_rng(seed), random.Random",
}
NOT_IN_A_SAMPLE_PATH = {"set_random_seed"}
# allowlisted transforms that reach a KNOWN call by name but draw nothing narrow, each checked by running
EXEMPT = {"RGBShift": "an AdditiveNoise with noise_type 'uniform': generate_noise seeds OpenCV's generator, "
                      "but the shift comes from the numpy generator (sample_uniform); "
                      "test_no_transform_left_draws_from_opencv runs it with OpenCV's draws made to raise"}


class _Scan(ast.NodeVisitor):
    def __init__(self, rel: str, out: "_Source"):
        self.rel, self.out, self.stack = rel, out, []

    def _scope(self, node):
        self.stack.append(node.name)
        self.generic_visit(node)
        self.stack.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scope

    def visit_Call(self, node: ast.Call):
        f = node.func
        where = ".".join(self.stack)
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        self.out.calls.setdefault((self.rel, where), set()).add(name)
        kind = None
        if isinstance(f, ast.Attribute):
            base = ast.unparse(f.value)
            if base == "cv2" and f.attr in _CV2_RNG:
                kind = "opencv"
            elif base in ("np.random", "numpy.random"):
                kind = f"numpy.{f.attr}({'seed' if node.args or node.keywords else ''})"
            elif base == "random":
                kind = f"random.{f.attr}"
        elif name in ("default_rng", "RandomState", "Random", "SystemRandom"):
            kind = f"imported {name}"
        if kind:
            found = self.out.draws.setdefault((self.rel, where), [])
            if kind not in found:
                found.append(kind)
        self.generic_visit(node)

    def visit_ImportFrom(self, node: ast.ImportFrom):
        if node.module in ("random", "numpy.random"):
            self.out.draws.setdefault((self.rel, "<import>"), []).append(f"from {node.module} import")


class _Source:
    def __init__(self):
        self.calls: dict[tuple[str, str], set[str]] = {}
        self.draws: dict[tuple[str, str], list[str]] = {}


@functools.cache
def source() -> _Source:
    out = _Source()
    for package, prefix_ in ((ROOT, ""), (pathlib.Path(albucore.__file__).parent, "albucore:")):
        for path in sorted(package.rglob("*.py")):
            _Scan(prefix_ + str(path.relative_to(package)), out).visit(_parse(path))
    return out


def _parse(path: pathlib.Path) -> ast.AST:
    """ast.parse, shielded from CPython < 3.11.8's shared AST recursion counter (gh-106905): a
    conversion in another thread meanwhile (a garbage collection running a finalizer, a thread
    switch) raises "SystemError: AST constructor recursion depth mismatch". No collection, no
    thread switch while parsing; and once more if it happens anyway."""
    text = path.read_text()
    interval, collecting = sys.getswitchinterval(), gc.isenabled()
    sys.setswitchinterval(60.0)
    gc.disable()
    try:
        for attempt in range(3):
            try:
                return ast.parse(text, str(path))
            except SystemError:
                if attempt == 2:
                    raise
    finally:
        sys.setswitchinterval(interval)
        if collecting:
            gc.enable()
    raise AssertionError("unreachable")


def _methods(cls: type) -> set[tuple[str, str]]:
    """(file, "Class.method") of every method of cls and its albumentations base classes."""
    keys = set()
    for base in cls.__mro__:
        if not base.__module__.startswith("albumentations"):
            continue
        rel = str(pathlib.Path(inspect.getsourcefile(base)).relative_to(ROOT))
        keys |= {k for k in source().calls if k[0] == rel and k[1].startswith(base.__qualname__ + ".")}
    return keys


def reaches(cls: type) -> set[tuple[str, str]]:
    """The KNOWN draws a transform of type cls can reach in a sample's path."""
    s = source()
    methods = {k for k in _methods(cls) if k[1].rsplit(".", 1)[-1] not in NOT_IN_A_SAMPLE_PATH}
    names = set().union(*(s.calls.get(k, set()) for k in methods)) - NOT_IN_A_SAMPLE_PATH
    functions: dict[str, set[tuple[str, str]]] = {}
    for key in s.calls:
        functions.setdefault(key[1].rsplit(".", 1)[-1], set()).add(key)
    seen: set[tuple[str, str]] = set(methods)
    todo = list(names)
    while todo:
        for key in functions.get(todo.pop(), ()):
            if key not in seen and "." not in key[1]:  # module-level functions; methods are reached via their class
                seen.add(key)
                todo.extend(s.calls.get(key, ()))
    return {k for k in seen if k in s.draws}


def test_the_installed_albumentations_draws_only_where_known():
    found = {k: ", ".join(v) for k, v in source().draws.items()}
    assert found == KNOWN, "albumentations' sources of randomness changed: read them again and update " \
                           "server/compute/entropy.py, prefix.py and KNOWN"


def test_every_allowlisted_transform_that_narrows_its_randomness_is_widened():
    narrow = {name for name in ALLOWED - COMPOSITIONS if reaches(getattr(A, name))}
    assert narrow - set(EXEMPT) == {t.__name__ for t in entropy.WIDENED}
    assert reaches(A.GaussNoise) == {("augmentations/pixel/functional.py", "generate_noise"),
                                     ("augmentations/pixel/functional.py", "sample_gaussian")}


@pytest.mark.parametrize("transform", [
    A.GaussNoise(p=1), A.GaussNoise(per_channel=False, p=1), A.GaussNoise(noise_scale_factor=0.3, p=1),
    A.GaussNoise(mean_range=(-0.2, 0.2), p=1), A.RGBShift(p=1), A.RGBShift(20, 20, 20, p=1),
], ids=repr)
def test_no_transform_left_draws_from_opencv(monkeypatch, transform):
    """The widened GaussNoise and the exempt RGBShift, run as the server builds them, with
    OpenCV's draws (and, for GaussNoise, its seeding) replaced by a function that raises."""
    compose = pipelines.build(pipelines.canonical_json(A.to_dict(A.Compose([transform]))))
    random = pipelines.SampleRandom()
    random.attach(compose)

    def drawn(*args, **kwargs):
        raise AssertionError("drew from OpenCV's generator")

    for name in ("randn", "randu", "randShuffle") + (("setRNGSeed",) if isinstance(transform, A.GaussNoise) else ()):
        monkeypatch.setattr(cv2, name, drawn)
    image = np.random.default_rng(0).integers(0, 256, (24, 20, 3), np.uint8)
    outputs = set()
    for position in range(50):
        random.start(np.array([1, 2], np.uint64), position)
        outputs.add(compose(image=image)["image"].tobytes())
    assert len(outputs) > 40


def test_no_cacheable_transform_reads_a_module_level_generator():
    for cls in prefix.CACHEABLE:
        assert not reaches(cls), f"{cls.__name__} reaches {reaches(cls)}"
