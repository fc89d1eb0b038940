"""imagefolder lists exactly what torchvision.datasets.ImageFolder lists, in its order (issue 10.6).

torchvision cannot be installed here (its wheels need CUDA torch), so ``reference`` below is a
line-for-line transcription of torchvision's own rule: ``find_classes``, ``make_dataset`` and
``has_file_allowed_extension`` from torchvision/datasets/folder.py, torchvision 0.18 (which
added ``allow_empty``, pytorch/vision#8297) through 0.22, unchanged in that range.
"""

from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest

from batchd.server.config import ImageFolderConfig
from batchd.server.data.datasets import _cache, open_dataset
from batchd.server.data.datasets._cache import ArrayFileWriter, IndexMissingError, cache_path
from batchd.server.data.datasets._files import pack_strings

pytestmark = pytest.mark.timeout(60)

# torchvision.datasets.folder.IMG_EXTENSIONS
IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


# --- torchvision's rule, transcribed ---------------------------------------------------------


def has_file_allowed_extension(filename, extensions):
    return filename.lower().endswith(extensions if isinstance(extensions, str) else tuple(extensions))


def find_classes(directory):
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    class_to_idx = {cls_name: i for i, cls_name in enumerate(classes)}
    return classes, class_to_idx


def make_dataset(directory, class_to_idx=None, extensions=None, is_valid_file=None, allow_empty=False):
    directory = os.path.expanduser(directory)
    if class_to_idx is None:
        _, class_to_idx = find_classes(directory)
    elif not class_to_idx:
        raise ValueError("'class_to_index' must have at least one entry to collect any samples.")
    both_none = extensions is None and is_valid_file is None
    both_something = extensions is not None and is_valid_file is not None
    if both_none or both_something:
        raise ValueError("Both extensions and is_valid_file cannot be None or not None at the same time")
    if extensions is not None:
        def is_valid_file(x):
            return has_file_allowed_extension(x, extensions)
    instances = []
    available_classes = set()
    for target_class in sorted(class_to_idx.keys()):
        class_index = class_to_idx[target_class]
        target_dir = os.path.join(directory, target_class)
        if not os.path.isdir(target_dir):
            continue
        for root, _, fnames in sorted(os.walk(target_dir, followlinks=True)):
            for fname in sorted(fnames):
                path = os.path.join(root, fname)
                if is_valid_file(path):
                    item = path, class_index
                    instances.append(item)
                    if target_class not in available_classes:
                        available_classes.add(target_class)
    empty_classes = set(class_to_idx.keys()) - available_classes
    if empty_classes and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty_classes))}. "
        if extensions is not None:
            msg += f"Supported extensions are: {extensions if isinstance(extensions, str) else ', '.join(extensions)}"
        raise FileNotFoundError(msg)
    return instances


def reference(root: pathlib.Path, extensions=IMG_EXTENSIONS, allow_empty=False):
    """(classes, [(path relative to root, label)]) as ImageFolder(root, allow_empty=...) has them."""
    classes, class_to_idx = find_classes(str(root))
    samples = make_dataset(str(root), class_to_idx, extensions=extensions, allow_empty=allow_empty)
    return classes, [(os.path.relpath(p, root).replace(os.sep, "/"), label) for p, label in samples]


# --- the tree --------------------------------------------------------------------------------


def touch(path: pathlib.Path, data: bytes = b"x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def nested_tree(base: pathlib.Path) -> pathlib.Path:
    """Class folders with folders inside, files at several depths, mixed-case and non-image
    names, symlinked folders, and names whose full-path string order differs from the walk
    order ("a/b/x.png", "a/b.png", "a-c/...", "a.b/...")."""
    root = base / "root"
    for rel in (
        "alpha/x.png", "alpha/B.PNG", "alpha/a.JPEG", "alpha/b.png", "alpha/.png", "alpha/notes.txt",
        "alpha/img.png.bak", "alpha/Zed.Tiff",
        "alpha/a/x.png", "alpha/a/b/x.png", "alpha/a/b/y.ppm", "alpha/a/b.png/inside.jpg", "alpha/a/b.webp",
        "alpha/a-c/z.png", "alpha/a.b/q.webp", "alpha/a0/w.pgm", "alpha/A/upper.jpg",
        "beta/deep/er/est/file.ppm", "beta/Top.BMP", "beta/t.TIF", "beta/deep/x.jpeg", "beta/deep-er/y.png",
        "beta/deep.er/z.png", "beta/readme.md",
        "gamma only/é.png", "gamma only/sub dir/1.png", "gamma only/sub dir/10.png", "gamma only/sub dir/9.png",
    ):
        touch(root / rel)
    touch(base / "outside" / "s.tif")
    touch(base / "outside" / "sub" / "t.pgm")
    touch(base / "outside" / "sub" / "skip.gif")
    os.symlink(base / "outside", root / "alpha" / "link")  # a symlinked folder inside a class
    os.symlink(base / "outside", root / "delta")  # a symlinked class folder
    touch(root / "stray.png")  # a file at the top level is not a class
    return root


def folder(root, **kw) -> ImageFolderConfig:
    return ImageFolderConfig(kind="imagefolder", root=root, **kw)


def listing(ds):
    return [(ds.source(i), ds.label(i)) for i in range(len(ds))]


# --- tests -----------------------------------------------------------------------------------


def test_nested_tree_is_listed_as_torchvision_lists_it(tmp_path):
    root = nested_tree(tmp_path)
    classes, expected = reference(root)
    ds = open_dataset("t", folder(root), tmp_path / "cache", build=True)
    assert ds.classes == classes == ["alpha", "beta", "delta", "gamma only"]
    assert listing(ds) == expected
    # the points where a full-path string sort (the old order) differs from the walk order
    got = [p for p, _ in listing(ds)]
    assert got.index("alpha/x.png") < got.index("alpha/a-c/z.png")  # own files before subfolders'
    assert got.index("alpha/a/x.png") < got.index("alpha/a-c/z.png") < got.index("alpha/a/b/x.png")
    assert got.index("alpha/a/b/y.ppm") < got.index("alpha/a/b.png/inside.jpg")
    assert "alpha/.png" in got and "alpha/link/sub/t.pgm" in got and "delta/s.tif" in got
    assert sorted(got) != got
    # workers map what the server built, in the same order
    worker = open_dataset("t", folder(root), tmp_path / "cache", build=False)
    assert listing(worker) == expected and worker.classes == classes


@pytest.mark.parametrize("extensions", [(".PNG",), (".png", ".Tif", ".tiff"), (".jpeg", ".jpg")])
def test_chosen_extensions_match_in_any_case(tmp_path, extensions):
    root = nested_tree(tmp_path)
    lower = tuple(e.lower() for e in extensions)
    classes, expected = reference(root, lower, allow_empty=True)
    ds = open_dataset("t", folder(root, extensions=extensions, allow_empty=True), tmp_path / "cache", build=True)
    assert (ds.classes, listing(ds)) == (classes, expected)
    assert expected  # a non-trivial comparison


def test_default_extensions_are_torchvisions(tmp_path):
    assert ImageFolderConfig.model_fields["extensions"].default == IMG_EXTENSIONS
    root = tmp_path / "root"
    for ext in (*IMG_EXTENSIONS, ".GIF", ".jp2", ".heic", ".txt"):
        touch(root / "c" / f"f{ext.upper()}")
    ds = open_dataset("t", folder(root), tmp_path / "cache", build=True)
    assert listing(ds) == reference(root)[1]
    assert sorted(p.rsplit(".", 1)[1].lower() for p, _ in listing(ds)) == sorted(e[1:] for e in IMG_EXTENSIONS)


@pytest.mark.parametrize("bad", [".txt-only", "empty", "only-subfolders"])
def test_empty_class_folder_is_an_error_unless_allow_empty(tmp_path, bad):
    root = tmp_path / "root"
    touch(root / "a" / "1.png")
    touch(root / "c" / "sub" / "2.png")
    empty = root / "b"
    empty.mkdir(parents=True)
    if bad == ".txt-only":
        touch(empty / "notes.txt")
    elif bad == "only-subfolders":
        (empty / "x" / "y").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes b"):
        reference(root)
    with pytest.raises(FileNotFoundError) as e:
        open_dataset("t", folder(root), tmp_path / "cache", build=True)
    assert str(empty) in str(e.value) and "allow_empty" in str(e.value)

    classes, expected = reference(root, allow_empty=True)
    ds = open_dataset("t", folder(root, allow_empty=True), tmp_path / "cache", build=True)
    assert ds.classes == classes == ["a", "b", "c"]
    assert listing(ds) == expected == [("a/1.png", 0), ("c/sub/2.png", 2)]


def test_symlink_loop_is_an_error_not_a_hang(tmp_path):
    root = tmp_path / "root"
    touch(root / "a" / "1.png")
    os.symlink(root / "a", root / "a" / "again")
    with pytest.raises(ValueError, match="symlink loop"):
        open_dataset("t", folder(root), tmp_path / "cache", build=True)


def test_an_index_in_the_old_order_is_never_mapped(tmp_path, monkeypatch):
    """A cache_dir shared with an older batchd holds an index listed in the old order, under the
    name the old code gave it: workers must not map it, and the server replaces it."""
    root = nested_tree(tmp_path)
    cache = tmp_path / "cache"
    abs_root = os.path.abspath(root)
    old_extensions = sorted([".jpg", ".jpeg", ".png", ".bmp", ".webp", ".tif", ".tiff"])
    monkeypatch.setattr(_cache, "FORMAT_VERSION", 1)
    old_name = cache_path(cache, "imagefolder", abs_root, {"root": abs_root, "extensions": old_extensions})
    old_paths = ["alpha/a.JPEG", "alpha/x.png"]  # whatever it held
    with ArrayFileWriter(old_name) as w:
        data, offsets = pack_strings(old_paths)
        w.add("path_bytes", data)
        w.add("path_offsets", offsets)
        w.add("labels", np.zeros(2, np.int64))
        w.meta.update(kind="imagefolder", root=abs_root, classes=["alpha"])
    monkeypatch.undo()

    with pytest.raises(IndexMissingError):
        open_dataset("t", folder(root), cache, build=False)
    ds = open_dataset("t", folder(root), cache, build=True)
    assert listing(ds) == reference(root)[1]
    assert not old_name.exists()  # the stale index is gone
    assert [p.name for p in cache.glob("*.bidx")] != [old_name.name]
