"""The suite collects as CI runs it: ``pytest -q`` from the repository root, every folder at once.

A test module run alone, or one folder at a time, can pass while the whole collection fails: a
second ``conftest.py`` in a folder without ``__init__.py`` is imported as the module ``conftest``
and shadows ``tests/conftest.py``, which the other folders import by name (a CI run failed so,
after ``tests/containers/`` had one). Collected here in a fresh interpreter, the way ``make test``
does.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_whole_suite_collects_from_the_root():
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    tail = (done.stdout + done.stderr)[-4000:]
    assert done.returncode == 0, f"pytest --collect-only exited {done.returncode}:\n{tail}"
    assert "error" not in done.stdout.splitlines()[-1].lower(), tail


def test_one_conftest_module():
    found = sorted(p.relative_to(ROOT) for p in (ROOT / "tests").rglob("conftest.py"))
    assert found == [pathlib.Path("tests/conftest.py")], (
        f"conftest.py files {found}: only tests/conftest.py (put a folder's fixtures in a module it imports)")
