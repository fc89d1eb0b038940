"""The docs site builds with --strict: a broken link, anchor, nav entry or API reference fails CI
(issue 27). The same command as `make docs`, into a temporary folder."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(180)

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_docs_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed (pip install -e '.[docs]')")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=170)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    assert (tmp_path / "site" / "index.html").exists()
    site = tmp_path / "site"
    api = (site / "api" / "index.html").read_text()
    assert "connect_timeout" in api  # the API page was generated from the docstrings
    assert 'id="batchd.RemoteDataLoader"' in api and 'id="batchd.errors"' in api
    # the figures are included from bench/results, not retyped, and the charts travel with the pages
    benchmarks = (site / "benchmarks" / "index.html").read_text()
    assert "Table 1: workers x pipeline (batch 64)" in benchmarks and "--8&lt;--" not in benchmarks
    assert (site / "bench" / "throughput.png").stat().st_size > 10_000
    assert (site / "bench" / "latency.png").stat().st_size > 10_000
