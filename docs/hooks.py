"""MkDocs hooks of batchd's docs site (mkdocs.yml ``hooks:``).

The API pages are generated from the docstrings by mkdocstrings, which reads the source
statically (griffe) and so needs the package as it imports: ``batchd/`` with ``client/``,
``server/`` and ``v1/`` inside it. The repository keeps those at the top level (``client/``,
``server/``, ``proto/batchd/v1/``; pyproject.toml's package-dir maps them), so before each build
this hook lays out ``build/api-src/batchd/`` as symbolic links to the real files. It also
serves the charts of bench/results/ beside the pages (``on_files``).
"""

from __future__ import annotations

import pathlib
import shutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
API_SRC = ROOT / "build" / "api-src"
# import name under batchd -> folder in the repository (pyproject.toml [tool.setuptools] package-dir)
PACKAGES = {"client": ROOT / "client", "server": ROOT / "server", "v1": ROOT / "proto" / "batchd" / "v1"}


def lay_out_sources() -> pathlib.Path:
    """Make ``build/api-src/batchd`` mirror the installed package; returns ``build/api-src``."""
    package = API_SRC / "batchd"
    if package.exists():
        shutil.rmtree(package)
    package.mkdir(parents=True)
    for path in sorted((ROOT / "batchd").iterdir()):
        if path.suffix == ".py" or path.name == "py.typed":
            (package / path.name).symlink_to(path)
    for name, folder in PACKAGES.items():
        (package / name).symlink_to(folder, target_is_directory=True)
    return API_SRC


def on_startup(command: str, dirty: bool) -> None:  # noqa: ARG001 (the MkDocs hook signature)
    lay_out_sources()


def on_files(files, config):  # noqa: ANN001 (the MkDocs hook signature)
    """The charts bench/ draws (bench/results/*.png), served as bench/<name>.png beside the pages."""
    from mkdocs.structure.files import File

    for png in sorted((ROOT / "bench" / "results").glob("*.png")):
        files.append(File.generated(config, f"bench/{png.name}", abs_src_path=str(png)))
    return files
