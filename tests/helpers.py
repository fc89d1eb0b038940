"""Small helpers the test modules share (imported as ``from helpers import ...``)."""

from __future__ import annotations

import hashlib
import pathlib
import socket
import time

import cv2
import numpy as np


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float = 10.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds pass; its last value as a bool."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def write_png(path: pathlib.Path, rgb: np.ndarray) -> None:
    """Write an RGB uint8 [H, W, 3] image as PNG (folders created)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    assert cv2.imwrite(str(path), cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))


def digest(batch) -> str:
    """SHA-256 over image, label and index bytes, shapes and dtypes (and skipped, if any)."""
    h = hashlib.sha256()
    for name in ("image", "label", "index", "skipped"):
        if name not in batch:
            continue
        t = batch[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.numpy().tobytes())
    return h.hexdigest()


def assert_raise_names_then_skip_serves_the_rest(open_loader, missing: int, path: str) -> None:
    """Through a server: dataset "rows" (``on_error: raise``) fails with a SampleError naming sample
    ``missing`` and its ``path``; "rows-skip" serves every other sample once and lists ``missing``
    as skipped. ``open_loader(name)`` returns a RemoteDataLoader on the server."""
    import pytest

    import batchd

    with pytest.raises(batchd.SampleError, match=path) as e:
        with open_loader("rows") as ld:
            for _ in ld:
                pass
    assert e.value.dataset == "rows" and e.value.index == missing
    with open_loader("rows-skip") as ld:
        batches = list(ld)
    served = np.concatenate([b["index"].numpy() for b in batches]).tolist()
    skipped = [i for b in batches if "skipped" in b for i in b["skipped"].tolist()]
    assert sorted(served) == list(range(missing)) and skipped == [missing]


def write_class_tree(root: pathlib.Path, classes: dict[str, int]) -> None:
    """An image folder under ``root``: ``classes[c]`` random 12x16 PNGs per class folder ``c``,
    the last one in a ``nested/`` subfolder (listed after the folder's own files), and a
    ``cat/notes.txt`` that is not an image. Image ``k`` (counted over all classes from 1) is
    ``np.random.default_rng(k).integers(0, 256, (12, 16, 3), uint8)``."""
    seed = 0
    for cls, n in classes.items():
        for i in range(n):
            seed += 1
            sub = "nested/" if i == n - 1 else ""
            write_png(root / cls / f"{sub}{i:02d}.png",
                      np.random.default_rng(seed).integers(0, 256, (12, 16, 3), dtype=np.uint8))
    (root / "cat" / "notes.txt").write_text("not an image")


def load_example(name: str):
    """The module ``examples/<name>.py`` (the examples are scripts, not a package)."""
    import importlib.util
    import sys

    path = pathlib.Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"examples_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses and pickling look modules up here
    spec.loader.exec_module(module)
    return module
