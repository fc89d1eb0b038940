"""The server side imports neither torch nor tqdm (issue 10.8): they are the client extra's.

albumentations imports torch whenever torch is installed (``albumentations.pytorch``); batchd.server
holds that part back, so the server, its forkserver and its workers never load torch (about 3 s and
a few hundred MB per process). Checked in fresh interpreters, where torch is installed (the test
environment has the client extra), and on a running ``batchd serve`` through /proc/PID/maps.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest
import yaml
from helpers import write_png

from batchd.server_process import ServerProcess

pytestmark = pytest.mark.timeout(120)

CLIENT_ONLY = ("torch", "tqdm")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90)


def _modules_after(statement: str) -> set[str]:
    run = _run(f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))")
    assert run.returncode == 0, run.stderr
    return set(json.loads(run.stdout.splitlines()[-1]))


def test_torch_is_installed_here():
    """Otherwise the checks below would pass for the wrong reason."""
    assert _run("import torch, tqdm").returncode == 0


@pytest.mark.parametrize("statement", [
    "import batchd.server.app",
    "import batchd.server.compute.worker",
    "import batchd.server.compute.pipeline",
    "from batchd import cli; import batchd.server.app, batchd.server.config",  # what `batchd serve` imports
])
def test_server_modules_do_not_import_torch(statement):
    modules = _modules_after(statement)
    assert "albumentations" in modules  # imported, only without its torch part
    assert not [m for m in modules if m.split(".")[0] in CLIENT_ONLY], statement


def test_albumentations_pytorch_still_imports_on_request():
    modules = _modules_after("import batchd.server.app\nfrom albumentations.pytorch import ToTensorV2")
    assert "torch" in modules


def test_client_without_torch_names_the_extra():
    run = _run("import sys\nsys.modules['torch'] = None\nimport batchd\nbatchd.RemoteDataLoader")
    assert run.returncode != 0 and "pip install 'batchd[client]'" in run.stderr, run.stderr


def _tree(pid: int) -> list[int]:
    """``pid`` and all its descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = pathlib.Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        todo += children.get(p, [])
    return found


def test_a_running_server_and_its_workers_never_load_torch(tmp_path):
    """Also once they built pipelines: albumentations' ``from_dict`` imports ``albumentations.pytorch``
    (torch) on each call where torch is installed; the first batch of each worker took 3-5 s more."""
    import albumentations as A

    import batchd

    for i in range(2):
        write_png(tmp_path / "photos" / "cat" / f"{i}.png", np.zeros((8, 8, 3), np.uint8))
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({
        "address": "127.0.0.1:0", "workers": 2, "cache_dir": str(tmp_path / "cache"),
        "datasets": {"photos": {"kind": "imagefolder", "root": str(tmp_path / "photos")}},
        "pipelines": {"flip": A.to_dict(A.Compose([A.HorizontalFlip(p=0.5)]))},
    }))
    serve = [sys.executable, "-c", "import sys; from batchd.cli import main; sys.exit(main())", "serve", "--config",
             str(config)]
    with ServerProcess(serve, timeout=90) as server:  # listening once every worker is ready
        # a pipeline built by the server and by each worker (albumentations' from_dict imports its
        # torch part whenever torch is installed): a client-sent one with boxes' params, and a preset
        flip = A.Compose([A.HorizontalFlip(p=0.5)], bbox_params=A.BboxParams(format="pascal_voc"))
        for transform in (flip, "flip"):
            with batchd.RemoteDataLoader(server.address, "photos", batch_size=1, transform=transform) as loader:
                assert len(list(loader)) == 2
        pids = _tree(server.pid)
        assert len(pids) >= 4, pids  # the server, the forkserver, 2 workers
        maps = {pid: pathlib.Path(f"/proc/{pid}/maps").read_text() for pid in pids}
        assert all("libpython" in m or "python" in m for m in maps.values())
        loaded = {pid: sorted({line.split()[-1] for line in m.splitlines() if "/torch/" in line})[:3]
                  for pid, m in maps.items()}
        assert not any(loaded.values()), loaded
        assert any("/cv2/" in m for m in maps.values())  # the workers did load their own libraries
