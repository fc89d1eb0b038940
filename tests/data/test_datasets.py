"""Dataset kinds: fashion-mnist (IDX files), imagefolder, manifest (CSV / Parquet)."""

from __future__ import annotations

import gzip
import json
import mmap
import os
import pathlib
import re
import struct
import subprocess
import sys
import textwrap
import time

import cv2
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from batchd.errors import SampleError
from batchd.server.config import FashionMnistConfig, ImageFolderConfig, ManifestConfig
from batchd.server.data.datasets import Dataset, SampleSpec, open_dataset
from batchd.server.data.datasets._cache import IndexMissingError

pytestmark = pytest.mark.timeout(60)

FMNIST_ROOT = pathlib.Path("/usr/share/datasets/fashion-mnist")
FMNIST_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]


# --- helpers ---------------------------------------------------------------------------------


def is_mmapped(a: np.ndarray) -> bool:
    """True if ``a`` is (a view of) a memory map."""
    while a is not None:
        if isinstance(a, (np.memmap, mmap.mmap)):
            return True
        a = getattr(a, "base", None)
    return False


def write_image(path: pathlib.Path, rgb: np.ndarray) -> bytes:
    """Encode ``rgb`` (uint8 [H, W, 3]) by ``path``'s suffix (PNG if none); write it, return the bytes."""
    ok, enc = cv2.imencode(path.suffix.lower() or ".png", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR))
    assert ok
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(enc.tobytes())
    return enc.tobytes()


def solid(rgb, h=6, w=5) -> np.ndarray:
    return np.broadcast_to(np.array(rgb, np.uint8), (h, w, 3)).copy()


def smooth_image(h=64, w=80) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.dstack([x * 3 % 256, y * 3 % 256, (x + y) % 256]).astype(np.uint8)


def write_idx(path: pathlib.Path, array: np.ndarray, magic: int | None = None) -> None:
    magic = (0x0800 | array.ndim) if magic is None else magic
    header = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as f:
        f.write(header + array.astype(np.uint8).tobytes())


def make_fmnist(root: pathlib.Path, n_train=7, n_test=3) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    out = {}
    for split, prefix, n in (("train", "train", n_train), ("test", "t10k", n_test)):
        images = rng.integers(0, 256, (n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, n, dtype=np.uint8)
        write_idx(root / f"{prefix}-images-idx3-ubyte.gz", images)
        write_idx(root / f"{prefix}-labels-idx1-ubyte.gz", labels)
        out[split] = (images, labels)
    return out


def fmnist(root, split="train"):
    return FashionMnistConfig(kind="fashion-mnist", root=root, split=split)


def run_worker(code: str) -> dict:
    """Run ``code`` in a fresh Python process (like a worker); it prints one JSON line."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env, timeout=50)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --- fashion-mnist ---------------------------------------------------------------------------


@pytest.mark.skipif(not FMNIST_ROOT.is_dir(), reason="no Fashion-MNIST at /usr/share/datasets/fashion-mnist")
@pytest.mark.parametrize("split,prefix,n", [("train", "train", 60_000), ("test", "t10k", 10_000)])
def test_fashion_mnist_real_files_match_a_direct_parse(tmp_path, split, prefix, n):
    ds = open_dataset("fm", fmnist(FMNIST_ROOT, split), tmp_path, build=True)
    assert isinstance(ds, Dataset)
    assert (ds.name, ds.kind, len(ds)) == ("fm", "fashion-mnist", n)
    assert ds.classes == FMNIST_CLASSES
    assert ds.sample_spec == SampleSpec(image_shape=(28, 28, 1), image_dtype="uint8")
    with gzip.open(FMNIST_ROOT / f"{prefix}-images-idx3-ubyte.gz") as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(n, 28, 28)
    with gzip.open(FMNIST_ROOT / f"{prefix}-labels-idx1-ubyte.gz") as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    for i in (0, 1, 12, n // 2, n - 1):
        img = ds.load_image(i)
        assert img.dtype == np.uint8 and img.shape == (28, 28, 1)
        np.testing.assert_array_equal(img[:, :, 0], images[i])
        assert ds.label(i) == labels[i]
    assert ds.source(12) == f"{prefix}-images-idx3-ubyte.gz#12"


def test_fashion_mnist_cache_is_built_once_mmapped_and_rebuilt_when_a_file_changes(tmp_path):
    root, cache = tmp_path / "fm", tmp_path / "cache"
    data = make_fmnist(root)
    with pytest.raises(IndexMissingError, match="build=True"):
        open_dataset("fm", fmnist(root), cache, build=False)
    server = open_dataset("fm", fmnist(root), cache, build=True)
    assert len(server) == 7
    [cached] = list(cache.iterdir())
    mtime = cached.stat().st_mtime_ns
    worker = open_dataset("fm", fmnist(root), cache, build=False)
    assert is_mmapped(worker._images) and is_mmapped(worker._labels)
    for i in range(7):
        np.testing.assert_array_equal(worker.load_image(i)[:, :, 0], data["train"][0][i])
        assert worker.label(i) == data["train"][1][i]
    img = worker.load_image(0)
    img[:] = 0  # a writable copy, not the shared map
    assert worker.load_image(0).any()
    open_dataset("fm", fmnist(root), cache, build=True)
    assert cached.stat().st_mtime_ns == mtime  # not decompressed again

    time.sleep(0.01)
    write_idx(root / "train-images-idx3-ubyte.gz", np.full((7, 28, 28), 9, np.uint8))
    rebuilt = open_dataset("fm", fmnist(root), cache, build=True)
    assert int(rebuilt.load_image(3).max()) == 9
    assert len(list(cache.iterdir())) == 1  # the stale copy is gone
    test = open_dataset("fm", fmnist(root, "test"), cache, build=True)
    assert len(test) == 3 and test.source(2) == "t10k-images-idx3-ubyte.gz#2"
    with pytest.raises(IndexError):
        test.load_image(3)


def test_fashion_mnist_missing_and_malformed_files(tmp_path):
    root = tmp_path / "fm"
    make_fmnist(root)
    (root / "train-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(FileNotFoundError, match="train-labels-idx1-ubyte.gz"):
        open_dataset("fm", fmnist(root), tmp_path / "c1", build=True)

    make_fmnist(root)
    write_idx(root / "train-images-idx3-ubyte.gz", np.zeros((7, 28, 28), np.uint8), magic=0x0801)
    with pytest.raises(ValueError, match=r"train-images-idx3-ubyte.gz: IDX magic number 0x00000801"):
        open_dataset("fm", fmnist(root), tmp_path / "c2", build=True)

    make_fmnist(root)
    write_idx(root / "train-labels-idx1-ubyte.gz", np.zeros(6, np.uint8))
    with pytest.raises(ValueError, match="6 labels, but train-images-idx3-ubyte.gz has 7 images"):
        open_dataset("fm", fmnist(root), tmp_path / "c3", build=True)

    make_fmnist(root)
    path = root / "train-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-100]))
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: truncated"):
        open_dataset("fm", fmnist(root), tmp_path / "c4", build=True)

    path.write_bytes(raw)  # not gzip at all
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.gz: not a valid gzip file"):
        open_dataset("fm", fmnist(root), tmp_path / "c5", build=True)

    make_fmnist(root)
    write_idx(root / "train-labels-idx1-ubyte.gz", np.full(7, 10, np.uint8))
    with pytest.raises(ValueError, match="label 10 at position 0"):
        open_dataset("fm", fmnist(root), tmp_path / "c6", build=True)
    assert not list((tmp_path / "c6").glob("*"))  # nothing half-written left behind


# --- imagefolder -----------------------------------------------------------------------------


def make_folder(root: pathlib.Path) -> None:
    write_image(root / "dog" / "b.png", solid((0, 0, 255)))
    write_image(root / "dog" / "a.PNG", solid((0, 255, 0)))
    write_image(root / "dog" / "sub" / "c.jpg", solid((10, 10, 10)))
    write_image(root / "cat" / "z.bmp", solid((255, 0, 0)))
    write_image(root / "cat" / "10.png", solid((1, 2, 3)))
    write_image(root / "cat" / "9.png", solid((1, 2, 3)))
    (root / "cat" / "notes.txt").write_text("not an image")
    (root / "stray.png").write_bytes(b"")  # a file at the top level is not a class


def folder(root, **kw):
    return ImageFolderConfig(kind="imagefolder", root=root, **kw)


def test_imagefolder_order_labels_classes_and_rgb(tmp_path):
    make_folder(tmp_path / "img")
    ds = open_dataset("photos", folder(tmp_path / "img"), tmp_path / "cache", build=True)
    assert (ds.name, ds.kind) == ("photos", "imagefolder")
    assert ds.classes == ["cat", "dog"]
    got = [(ds.source(i), ds.label(i)) for i in range(len(ds))]
    assert got == [
        ("cat/10.png", 0),
        ("cat/9.png", 0),
        ("cat/z.bmp", 0),
        ("dog/a.PNG", 1),
        ("dog/b.png", 1),
        ("dog/sub/c.jpg", 1),
    ]
    assert ds.sample_spec == SampleSpec(image_shape=(-1, -1, 3))
    red = ds.load_image(2)
    assert red.dtype == np.uint8 and red.shape == (6, 5, 3)
    assert red[0, 0].tolist() == [255, 0, 0]
    assert ds.load_image(4)[3, 3].tolist() == [0, 0, 255]
    assert ds.load_image(3)[3, 3].tolist() == [0, 255, 0]


def test_imagefolder_pure_red_png_is_rgb(tmp_path):
    bgr = np.zeros((4, 4, 3), np.uint8)
    bgr[..., 2] = 255  # OpenCV writes BGR: this is pure red
    (tmp_path / "img" / "red").mkdir(parents=True)
    assert cv2.imwrite(str(tmp_path / "img" / "red" / "r.png"), bgr)
    ds = open_dataset("r", folder(tmp_path / "img"), tmp_path / "cache", build=True)
    assert ds.load_image(0)[0, 0].tolist() == [255, 0, 0]


def test_imagefolder_extensions_and_index_refresh(tmp_path):
    make_folder(tmp_path / "img")
    cache = tmp_path / "cache"
    only_bmp = folder(tmp_path / "img", extensions=(".BMP",), allow_empty=True)  # dog: no .bmp
    ds = open_dataset("p", only_bmp, cache, build=True)
    assert [ds.source(i) for i in range(len(ds))] == ["cat/z.bmp"]
    worker = open_dataset("p", only_bmp, cache, build=False)
    assert len(worker) == 1 and worker.classes == ["cat", "dog"]

    assert len(open_dataset("p", folder(tmp_path / "img"), cache, build=True)) == 6
    write_image(tmp_path / "img" / "cat" / "0.png", solid((0, 0, 0)))
    before = open_dataset("p", folder(tmp_path / "img"), cache, build=False)
    assert len(before) == 6  # workers see what the server last built...
    after = open_dataset("p", folder(tmp_path / "img"), cache, build=True)
    assert len(after) == 7 and after.source(0) == "cat/0.png"  # ...which rescans on every open
    assert len(open_dataset("p", folder(tmp_path / "img"), cache, build=False)) == 7
    assert len(before) == 6 and before.source(0) == "cat/10.png"  # an open map keeps its old index


def test_two_datasets_on_one_root_with_other_settings_keep_their_own_indexes(tmp_path):
    """A server builds every dataset's index, then its workers open them: building the second must
    not remove the first's (it did when the index name hashed the root alone: IndexMissingError)."""
    make_folder(tmp_path / "img")
    cache = tmp_path / "cache"
    only_bmp = folder(tmp_path / "img", extensions=(".BMP",), allow_empty=True)
    everything = folder(tmp_path / "img")
    built = {name: len(open_dataset(name, cfg, cache, build=True))
             for name, cfg in (("bmp", only_bmp), ("all", everything))}
    assert built == {"bmp": 1, "all": 6}
    assert len(open_dataset("bmp", only_bmp, cache, build=False)) == 1
    assert len(open_dataset("all", everything, cache, build=False)) == 6
    assert len(list(cache.glob("imagefolder-*.bidx"))) == 2


def test_imagefolder_errors_when_opening(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a folder"):
        open_dataset("p", folder(tmp_path / "nope"), tmp_path / "cache", build=True)
    (tmp_path / "flat").mkdir()
    write_image(tmp_path / "flat" / "a.png", solid((0, 0, 0)))
    with pytest.raises(FileNotFoundError, match="no class folders"):
        open_dataset("p", folder(tmp_path / "flat"), tmp_path / "cache", build=True)
    (tmp_path / "noimg" / "a").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="no images .* class folder"):
        open_dataset("p", folder(tmp_path / "noimg"), tmp_path / "cache", build=True)
    with pytest.raises(ValueError, match="no images"):  # allowed empty, but nothing to serve
        open_dataset("p", folder(tmp_path / "noimg", allow_empty=True), tmp_path / "cache", build=True)
    with pytest.raises(IndexMissingError, match="'p'"):
        open_dataset("p", folder(tmp_path / "noimg"), tmp_path / "cache", build=False)


def test_index_is_memory_mapped_and_read_by_a_separate_worker_process(tmp_path):
    make_folder(tmp_path / "img")
    cache = tmp_path / "cache"
    server = open_dataset("photos", folder(tmp_path / "img"), cache, build=True)
    assert is_mmapped(server._paths.offsets) and is_mmapped(server._paths.data) and is_mmapped(server._labels)
    assert not server._paths.offsets.flags.writeable
    out = run_worker(
        f"""
        import json, pathlib, sys
        from batchd.server.config import ImageFolderConfig
        from batchd.server.data.datasets import open_dataset
        cfg = ImageFolderConfig(kind="imagefolder", root={str(tmp_path / "img")!r})
        ds = open_dataset("photos", cfg, pathlib.Path({str(cache)!r}), build=False)
        print(json.dumps({{"rows": [[ds.source(i), ds.label(i)] for i in range(len(ds))],
                           "classes": ds.classes, "pixel": ds.load_image(2)[0, 0].tolist(),
                           "pyarrow": "pyarrow" in sys.modules}}))
        """
    )
    assert out["rows"] == [[server.source(i), server.label(i)] for i in range(len(server))]
    assert out["classes"] == server.classes and out["pixel"] == [255, 0, 0]
    assert not out["pyarrow"]


# --- manifest --------------------------------------------------------------------------------


def manifest(path, **kw):
    return ManifestConfig(kind="manifest", path=path, **kw)


def make_images(root: pathlib.Path) -> None:
    write_image(root / "imgs" / "r.png", solid((255, 0, 0)))
    write_image(root / "imgs" / "g.png", solid((0, 255, 0)))
    write_image(root / "imgs" / "b.jpg", solid((0, 0, 255), 16, 16))


def test_manifest_csv_string_labels(tmp_path):
    make_images(tmp_path)
    (tmp_path / "m.csv").write_text("id,path,label\n7,imgs/r.png,zebra\n8,imgs/g.png,ant\n9,imgs/b.jpg,NA\n10,imgs/r.png,ant\n")
    ds = open_dataset("m", manifest(tmp_path / "m.csv"), tmp_path / "cache", build=True)
    assert (ds.name, ds.kind, len(ds)) == ("m", "manifest", 4)
    assert ds.classes == ["NA", "ant", "zebra"]
    assert [ds.label(i) for i in range(4)] == [2, 1, 0, 1]
    assert [ds.source(i) for i in range(4)] == ["imgs/r.png", "imgs/g.png", "imgs/b.jpg", "imgs/r.png"]
    assert ds.load_image(0)[0, 0].tolist() == [255, 0, 0]
    assert ds.load_image(1)[0, 0].tolist() == [0, 255, 0]
    b = ds.load_image(2)
    assert b.shape == (16, 16, 3) and np.abs(b[8, 8].astype(int) - [0, 0, 255]).max() <= 3
    assert is_mmapped(ds._paths.offsets)


def test_manifest_csv_int_labels_root_and_absolute_paths(tmp_path):
    make_images(tmp_path / "data")
    (tmp_path / "lists").mkdir()
    absolute = tmp_path / "data" / "imgs" / "g.png"
    (tmp_path / "lists" / "m.csv").write_text(f"label,path\n3,imgs/r.png\n0,{absolute}\n")
    cfg = manifest(tmp_path / "lists" / "m.csv", root=tmp_path / "data")
    ds = open_dataset("m", cfg, tmp_path / "cache", build=True)
    assert ds.classes == ["0", "1", "2", "3"]
    assert [ds.label(0), ds.label(1)] == [3, 0]
    assert ds.source(1) == str(absolute)
    assert ds.load_image(0)[0, 0].tolist() == [255, 0, 0]
    assert ds.load_image(1)[0, 0].tolist() == [0, 255, 0]
    # without root, relative paths start at the table's folder
    ds = open_dataset("m", manifest(tmp_path / "lists" / "m.csv"), tmp_path / "cache", build=True)
    with pytest.raises(SampleError, match="No such file"):
        ds.load_image(0)
    assert ds.load_image(1)[0, 0].tolist() == [0, 255, 0]


def test_manifest_numeric_looking_paths_stay_strings(tmp_path):
    write_image(tmp_path / "001", solid((0, 255, 0)))
    (tmp_path / "m.csv").write_text("path,label\n001,1\n")
    ds = open_dataset("m", manifest(tmp_path / "m.csv"), tmp_path / "cache", build=True)
    assert ds.source(0) == "001" and ds.load_image(0)[0, 0].tolist() == [0, 255, 0]


@pytest.mark.parametrize("suffix", [".parquet", ".pq"])
def test_manifest_parquet(tmp_path, suffix):
    make_images(tmp_path)
    table = pa.table({"id": [1, 2, 3], "label": ["b", "a", "b"], "path": ["imgs/g.png", "imgs/r.png", "imgs/b.jpg"]})
    pq.write_table(table, tmp_path / f"m{suffix}", row_group_size=2)  # two chunks
    ds = open_dataset("m", manifest(tmp_path / f"m{suffix}"), tmp_path / "cache", build=True)
    assert ds.classes == ["a", "b"]
    assert [(ds.source(i), ds.label(i)) for i in range(3)] == [("imgs/g.png", 1), ("imgs/r.png", 0), ("imgs/b.jpg", 1)]
    assert ds.load_image(1)[0, 0].tolist() == [255, 0, 0]
    pq.write_table(pa.table({"path": pa.array(["x.png"]).dictionary_encode(), "label": pa.array([4], pa.int8())}), tmp_path / "d.parquet")
    ds = open_dataset("d", manifest(tmp_path / "d.parquet"), tmp_path / "cache", build=True)
    assert ds.source(0) == "x.png" and ds.label(0) == 4 and ds.classes == ["0", "1", "2", "3", "4"]


def test_manifest_errors_name_file_column_and_row(tmp_path):
    cache = tmp_path / "cache"
    (tmp_path / "nolabel.csv").write_text("id,path\n1,a.png\n")
    with pytest.raises(ValueError, match=r"nolabel.csv: manifest has no column 'label'"):
        open_dataset("m", manifest(tmp_path / "nolabel.csv"), cache, build=True)
    pq.write_table(pa.table({"label": [1]}), tmp_path / "nopath.parquet")
    with pytest.raises(ValueError, match=r"nopath.parquet: manifest has no column 'path'"):
        open_dataset("m", manifest(tmp_path / "nopath.parquet"), cache, build=True)
    (tmp_path / "nullpath.csv").write_text("path,label\na.png,1\n,2\n")
    with pytest.raises(ValueError, match=r"nullpath.csv: row 1 .* has no path"):
        open_dataset("m", manifest(tmp_path / "nullpath.csv"), cache, build=True)
    (tmp_path / "nulllabel.csv").write_text("path,label\na.png,x\nb.png,y\nc.png,\n")
    with pytest.raises(ValueError, match=r"nulllabel.csv: row 2 .* has no label"):
        open_dataset("m", manifest(tmp_path / "nulllabel.csv"), cache, build=True)
    (tmp_path / "neg.csv").write_text("path,label\na.png,1\nb.png,-1\n")
    with pytest.raises(ValueError, match=r"neg.csv: row 1 .* negative label -1"):
        open_dataset("m", manifest(tmp_path / "neg.csv"), cache, build=True)
    (tmp_path / "float.csv").write_text("path,label\na.png,1.5\n")
    with pytest.raises(ValueError, match=r"float.csv: label column has type double"):
        open_dataset("m", manifest(tmp_path / "float.csv"), cache, build=True)
    (tmp_path / "empty.csv").write_text("path,label\n")
    with pytest.raises(ValueError, match=r"empty.csv: manifest has no rows"):
        open_dataset("m", manifest(tmp_path / "empty.csv"), cache, build=True)
    with pytest.raises(FileNotFoundError, match="missing.csv"):
        open_dataset("m", manifest(tmp_path / "missing.csv"), cache, build=True)
    assert not [p for p in cache.glob("*") if p.suffix == ".tmp" or p.name.startswith(".")]


def test_manifest_worker_open_and_rebuild_when_the_table_changes(tmp_path):
    make_images(tmp_path)
    table, cache = tmp_path / "m.csv", tmp_path / "cache"
    table.write_text("path,label\nimgs/r.png,1\n")
    with pytest.raises(IndexMissingError):
        open_dataset("m", manifest(table), cache, build=False)
    open_dataset("m", manifest(table), cache, build=True)
    worker = open_dataset("m", manifest(table), cache, build=False)
    assert len(worker) == 1 and is_mmapped(worker._labels)
    out = run_worker(
        f"""
        import json, pathlib, sys
        from batchd.server.config import ManifestConfig
        from batchd.server.data.datasets import open_dataset
        ds = open_dataset("m", ManifestConfig(kind="manifest", path={str(table)!r}), pathlib.Path({str(cache)!r}), build=False)
        print(json.dumps({{"n": len(ds), "src": ds.source(0), "px": ds.load_image(0)[0, 0].tolist(),
                           "pyarrow": "pyarrow" in sys.modules}}))
        """
    )
    assert out == {"n": 1, "src": "imgs/r.png", "px": [255, 0, 0], "pyarrow": False}

    time.sleep(0.01)
    table.write_text("path,label\nimgs/r.png,1\nimgs/g.png,0\n")
    with pytest.raises(IndexMissingError):  # the server has not seen the new table yet
        open_dataset("m", manifest(table), cache, build=False)
    assert len(open_dataset("m", manifest(table), cache, build=True)) == 2
    assert len(open_dataset("m", manifest(table), cache, build=False)) == 2
    assert len(list(cache.glob("*.bidx"))) == 1


# --- corrupt files ---------------------------------------------------------------------------


@pytest.fixture
def corrupt(tmp_path):
    """A manifest whose rows are: good.jpg, truncated.jpg, empty.png, text.png, missing.png,
    truncated.png, noeoi.jpg (a JPEG missing only its end marker), junk-after.jpg (a complete
    JPEG with bytes after it), folder.png (a directory)."""
    d = tmp_path / "files"
    jpeg = write_image(d / "good.jpg", smooth_image())
    (d / "truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (d / "empty.png").write_bytes(b"")
    (d / "text.png").write_text("this is not an image\n")
    png = write_image(d / "whole.png", smooth_image())
    (d / "truncated.png").write_bytes(png[: len(png) // 2])
    (d / "noeoi.jpg").write_bytes(jpeg[:-2])
    (d / "junk-after.jpg").write_bytes(jpeg + b"\0\0trailing junk")
    (d / "folder.png").mkdir()
    names = ["good.jpg", "truncated.jpg", "empty.png", "text.png", "missing.png", "truncated.png", "noeoi.jpg", "junk-after.jpg", "folder.png"]
    (d / "m.csv").write_text("path,label\n" + "".join(f"{n},0\n" for n in names))
    return open_dataset("bad", manifest(d / "m.csv"), tmp_path / "cache", build=True)


@pytest.mark.parametrize(
    "index,path,reason",
    [
        (1, "truncated.jpg", r"^truncated JPEG: no end-of-image marker after the last scan \(\d+ bytes\)$"),
        (2, "empty.png", r"^empty file \(0 bytes\)$"),
        (3, "text.png", r"^not a decodable image \(21 bytes\)$"),
        (4, "missing.png", r"^cannot read file: \[Errno 2\] No such file or directory$"),
        (5, "truncated.png", r"^not a decodable image \(\d+ bytes\)$"),
        (6, "noeoi.jpg", r"^truncated JPEG"),
        (8, "folder.png", r"^cannot read file: \[Errno 21\] Is a directory$"),
    ],
)
def test_corrupt_files_raise_sample_error(corrupt, index, path, reason):
    with pytest.raises(SampleError) as info:
        corrupt.load_image(index)
    err = info.value
    assert (err.dataset, err.index, err.path) == ("bad", index, path)
    assert re.search(reason, err.reason), err.reason
    assert f"sample {index} ({path})" in str(err)


def test_good_and_trailing_junk_jpegs_decode(corrupt):
    for i in (0, 7):
        img = corrupt.load_image(i)
        assert img.shape == (64, 80, 3) and img.dtype == np.uint8
        assert np.abs(img.astype(int) - smooth_image().astype(int)).mean() < 8


def test_opencv_alone_on_a_truncated_jpeg(tmp_path):
    """Documents what cv2 does without our end-marker check: OpenCV >= 5 returns None; 4.x
    returned the decoded top part with grey below. batchd raises SampleError either way."""
    ok, enc = cv2.imencode(".jpg", smooth_image(256, 256))
    out = cv2.imdecode(enc[: enc.size // 2], cv2.IMREAD_COLOR)
    major = int(cv2.__version__.split(".")[0])
    if major >= 5:
        assert out is None
    else:
        assert out is None or out.shape == (256, 256, 3)


def test_max_pixels(tmp_path):
    d = tmp_path / "files"
    for name in ("a.png", "a.jpg", "a.bmp", "a.webp", "a.tif"):
        write_image(d / name, smooth_image(30, 40))
    (d / "m.csv").write_text("path,label\na.png,0\na.jpg,0\na.bmp,0\na.webp,0\na.tif,0\n")
    ds = open_dataset("big", manifest(d / "m.csv"), tmp_path / "cache", build=True, max_pixels=1199)
    for i in range(5):
        with pytest.raises(SampleError, match=r"image too large: 40x30 = 1200 pixels > max_pixels 1199"):
            ds.load_image(i)
    ok = open_dataset("big", manifest(d / "m.csv"), tmp_path / "cache", build=False, max_pixels=1200)
    assert all(ok.load_image(i).shape == (30, 40, 3) for i in range(5))


def test_image_size_reads_headers(tmp_path):
    from batchd.server.data.decode import image_size

    for suffix in (".png", ".jpg", ".bmp", ".webp"):
        ok, enc = cv2.imencode(suffix, smooth_image(30, 40))
        assert image_size(enc) == (40, 30), suffix
    ok, enc = cv2.imencode(".webp", smooth_image(30, 40), [cv2.IMWRITE_WEBP_QUALITY, 101])  # lossless: VP8L
    assert image_size(enc) == (40, 30)
    assert image_size(np.frombuffer(b"hello", np.uint8)) is None


def test_out_of_range_and_unknown_kind(tmp_path):
    make_folder(tmp_path / "img")
    ds = open_dataset("p", folder(tmp_path / "img"), tmp_path / "cache", build=True)
    for bad in (-1, len(ds)):
        with pytest.raises(IndexError):
            ds.label(bad)
        with pytest.raises(IndexError):
            ds.load_image(bad)

    class Odd:
        kind = "tfrecord"

    with pytest.raises(ValueError, match="unknown kind 'tfrecord'"):
        open_dataset("x", Odd(), tmp_path / "cache", build=True)


def test_public_names():
    import batchd.server.data.datasets as m

    assert m.__all__ == sorted(m.__all__) == ["Dataset", "FieldSpec", "PER_OBJECT_FIELDS", "SampleSpec", "open_dataset"]


@pytest.mark.parametrize("typ", [pa.string(), pa.large_string()])
def test_packing_arrow_string_chunks_respects_slices(typ):
    from batchd.server.data.datasets._files import PackedStrings
    from batchd.server.data.datasets.manifest import _path_chunks

    arr = pa.array(["a/ü.png", "bb.png", "c/c/c.jpg", "d.png"], typ)
    col = pa.chunked_array([arr.slice(1, 2), arr.slice(0, 0), arr.slice(3, 1), arr.slice(0, 1)], typ)
    offsets, pieces = _path_chunks(col)
    packed = PackedStrings(np.concatenate(pieces), offsets)
    assert [packed[i] for i in range(len(packed))] == ["bb.png", "c/c/c.jpg", "d.png", "a/ü.png"]
