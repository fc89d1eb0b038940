"""Small helpers the test modules share (imported as ``from helpers import ...``)."""

from __future__ import annotations

import contextlib
import hashlib
import pathlib
import random
import socket
import struct
import subprocess
import time

import cv2
import numpy as np


def _ephemeral_low() -> int:
    """The lowest port the kernel hands out itself (outgoing connections, ``bind`` to port 0)."""
    try:
        return int(pathlib.Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


_given: set[int] = set()  # ports free_port returned in this process


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago, below the kernel's ephemeral range: a
    port chosen now and bound later by a server could otherwise be taken meanwhile as the source
    port of an outgoing connection (SeaweedFS's filer once lost its port to its own master client).
    The port after it was free too, and is never given either: a batchd server on port P puts its
    data plane on P + 1 (``DataPlaneConfig.port_for``)."""
    low = _ephemeral_low()
    pick = random.SystemRandom()  # (not the test's seeded generators)
    for _ in range(200):
        port = pick.randrange(max(1024, low - 12000), low - 1)
        if port in _given or port + 1 in _given:  # (several ports for one server, taken before any is bound)
            continue
        if not all(_bindable(p) for p in (port, port + 1)):
            continue
        _given.update((port, port + 1))
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # (that range is full: any free port)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


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


def fields_digest(batch: dict) -> str:
    """SHA-256 over every field of a batch, in name order: a stacked tensor's dtype, shape and
    bytes; a list (ragged field) element by element (str / bytes as they are)."""
    h = hashlib.sha256()
    for name in sorted(batch):
        value = batch[name]
        h.update(f"{name}:{type(value).__name__}:".encode())
        for t in value if isinstance(value, list) else [value]:
            if isinstance(t, (str, bytes)):
                h.update(repr(t).encode())
                continue
            h.update(f"{t.dtype}:{tuple(t.shape)}:".encode())
            h.update(t.cpu().contiguous().numpy().tobytes())
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


def exif_segment(orientation: int) -> bytes:
    """An APP1 segment holding only an EXIF orientation tag (big-endian TIFF)."""
    tiff = b"MM\x00\x2a" + struct.pack(">I", 8) + struct.pack(">H", 1)
    tiff += struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    payload = b"Exif\x00\x00" + tiff
    return b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload


def jpeg_bytes(rgb: np.ndarray, *, progressive: bool = False, orientation: int = 0, grey: bool = False,
               quality: int = 90) -> bytes:
    """``rgb`` (uint8 [H, W, 3]) encoded by OpenCV as a JPEG file, with an EXIF ``orientation`` if not 0."""
    image = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY) if grey else cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR)
    params = [cv2.IMWRITE_JPEG_QUALITY, quality, cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive)]
    ok, buf = cv2.imencode(".jpg", image, params)
    assert ok
    data = buf.tobytes()
    return data[:2] + exif_segment(orientation) + data[2:] if orientation else data


def picture(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Smooth colour gradients, a few rectangles and some noise: JPEG-like content, uint8 [h, w, 3]."""
    y, x = np.mgrid[0:h, 0:w]
    base = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), (x + y) * 127 // max(h + w - 2, 1)], -1)
    img = base.astype(np.int32) + rng.integers(-12, 12, (h, w, 3))
    for _ in range(3):
        y0, x0 = rng.integers(0, h - 4), rng.integers(0, w - 4)
        img[y0 : y0 + h // 4, x0 : x0 + w // 4] = rng.integers(0, 256, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def fine_detail(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """Fine stripes and noise over a flat patch, uint8 [h, w, 3]: detail that a downscale without
    a filter aliases."""
    y, x = np.mgrid[0:h, 0:w]
    img = 128 + 60 * np.sin(x * 0.9 + y * 0.3)[..., None] + rng.normal(0, 25, (h, w, 3))
    img[h // 6 : h // 2, w // 4 : w // 2] = rng.integers(0, 256, 3)
    return np.clip(img, 0, 255).astype(np.uint8)


def without_quantisation_tables(data: bytes) -> bytes:
    """A JPEG file with its DQT segments cut out: its headers still pass the server's check
    (``check_jpeg``), but no decoder can decode it (libjpeg: "Quantization table 0x00 was not
    defined"; OpenCV returns None)."""
    out, pos = bytearray(data[:2]), 2
    while pos + 4 <= len(data):
        marker = data[pos + 1]
        if marker == 0xDA:  # start of scan: the entropy-coded data and the rest follow as they are
            return bytes(out + data[pos:])
        (length,) = struct.unpack_from(">H", data, pos + 2)
        if marker != 0xDB:
            out += data[pos : pos + 2 + length]
        pos += 2 + length
    raise ValueError("no start-of-scan marker")


def jpeg_batch(files: list[bytes], resize: tuple[int, int] = (0, 0), reduce: list[int] | None = None,
               indices: list[int] | None = None) -> dict:
    """A JPEG batch as the client receives it (CPU tensors; see server/compute/encoded.py)."""
    import torch

    n = len(files)
    indices = list(range(n)) if indices is None else indices
    offsets = np.cumsum([0, *map(len, files)]).astype(np.int64)
    return {"label": torch.zeros(n, dtype=torch.int64), "index": torch.tensor(indices, dtype=torch.int64),
            "position": torch.arange(n), "jpeg_offsets": torch.from_numpy(offsets),
            "jpeg_resize": torch.tensor(resize, dtype=torch.int64),
            "jpeg_reduce": torch.tensor(reduce or [1] * n, dtype=torch.int64),
            "jpeg": torch.from_numpy(np.frombuffer(b"".join(files), np.uint8).copy())}


def opencv_as_nvjpeg(files, mode, device):
    """OpenCV standing in for ``torchvision.io.decode_jpeg(files, mode=RGB, device=...)`` where nvJPEG
    cannot run: uint8 [3, H, W] per file, the EXIF orientation ignored (as torchvision does on
    CUDA), and one file it cannot decode fails the whole call with a RuntimeError (as the batched
    nvJPEG call does)."""
    import torch

    out = []
    for f in files:
        bgr = cv2.imdecode(f.numpy(), cv2.IMREAD_COLOR | cv2.IMREAD_IGNORE_ORIENTATION)
        if bgr is None:
            raise RuntimeError("Error while decoding JPEG images: nvjpegDecode failed (stand-in)")
        out.append(torch.from_numpy(cv2.cvtColor(bgr, cv2.COLOR_BGR2RGB)).permute(2, 0, 1).to(device))
    return out


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


class ThrottledProxy:
    """A TCP forwarder on 127.0.0.1 to ``target`` ("HOST:PORT") whose server-to-client direction
    carries at most ``bytes_per_second``: a slow network link, for a gRPC client (``address``).
    ``close()`` stops accepting and cuts the open connections."""

    def __init__(self, target: str, bytes_per_second: float):
        import socket
        import threading

        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self.rate = bytes_per_second
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._socks: list = []
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        import socket
        import threading

        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            self._socks += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, self.rate), daemon=True).start()

    @staticmethod
    def _pump(src, dst, rate) -> None:
        start, sent = time.monotonic(), 0
        try:
            while data := src.recv(16384):
                dst.sendall(data)
                if rate:
                    sent += len(data)
                    ahead = sent / rate - (time.monotonic() - start)
                    if ahead > 0:
                        time.sleep(ahead)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass


def fake_data_server(script):
    """A data port for one connection: a listening socket on 127.0.0.1 whose first connection has
    its 32-byte token read, then ``script(conn)`` run on it, in a thread. Returns (listener,
    thread)."""
    import threading

    from batchd import datawire

    listener = socket.create_server(("127.0.0.1", 0))

    def run():
        conn, _ = listener.accept()
        with conn:
            conn.recv(datawire.TOKEN_BYTES, socket.MSG_WAITALL)
            script(conn)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return listener, t


def private_shm_prefix() -> list[str] | None:
    """An argv prefix that runs a command with a /dev/shm of its own (a mount namespace, as a
    container without the trainer's IPC namespace): this process cannot read a server's shared
    memory there and gets its batches over TCP, as from another host. None where ``unshare`` may
    not mount (not root and no user namespaces)."""
    for unshare in (["unshare", "-m"], ["unshare", "-r", "-m"]):
        try:
            ok = subprocess.run([*unshare, "sh", "-c", "mount -t tmpfs tmpfs /dev/shm"], capture_output=True,
                                timeout=10).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            continue
        if ok:
            return [*unshare, "sh", "-c", 'mount -t tmpfs tmpfs /dev/shm && exec "$@"', "sh"]
    return None


@contextlib.contextmanager
def data_plane(**kw):
    """A ``DataPlane`` on 127.0.0.1:0 (``kw``: its options), closed on exit."""
    from batchd.server.serve.dataplane import DataPlane

    p = DataPlane("127.0.0.1", 0, **kw)
    try:
        yield p
    finally:
        p.close()
