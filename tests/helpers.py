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
