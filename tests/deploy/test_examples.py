"""The training examples run end to end as a user runs them (``--quick``): each generates its
Fashion-COCO data, starts its own ``batchd serve``, trains through ``RemoteDataLoader`` and prints
its metric (examples/train_segmentation.py: mIoU; examples/train_detection.py: COCOeval's mAP)."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(180)


def run_example(name: str, data: pathlib.Path, fmnist: pathlib.Path) -> str:
    run = subprocess.run([sys.executable, str(REPO / "examples" / name), "--quick", "--data", str(data),
                          "--fmnist", str(fmnist)], capture_output=True, text=True, timeout=170)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "listening on" in run.stderr, run.stderr[-2000:]  # it started its own server
    return run.stdout


def test_train_segmentation_quick(tmp_path, fmnist_root):
    out = run_example("train_segmentation.py", tmp_path / "fc", fmnist_root)
    assert (tmp_path / "fc-quick" / "masks" / "val").is_dir()
    assert re.search(r"epoch 1: 64 images in [\d.]+ s", out), out
    per_class = re.findall(r" (\d\.\d+|nan)(?:,|$)", re.search(r"val IoU per class: (.*)", out).group(1))
    assert len(per_class) == 11 and all(0 <= float(v) <= 1 for v in per_class if v != "nan"), per_class
    assert 0 <= float(re.search(r"val mIoU: ([\d.]+)", out).group(1)) <= 1


def test_train_detection_quick(tmp_path, fmnist_root):
    out = run_example("train_detection.py", tmp_path / "fc", fmnist_root)
    assert re.search(r"epoch 1: 64 images in [\d.]+ s", out), out
    assert "Average Precision  (AP) @[ IoU=0.50:0.95 | area=   all | maxDets=100 ]" in out  # COCOeval's summary
    ap, ap50 = map(float, re.search(r"val mAP@\[\.5:\.95\]: ([\d.]+)  mAP@\.5: ([\d.]+)", out).groups())
    assert 0 <= ap <= ap50 <= 1
