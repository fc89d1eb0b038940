"""Make a small detection and segmentation dataset from real Fashion-MNIST pixels.

Each canvas holds 0 to ``--max-items`` Fashion-MNIST items (real images, real classes) at random
scales and places on a dark, smoothly varying background; later items cover earlier ones, and
some canvases are empty. An item's silhouette is its pixels above ``THRESHOLD`` after scaling;
what stays visible of it is its mask. Written under ``--out``::

    images/train/000000.jpg ...            the canvases (JPEG, quality 90), sizes vary
    images/val/000000.jpg ...              val canvases use Fashion-MNIST's test items
    annotations/instances_train.json       COCO "instances": boxes, masks, categories
    annotations/instances_val.json
    masks/train/000000.png ...             VOC-style: palette PNG of class indices (category id,
    masks/val/000000.png ...               0 background), 255 on a 3-pixel band along item borders

COCO annotations: ``bbox`` is the visible mask's tight box [x, y, w, h] in pixels, ``area`` its
pixel count, ``category_id`` the Fashion-MNIST class + 1 (1..10, names in ``CLASSES``).
``segmentation``: polygons for about 60% (one part per visible piece: an item cut in two by
another has two), compressed RLE for about 20%, uncompressed RLE for the rest, and for the
``iscrowd: 1`` ones (about 5%, as COCO writes crowds). A fully covered item has no annotation.

Everything is a pure function of (``--seed``, split, canvas number): canvas i does not depend on
how many are made. Needs numpy, OpenCV, Pillow and pycocotools (``pip install 'batchd[coco]'``).

    python examples/make_fashion_coco.py --out /tmp/fashion-coco --images 2000 --seed 0
"""

from __future__ import annotations

import argparse
import functools
import gzip
import json
import pathlib
import time

import cv2
import numpy as np

CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
FILES = {"train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
         "val": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz")}
THRESHOLD = 40  # an item's pixel belongs to its silhouette above this grey value (0..255)
BORDER = 255  # VOC's "ignore" value on object borders
SPLIT_KEY = {"train": 0, "val": 1}
JPEG_QUALITY = 90


def voc_palette() -> list[int]:
    """Pascal VOC's colour map: 256 RGB entries, flat (index i's bits spread over R, G, B)."""
    palette = []
    for i in range(256):
        r = g = b = 0
        c = i
        for j in range(8):
            r |= ((c >> 0) & 1) << (7 - j)
            g |= ((c >> 1) & 1) << (7 - j)
            b |= ((c >> 2) & 1) << (7 - j)
            c >>= 3
        palette += [r, g, b]
    return palette


@functools.lru_cache(maxsize=4)
def read_fashion_mnist(root: pathlib.Path, split: str) -> tuple[np.ndarray, np.ndarray]:
    """(images uint8 [n, 28, 28], labels uint8 [n]) of Fashion-MNIST's train (``split`` "train")
    or test ("val") IDX files (read-only arrays, read once per process)."""
    images_file, labels_file = FILES[split]
    with gzip.open(root / images_file, "rb") as f:
        images = np.frombuffer(f.read(), dtype=np.uint8, offset=16).reshape(-1, 28, 28)
    with gzip.open(root / labels_file, "rb") as f:
        labels = np.frombuffer(f.read(), dtype=np.uint8, offset=8)
    return images, labels


def uncompressed_rle(mask: np.ndarray) -> list[int]:
    """COCO's uncompressed RLE counts of a 0/1 mask [H, W]: run lengths in column-major order,
    starting with a (possibly empty) run of zeros."""
    flat = mask.ravel(order="F").astype(np.int8)
    change = np.flatnonzero(np.diff(flat)) + 1
    bounds = np.concatenate([[0], change, [flat.size]])
    runs = np.diff(bounds).tolist()
    return runs if flat[0] == 0 else [0] + runs


def polygons(mask: np.ndarray) -> list[list[float]] | None:
    """The outer contours of a 0/1 mask as COCO polygons [x1, y1, x2, y2, ...] (pixel centres
    + 0.5), one per visible piece; None if a piece has fewer than 3 corners (a line or a dot,
    which a polygon cannot outline)."""
    contours, _ = cv2.findContours(mask, cv2.RETR_EXTERNAL, cv2.CHAIN_APPROX_SIMPLE)
    if any(len(c) < 3 for c in contours):
        return None
    return [[float(v) + 0.5 for v in c.reshape(-1).tolist()] for c in contours]


def background(rng: np.random.Generator, h: int, w: int) -> np.ndarray:
    """A dark, smoothly varying RGB background uint8 [h, w, 3] with a little grain."""
    coarse = rng.integers(0, 70, (4, 4, 3), dtype=np.uint8)
    smooth = cv2.resize(coarse, (w, h), interpolation=cv2.INTER_LINEAR)
    return smooth + rng.integers(0, 9, (h, w, 3), dtype=np.uint8)


def make_canvas(rng: np.random.Generator, items: np.ndarray, labels: np.ndarray, *, min_size: int, max_size: int,
                max_items: int, empty: float):
    """(image uint8 [H, W, 3], instance map int32 [H, W] (0: background, k + 1: item k), the
    items' category ids)."""
    h, w = (int(v) for v in rng.integers(min_size, max_size + 1, 2))
    image = background(rng, h, w)
    instances = np.zeros((h, w), dtype=np.int32)
    n = 0 if rng.random() < empty else int(rng.integers(1, max_items + 1))
    categories = []
    for k in range(n):
        pick = int(rng.integers(len(items)))
        side = int(28 * rng.uniform(1.0, 3.0))
        grey = cv2.resize(items[pick], (side, side), interpolation=cv2.INTER_LINEAR)
        colour = rng.integers(90, 256, 3).astype(np.float32)
        # at least a quarter of the item's side inside the canvas each way
        y0, x0 = (int(rng.integers(-side // 4, max(n - side * 3 // 4, 1 - side // 4))) for n in (h, w))
        ys, xs = slice(max(y0, 0), min(y0 + side, h)), slice(max(x0, 0), min(x0 + side, w))
        crop = grey[ys.start - y0:ys.stop - y0, xs.start - x0:xs.stop - x0]
        silhouette = crop > THRESHOLD
        image[ys, xs][silhouette] = (crop[silhouette, None] / 255.0 * colour).astype(np.uint8)
        instances[ys, xs][silhouette] = k + 1
        categories.append(int(labels[pick]) + 1)
    return image, instances, categories


def annotate(rng: np.random.Generator, instances: np.ndarray, categories: list[int], image_id: int,
             next_id: int, mask_utils) -> list[dict]:
    """The COCO annotations of a canvas's visible items, ids from ``next_id``."""
    anns = []
    for k, category in enumerate(categories):
        mask = (instances == k + 1).astype(np.uint8)
        area = cv2.countNonZero(mask)
        if area == 0:
            continue  # covered by later items
        crowd = rng.random() < 0.05
        kind = rng.random()
        segmentation = None
        if not crowd and kind < 0.6:
            segmentation = polygons(mask)
        if segmentation is None and not crowd and kind < 0.8:
            counts = mask_utils.encode(np.asfortranarray(mask))["counts"].decode("ascii")
            segmentation = {"size": list(mask.shape), "counts": counts}
        if segmentation is None:
            segmentation = {"size": list(mask.shape), "counts": uncompressed_rle(mask)}
        anns.append({"id": next_id + len(anns), "image_id": image_id, "category_id": category,
                     "bbox": list(cv2.boundingRect(mask)), "area": float(area),
                     "iscrowd": int(crowd), "segmentation": segmentation})
    return anns


def voc_mask(instances: np.ndarray, categories: list[int]) -> np.ndarray:
    """Class indices uint8 [H, W] (category id per item pixel, 0 elsewhere), ``BORDER`` where a
    3x3 neighbourhood holds more than one instance (VOC marks object borders so)."""
    lut = np.array([0] + categories, dtype=np.uint8)
    classes = lut[instances]
    kernel = np.ones((3, 3), np.uint8)
    inst = instances.astype(np.float32)
    classes[cv2.dilate(inst, kernel) != cv2.erode(inst, kernel)] = BORDER
    return classes


def make_split(out: pathlib.Path, split: str, count: int, seed: int, fmnist: pathlib.Path, *, min_size: int = 96,
               max_size: int = 160, max_items: int = 5, empty: float = 0.05) -> dict:
    """Write ``count`` canvases of ``split`` ("train" or "val") under ``out``; its COCO dict."""
    from PIL import Image
    from pycocotools import mask as mask_utils

    items, labels = read_fashion_mnist(fmnist, split)
    palette = voc_palette()
    image_dir, mask_dir = out / "images" / split, out / "masks" / split
    image_dir.mkdir(parents=True, exist_ok=True)
    mask_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for i in range(count):
        rng = np.random.default_rng([seed, SPLIT_KEY[split], i])
        image, instances, categories = make_canvas(rng, items, labels, min_size=min_size, max_size=max_size,
                                                   max_items=max_items, empty=empty)
        name = f"{i:06d}"
        ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, JPEG_QUALITY])
        assert ok
        (image_dir / f"{name}.jpg").write_bytes(jpeg.tobytes())
        png = Image.fromarray(voc_mask(instances, categories), mode="P")
        png.putpalette(palette)
        png.save(mask_dir / f"{name}.png", optimize=False)
        images.append({"id": i + 1, "file_name": f"{name}.jpg", "height": image.shape[0], "width": image.shape[1]})
        annotations += annotate(rng, instances, categories, i + 1, len(annotations) + 1, mask_utils)
    coco = {"info": {"description": f"Fashion-MNIST items on canvases ({split}), make_fashion_coco.py seed {seed}"},
            "licenses": [], "images": images, "annotations": annotations,
            "categories": [{"id": c + 1, "name": n, "supercategory": "fashion"} for c, n in enumerate(CLASSES)]}
    (out / "annotations").mkdir(parents=True, exist_ok=True)
    (out / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))
    return coco


def ensure(out: pathlib.Path, images: int, val_images: int | None = None, seed: int = 0,
           fmnist: pathlib.Path = pathlib.Path("/usr/share/datasets/fashion-mnist")) -> pathlib.Path:
    """``out``, generated (``main``'s defaults otherwise) unless it already holds ``images`` train
    and ``val_images`` (default ``images // 5``) val canvases of ``seed``. Returns ``out``."""
    val = images // 5 if val_images is None else val_images
    try:
        done = [json.loads((out / "annotations" / f"instances_{split}.json").read_text()) for split in ("train", "val")]
        if [len(d["images"]) for d in done] == [images, val] and done[0]["info"]["description"].endswith(f"seed {seed}"):
            return out
    except (OSError, ValueError, KeyError):
        pass
    main(["--out", str(out), "--images", str(images), "--val-images", str(val), "--seed", str(seed),
          "--fmnist", str(fmnist)])
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=pathlib.Path, required=True, help="folder to write (created)")
    parser.add_argument("--images", type=int, default=2000, help="train canvases (default 2000)")
    parser.add_argument("--val-images", type=int, default=None, help="val canvases (default: a fifth of --images)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-size", type=int, default=96, help="smallest canvas side, pixels")
    parser.add_argument("--max-size", type=int, default=160, help="largest canvas side, pixels")
    parser.add_argument("--max-items", type=int, default=5, help="most items on a canvas")
    parser.add_argument("--empty", type=float, default=0.05, help="fraction of canvases left empty")
    parser.add_argument("--fmnist", type=pathlib.Path, default=pathlib.Path("/usr/share/datasets/fashion-mnist"),
                        help="folder of Fashion-MNIST's IDX .gz files")
    args = parser.parse_args(argv)
    if not 28 <= args.min_size <= args.max_size:
        parser.error("need 28 <= --min-size <= --max-size")
    start = time.perf_counter()
    val = args.images // 5 if args.val_images is None else args.val_images
    for split, count in (("train", args.images), ("val", val)):
        if count:
            coco = make_split(args.out, split, count, args.seed, args.fmnist, min_size=args.min_size,
                              max_size=args.max_size, max_items=args.max_items, empty=args.empty)
            print(f"{split}: {count} images, {len(coco['annotations'])} annotations")
    print(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
