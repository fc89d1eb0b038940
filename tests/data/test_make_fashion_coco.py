"""examples/make_fashion_coco.py: deterministic from its seed, statistically what it says, and its
COCO annotations agree with its pixels and with its VOC-style masks."""

from __future__ import annotations

import math
import pathlib

import cv2
import numpy as np
import pytest
from PIL import Image
from pycocotools import mask as mask_utils
from pycocotools.coco import COCO

from helpers import load_example

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def gen():
    return load_example("make_fashion_coco")


def files(root: pathlib.Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_same_bytes_other_seed_other_data(gen, fmnist_root, tmp_path):
    def make(name, seed, n):
        gen.main(["--out", str(tmp_path / name), "--images", str(n), "--val-images", "3", "--seed", str(seed),
                  "--fmnist", str(fmnist_root)])
        return files(tmp_path / name)

    a, b = make("a", 7, 12), make("b", 7, 12)
    assert a == b and len(a) == 2 * (12 + 3) + 2
    c = make("c", 8, 12)
    differ = [k for k in a if k.endswith(".jpg") and a[k] != c.get(k)]
    assert len(differ) >= 10
    # canvas i depends on (seed, split, i) only, not on how many are made
    d = make("d", 7, 5)
    assert all(d[k] == a[k] for k in d if k.endswith((".jpg", ".png")))


def test_the_statistics_are_what_the_generator_says(gen, fmnist_root, tmp_path):
    n = 300
    coco = gen.make_split(tmp_path, "train", n, seed=3, fmnist=fmnist_root, empty=0.1)
    anns = coco["annotations"]
    per_image = np.bincount([a["image_id"] for a in anns], minlength=n + 1)[1:]
    empty = int((per_image == 0).sum())
    sd = math.sqrt(n * 0.1 * 0.9)
    assert abs(empty - n * 0.1) < 4 * sd, empty  # --empty 0.1 (a fully covered canvas is rare)
    # classes: Fashion-MNIST's are balanced, items are drawn uniformly: chi-square with 9 dof
    counts = np.bincount([a["category_id"] for a in anns], minlength=11)[1:]
    expected = len(anns) / 10
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    assert chi2 < 27.9, counts  # p = 0.001
    crowd = sum(a["iscrowd"] for a in anns)
    assert abs(crowd - 0.05 * len(anns)) < 4 * math.sqrt(len(anns) * 0.05 * 0.95)
    polygons = sum(isinstance(a["segmentation"], list) for a in anns)
    assert 0.45 < polygons / len(anns) < 0.62  # 60% of non-crowds, a few tiny ones fall back to RLE
    sizes = {(im["height"], im["width"]) for im in coco["images"]}
    assert min(min(s) for s in sizes) >= 96 and max(max(s) for s in sizes) <= 160 and len(sizes) > 100


def test_annotations_agree_with_the_pixels_and_the_voc_masks(fashion_coco):
    root = fashion_coco
    coco = COCO(str(root / "annotations" / "instances_train.json"))
    checked = polygons = 0
    for img_id, img in coco.imgs.items():
        stem = img["file_name"].rsplit(".", 1)[0]
        with Image.open(root / "masks" / "train" / f"{stem}.png") as im:
            assert im.mode == "P"
            voc = np.asarray(im)
        assert voc.shape == (img["height"], img["width"])
        anns = coco.loadAnns(coco.getAnnIds(imgIds=img_id))
        if not anns:
            assert set(np.unique(voc).tolist()) == {0}
        for a in anns:
            mask = coco.annToMask(a).astype(bool)
            if isinstance(a["segmentation"], list):
                # an outline through the item's edge pixels' centres: half a pixel inside it, so
                # a sliver of one or two pixels may fall out; the box's sides stay within 2 pixels
                box = mask_utils.toBbox(mask_utils.encode(np.asfortranarray(mask.astype(np.uint8))))
                xyxy = lambda b: np.array([b[0], b[1], b[0] + b[2], b[1] + b[3]], np.float64)  # noqa: E731
                assert np.abs(xyxy(box) - xyxy(a["bbox"])).max() <= 2.0
                if a["area"] >= 50:
                    assert mask.sum() > 0.5 * a["area"]
                polygons += 1
                continue
            ys, xs = np.nonzero(mask)  # RLE: the exact visible pixels
            assert a["bbox"] == [xs.min(), ys.min(), xs.max() - xs.min() + 1, ys.max() - ys.min() + 1]
            assert a["area"] == mask.sum()
            assert set(np.unique(voc[mask]).tolist()) <= {a["category_id"], 255}
            interior = cv2.erode(mask.astype(np.uint8), np.ones((3, 3), np.uint8), borderType=cv2.BORDER_REPLICATE) > 0
            assert (voc[interior] == a["category_id"]).all()  # 255 only along borders
            checked += 1
    assert checked > 20 and polygons > 20
    assert coco.dataset["categories"][0] == {"id": 1, "name": "T-shirt/top", "supercategory": "fashion"}


def test_uncompressed_rle_is_pycocotools_own(gen):
    rng = np.random.default_rng(0)
    for _ in range(20):
        mask = (rng.random((int(rng.integers(1, 30)), int(rng.integers(1, 30)))) < 0.5).astype(np.uint8)
        rle = {"size": list(mask.shape), "counts": gen.uncompressed_rle(mask)}
        np.testing.assert_array_equal(mask_utils.decode(mask_utils.frPyObjects(rle, *mask.shape)), mask)


def test_voc_palette_is_pascal_voc(gen):
    palette = np.array(gen.voc_palette()).reshape(256, 3)
    assert palette[:4].tolist() == [[0, 0, 0], [128, 0, 0], [0, 128, 0], [128, 128, 0]]
    assert palette[15].tolist() == [192, 128, 128] and palette[255].tolist() == [224, 224, 192]
    assert len({tuple(c) for c in palette}) == 256
