"""Every test the README names exists: a claim names the test that shows it ("A claim needs a
counter"), and a renamed or removed test must not leave a claim pointing at nothing."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _defined(path: pathlib.Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))


def test_every_test_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    everywhere = set().union(*(_defined(p) for p in (ROOT / "tests").rglob("test_*.py")))
    missing = []
    for m in re.finditer(r"`(tests/[\w/]+\.py)(?:::(\w+))?", readme):
        path = ROOT / m.group(1)
        if not path.exists():
            missing.append(m.group(1))
        elif m.group(2) and m.group(2) not in _defined(path):
            missing.append(f"{m.group(1)}::{m.group(2)}")
    # "`::name`" continues the file named before it: at least the test must exist somewhere
    missing += [f"::{name}" for name in re.findall(r"`::(\w+)", readme) if name not in everywhere]
    assert not missing, f"the README names tests that do not exist: {missing}"
    assert len(re.findall(r"`tests/[\w/]+\.py", readme)) > 50  # the pattern still finds the references
