"""The folders are the architecture (issue 27): server/'s layers import downward.

The flow storage -> decode -> pipeline -> batch slot -> stream -> client shows in the layers,
bottom to top: ``server/shm/`` (shared-memory segments and batch slots), ``server/data/``
(storage, decoding, datasets, reads, the cache), ``server/config/`` (the validated config, which
knows data's storage options), ``server/compute/`` (pipelines, workers, the pool),
``server/serve/`` (computations and their reorder buffer, streams, transport, gRPC), and the
process that wires them (``server/loader.py``, ``server/app.py``). A layer never imports one
above it, so each can be read (and tested) without those above; and ``client/`` imports nothing
of ``server/`` (both import the generated wire code). Checked by parsing every module with
``ast``: imports inside functions and under ``TYPE_CHECKING`` count too.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# layer -> the batchd.server packages it must not import (those above it)
FORBIDDEN = {
    "shm": ("data", "config", "compute", "serve", "loader", "app"),
    "data": ("config", "compute", "serve", "loader", "app"),
    "config": ("compute", "serve", "loader", "app"),
    "compute": ("serve", "loader", "app"),
    "serve": ("app",),
}


def _package(path: pathlib.Path) -> str:
    """The dotted package of a module file (``server/data/cache/shared.py`` -> ``batchd.server.data.cache``)."""
    rel = path.relative_to(ROOT)
    top = {"server": ("batchd", "server"), "client": ("batchd", "client"), "batchd": ("batchd",)}[rel.parts[0]]
    return ".".join((*top, *rel.parts[1:-1]))


def imports(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, relative ones resolved; for
    ``from x import y``, both ``x`` and ``x.y`` (``y`` may be a module)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package(path).split(".")
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(p for p in (*parts, base) if p)
            found.append((node.lineno, base))
            found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return found


def _violations(folder: str, prefixes: tuple[str, ...]) -> list[str]:
    """Each import under ``folder`` of a module in one of the packages ``prefixes``, as "file:line imports name"."""
    bad = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        for line, name in imports(path):
            if any(name == p or name.startswith(p + ".") for p in prefixes):
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    return bad


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_server_layers_import_downward(layer):
    bad = _violations(f"server/{layer}", tuple(f"batchd.server.{name}" for name in FORBIDDEN[layer]))
    assert not bad, f"server/{layer}/ imports a layer above it:\n" + "\n".join(bad)


def test_client_imports_nothing_of_the_server():
    bad = _violations("client", ("batchd.server",))
    assert not bad, "client/ imports the server:\n" + "\n".join(bad)


def test_the_check_sees_imports():
    """The parser finds absolute, relative and deferred imports (else every check above would pass)."""
    found = {name for _, name in imports(ROOT / "server" / "data" / "cache" / "__init__.py")}
    assert "batchd.server.data.cache.entry" in found and "batchd.server.data.cache.shared.SharedCache" in found
    assert any(name.startswith("batchd.server.compute") for _, name in imports(ROOT / "server" / "loader.py"))
