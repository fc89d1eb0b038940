"""batchd's benchmark suite: ``python -m bench.run_all [--quick] [--only table1,table3,...]``.

Run everything as modules from the repository root (``python -m bench.tables.table_batch``).
The layout follows the flow of a measurement:

- ``tables/``: one ``table_*.py`` per numbered table, each with ``run(settings) -> dict``,
  ``render(result) -> str`` and ``targets(result) -> list`` (``run_all`` keeps the registry);
- ``peers/``: the loaders batchd is compared against (``sequential``, ``torch_loader``,
  ``torch_coco``, ``tf_peer``);
- ``fixtures/``: what a table measures over: the photo set and manifests (``data``,
  ``make_photos``), the pipelines L1-L4, a ``batchd serve`` subprocess (``server_proc``),
  slow storage (``fusefs``), a ready-made dataset (``synthetic``), the training loop (``trainer``);
- ``cuda/``: the benchmarks that need a GPU;
- ``probes/``: measurements outside the numbered tables (``control_path``,
  ``dataplane_pieces``, ``in_band``, ``soak``);
- at the top: what every table shares: ``common``, ``measure`` (timing, /proc accounting),
  ``noise``, ``machine``, ``report`` (results.json -> results.md), ``chart``, ``fragments``
  (results.json -> the pieces the docs include), ``settings``.
"""

from __future__ import annotations

import os
import pathlib
import sys

os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # no network check on import, in any table

ROOT = pathlib.Path(__file__).resolve().parent.parent
"""The repository root: where ``python -m bench...`` runs from."""


def module_argv(module: str, *args: str) -> list[str]:
    """The command line that runs ``module`` (e.g. ``"bench.fixtures.fusefs"``) in a new Python."""
    return [sys.executable, "-m", module, *args]


def module_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository root on PYTHONPATH, so that a
    subprocess started by ``module_argv`` imports ``bench`` wherever its cwd is."""
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    return env
