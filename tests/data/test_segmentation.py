"""kind: segmentation: image and mask folders paired by stem; palette PNGs read as class indices.

The oracle for a mask is Pillow's own reading of the file (``np.asarray(Image.open(f))``: palette
indices for a "P" image), checked against OpenCV, which expands a palette to its colours.
"""

from __future__ import annotations

import pathlib

import cv2
import numpy as np
import pytest
from PIL import Image

from batchd.errors import SampleError
from batchd.server.config import SegmentationConfig
from batchd.server.data.datasets import open_dataset

pytestmark = pytest.mark.timeout(60)


def seg_dataset(images, masks, cache_dir, build=True, **kw):
    cfg = SegmentationConfig(kind="segmentation", images=images, masks=masks, **kw)
    return open_dataset("voc", cfg, cache_dir, build=build)


def write_palette_png(path: pathlib.Path, indices: np.ndarray, palette: list[int] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    im = Image.fromarray(indices.astype(np.uint8), mode="P")
    im.putpalette(palette or [v for i in range(256) for v in ((i * 37) % 256, (i * 91) % 256, (i * 53) % 256)])
    im.save(path)


@pytest.fixture
def folders(tmp_path) -> tuple[pathlib.Path, pathlib.Path]:
    """images/{a,b,sub/c}.jpg and masks/{a,b,sub/c}.png (palette, values 0..3 and 255)."""
    rng = np.random.default_rng(1)
    for stem in ("b", "a", "sub/c"):
        h, w = (int(v) for v in rng.integers(10, 30, 2))
        (tmp_path / "images" / stem).parent.mkdir(parents=True, exist_ok=True)
        cv2.imwrite(str(tmp_path / "images" / f"{stem}.jpg"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
        mask = rng.integers(0, 4, (h, w)).astype(np.uint8)
        mask[0] = 255
        write_palette_png(tmp_path / "masks" / f"{stem}.png", mask)
    return tmp_path / "images", tmp_path / "masks"


def test_generated_voc_masks_are_read_as_class_indices(fashion_coco, tmp_path):
    images, masks = fashion_coco / "images" / "train", fashion_coco / "masks" / "train"
    ds = seg_dataset(images, masks, tmp_path)
    stems = sorted(p.stem for p in images.glob("*.jpg"))
    assert len(ds) == len(stems) == 60
    seen = set()
    for i, stem in enumerate(stems):
        sample = ds.load_sample(i)
        assert set(sample) == {"image", "mask"} and ds.source(i) == f"{stem}.jpg"
        with Image.open(masks / f"{stem}.png") as im:
            assert im.mode == "P"
            want = np.asarray(im)
        assert sample["mask"].dtype == np.uint8
        np.testing.assert_array_equal(sample["mask"], want)
        np.testing.assert_array_equal(sample["image"], cv2.cvtColor(cv2.imread(str(images / f"{stem}.jpg")), cv2.COLOR_BGR2RGB))
        seen |= set(np.unique(sample["mask"]).tolist())
    assert seen <= set(range(11)) | {255} and 255 in seen and len(seen) > 5  # classes 1..10, borders 255
    # OpenCV alone expands the palette to colours: the reason the kind reads masks with Pillow
    bgr = cv2.imread(str(masks / f"{stems[0]}.png"), cv2.IMREAD_UNCHANGED)
    assert bgr.ndim == 3 and bgr.shape[2] == 3
    assert ds.info == {"ignore_index": "255"} and ds.classes == []
    assert [(f.name, f.dtype, f.shape) for f in ds.fields] == [("image", "uint8", (-1, -1, 3)), ("mask", "uint8", (-1, -1))]


def test_order_subfolders_classes_and_worker_open(folders, tmp_path):
    images, masks = folders
    ds = seg_dataset(images, masks, tmp_path / "cache", classes=["bg", "x", "y", "z"], ignore_index=None)
    assert [ds.source(i) for i in range(3)] == ["a.jpg", "b.jpg", "sub/c.jpg"]
    assert [ds.mask_source(i) for i in range(3)] == ["a.png", "b.png", "sub/c.png"]
    assert ds.classes == ["bg", "x", "y", "z"] and ds.info == {"ignore_index": "none"}
    worker = seg_dataset(images, masks, tmp_path / "cache", build=False, classes=["bg", "x", "y", "z"], ignore_index=None)
    for i in range(3):
        a, b = ds.load_sample(i), worker.load_sample(i)
        np.testing.assert_array_equal(a["mask"], b["mask"])
        assert a["mask"].shape == a["image"].shape[:2]
    with pytest.raises(TypeError, match="no per-sample label"):
        ds.label(0)
    np.testing.assert_array_equal(ds.load_image(2), ds.load_sample(2)["image"])


def test_unpaired_stems_are_errors_naming_them(folders, tmp_path):
    images, masks = folders
    (masks / "b.png").rename(tmp_path / "b.png")
    with pytest.raises(FileNotFoundError, match=rf"1 image\(s\) in {images} without a mask in {masks}: b\.jpg"):
        seg_dataset(images, masks, tmp_path / "cache")
    (tmp_path / "b.png").rename(masks / "b.png")
    write_palette_png(masks / "extra" / "d.png", np.zeros((4, 4)))
    with pytest.raises(FileNotFoundError, match=rf"1 mask\(s\) in {masks} without an image in {images}: extra/d\.png"):
        seg_dataset(images, masks, tmp_path / "cache")
    cv2.imwrite(str(images / "a.png"), np.zeros((4, 4, 3), np.uint8))
    with pytest.raises(ValueError, match=r"a\.jpg and a\.png are two images with the stem 'a'"):
        seg_dataset(images, masks, tmp_path / "cache")


def test_split_file_picks_and_orders_the_stems(folders, tmp_path):
    images, masks = folders
    split = tmp_path / "train.txt"
    split.write_text("sub/c\n\nb\n")
    write_palette_png(masks / "unused.png", np.zeros((4, 4)))  # not in the split: ignored
    ds = seg_dataset(images, masks, tmp_path / "cache", split_file=split)
    assert [ds.source(i) for i in range(len(ds))] == ["sub/c.jpg", "b.jpg"]
    split.write_text("b\nzz\n")
    with pytest.raises(FileNotFoundError, match=rf"1 stem\(s\) of {split} without an image in {images}: zz"):
        seg_dataset(images, masks, tmp_path / "cache", split_file=split)
    split.write_text("b\na\nb\n")
    with pytest.raises(ValueError, match=r"line 3 lists 'b' again \(first on line 1\)"):
        seg_dataset(images, masks, tmp_path / "cache", split_file=split)


@pytest.mark.parametrize("write,reason", [
    (lambda p: write_palette_png(p, np.zeros((3, 3))), r"the mask is 3x3 pixels, its image a\.jpg"),
    (lambda p: cv2.imwrite(str(p), np.zeros((9, 9, 3), np.uint8)), "mask has mode RGB; expected class indices"),
    (lambda p: cv2.imwrite(str(p), np.zeros((9, 9), np.uint16)), "mask has mode I;16"),
    (lambda p: p.write_bytes(b"not a png"), "not a decodable mask"),
])
def test_bad_masks_are_sample_errors_naming_the_mask(folders, tmp_path, write, reason):
    images, masks = folders
    write(masks / "a.png")
    ds = seg_dataset(images, masks, tmp_path / "cache")
    with pytest.raises(SampleError, match=reason) as e:
        ds.load_sample(0)
    assert e.value.path == "a.png" and e.value.index == 0 and e.value.dataset == "voc"
    ds.load_sample(1)  # the others still load


def test_greyscale_and_missing_masks(folders, tmp_path):
    images, masks = folders
    grey = np.arange(20 * 20, dtype=np.uint8).reshape(20, 20) % 7
    h, w = cv2.imread(str(images / "a.jpg")).shape[:2]
    grey = np.resize(grey, (h, w))
    cv2.imwrite(str(masks / "a.png"), grey)  # 8-bit greyscale ("L"): the values as they are
    ds = seg_dataset(images, masks, tmp_path / "cache")
    np.testing.assert_array_equal(ds.load_sample(0)["mask"], grey)
    (masks / "b.png").unlink()
    with pytest.raises(SampleError, match=r"b\.png.*No such file") as e:
        ds.load_sample(1)
    assert e.value.path == "b.png"


def test_fingerprint_follows_both_folders(folders, tmp_path):
    images, masks = folders
    a = seg_dataset(images, masks, tmp_path / "cache").fingerprint
    assert seg_dataset(images, masks, tmp_path / "cache").fingerprint == a
    write_palette_png(masks / "b.png", np.ones((5, 5)))
    b = seg_dataset(images, masks, tmp_path / "cache").fingerprint
    assert b != a


def test_config_names_a_typo_and_checks_ignore_index(tmp_path):
    from pydantic import ValidationError

    from batchd.server.config import ServerConfig

    ok = {"kind": "segmentation", "images": "/i", "masks": "/m"}
    assert ServerConfig.model_validate({"datasets": {"voc": ok}}).datasets["voc"].ignore_index == 255
    with pytest.raises(ValidationError, match="split_files"):
        ServerConfig.model_validate({"datasets": {"voc": {**ok, "split_files": "/s.txt"}}})
    with pytest.raises(ValidationError, match="ignore_index"):
        ServerConfig.model_validate({"datasets": {"voc": {**ok, "ignore_index": 256}}})
    with pytest.raises(ValidationError, match="mask_extensions"):
        ServerConfig.model_validate({"datasets": {"voc": {**ok, "mask_extensions": ["png"]}}})
    with pytest.raises(ValidationError, match="skip_emtpy"):
        ServerConfig.model_validate({"datasets": {"det": {"kind": "coco", "images": "/i", "annotations": "/a.json",
                                                          "skip_emtpy": True}}})
