"""A non-editable install (the Dockerfile's ``pip install .``) ships every package of the tree.

pyproject.toml maps the source folders onto ``batchd.*`` (``package-dir``) and lists the packages
by hand; a package left out of the list is missing from the wheel, which an editable install (the
tests') never shows. Checked against the tree, and by importing every module from a built wheel.
"""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys
import tomllib
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_of_the_tree_is_listed():
    config = _setuptools()
    tree = set()
    for name, folder in config["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder)
            tree.add(".".join((name, *rel.parts)))
    assert set(config["packages"]) == tree


@pytest.mark.slow
def test_the_wheel_holds_every_module(tmp_path):
    had_build = (ROOT / "build").exists()
    try:
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", str(ROOT),
                        "-w", str(tmp_path)], check=True, timeout=300, capture_output=True)
    finally:
        if not had_build:  # setuptools builds in the source tree: leave no stale copy of the code there
            shutil.rmtree(ROOT / "build", ignore_errors=True)
    (wheel,) = tmp_path.glob("batchd-*.whl")
    shipped = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    config = _setuptools()
    wanted = set()
    for name, folder in config["package-dir"].items():
        for path in (ROOT / folder).rglob("*.py"):
            rel = path.relative_to(ROOT / folder)
            if (path.parent / "__init__.py").exists() and "__pycache__" not in rel.parts:
                wanted.add("/".join((*name.split("."), *rel.parts)))
    assert wanted - shipped == set()
    assert "batchd/py.typed" in zipfile.ZipFile(wheel).namelist(), "the PEP 561 marker: type checkers read batchd's hints"
