"""Every test docs/targets.md names exists (each claim there names the test that shows it)."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _defined(path: pathlib.Path) -> set[str]:
    return set(re.findall(r"^\s*(?:async\s+)?def (test_\w+)", path.read_text(), re.M))


def test_every_test_docs_targets_names_exists():
    text = (ROOT / "docs" / "targets.md").read_text()
    missing, last = [], None
    for m in re.finditer(r"`(tests/[\w/]+\.py)?(?:::(\w+))?`", text):
        if m.group(1):
            last = ROOT / m.group(1)
            if not last.exists():
                missing.append(m.group(1))
                continue
        if m.group(2) and (last is None or m.group(2) not in _defined(last)):
            missing.append(f"{last}::{m.group(2)}")
    assert not missing, f"docs/targets.md names tests that do not exist: {missing}"
    assert len(re.findall(r"`tests/[\w/]+\.py", text)) > 15  # the pattern still finds the references
