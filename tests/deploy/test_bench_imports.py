"""Every module of bench/ imports: a server module that moved breaks the benchmark that used it
here, in CI, rather than on the next `make bench`. Modules that need an optional dependency
(tensorflow for the tf.data peer, CUDA for bench/cuda/) skip on that dependency alone.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import pathlib
import pkgutil

import pytest

import bench

pytestmark = pytest.mark.timeout(120)

ROOT = pathlib.Path(__file__).resolve().parents[2]

OPTIONAL = {"bench.peers.tf_peer": "tensorflow"}


def _modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(bench.__path__, prefix="bench."))


def test_the_layout_is_packages():
    """Tables, peers, fixtures, cuda and probes are subpackages; nothing is a loose script."""
    names = set(_modules())
    for package in ("bench.tables", "bench.peers", "bench.fixtures", "bench.cuda", "bench.probes"):
        assert package in names, f"{package} is not a package (an __init__.py missing?)"


@pytest.mark.parametrize("name", _modules())
def test_bench_module_imports(name):
    if name.startswith("bench.cuda."):
        pytest.importorskip("torch")
    if name in OPTIONAL:
        pytest.importorskip(OPTIONAL[name])
    importlib.import_module(name)


OURS = ("batchd", "bench", "tests")


def _our_imports(path: pathlib.Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) of every import of batchd, bench or tests in a file, those
    inside functions too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] in OURS:
            found += [(node.lineno, node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.split(".")[0] in OURS]
    return found


@pytest.mark.parametrize("folder", ["bench", "examples"])
def test_every_import_resolves(folder):
    """A function-level import (a table imports the server's pieces where it uses them) is checked
    too: its module must import and hold the name."""
    stale = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, module, name in _our_imports(path):
            where = f"{path.relative_to(ROOT)}:{line}"
            if module in OPTIONAL:
                continue  # needs its optional dependency: test_bench_module_imports, where installed
            try:
                mod = importlib.import_module(module)
            except ImportError as e:
                stale.append(f"{where}: {module} ({e})")
                continue
            if name is not None and not hasattr(mod, name) and importlib.util.find_spec(f"{module}.{name}") is None:
                stale.append(f"{where}: {module} has no {name}")
    assert not stale, "stale imports:\n" + "\n".join(stale)
