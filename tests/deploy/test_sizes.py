"""Files and functions a reader can hold in their head (issue 27): no non-test ``.py`` file over
``MAX_FILE_LINES`` lines, no function over ``MAX_FUNCTION_LINES`` (its ``def`` line through its
last line, decorators and docstring included). Generated code (``*_pb2*.py``), tests and the
virtual environment are left out. A file or function that grows past the limit is split by idea
(one idea per file), not cut in half.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 80

# The folders checked, under the repository root. The lead widens this to the whole tree (["."])
# once the client/, batchd/, bench/ and examples/ half of issue 27 has merged (branch i27-client).
PATHS = ["."]
SKIPPED = {"tests", ".venv", "venv", "build", "site", ".git", "node_modules"}


def sources() -> list[pathlib.Path]:
    """Every .py file under ``PATHS`` that is neither a test, nor generated, nor an environment's."""
    found = set()
    for top in PATHS:
        for path in (ROOT / top).rglob("*.py"):
            rel = path.relative_to(ROOT)
            if SKIPPED.intersection(rel.parts) or "_pb2" in path.name or any(p.startswith(".") for p in rel.parts):
                continue
            found.add(path)
    return sorted(found)


def test_no_file_is_too_long():
    long = []
    for path in sources():
        n = len(path.read_text().splitlines())
        if n > MAX_FILE_LINES:
            long.append(f"{path.relative_to(ROOT)}: {n} lines")
    assert not long, f"over {MAX_FILE_LINES} lines (split by idea):\n" + "\n".join(long)


def test_no_function_is_too_long():
    long = []
    for path in sources():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - first + 1
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}: {n} lines")
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split by idea):\n" + "\n".join(long)


def test_the_checks_see_the_tree():
    files = sources()
    assert ROOT / "server" / "app.py" in files
    assert not [p for p in files if "_pb2" in p.name or "tests" in p.relative_to(ROOT).parts]
