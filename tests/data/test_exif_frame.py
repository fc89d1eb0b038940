"""The frame of an image and its targets: EXIF orientations 1-8, square and non-square images.

A JPEG's EXIF orientation says how to turn the stored pixels for display. COCO annotation tools,
pycocotools and torchvision's ``CocoDetection`` (which reads images with
``PIL.Image.open(path).convert("RGB")``) work in the stored pixels, and PNG masks carry no EXIF.
So by default ``kind: coco`` and ``kind: segmentation`` serve the stored pixels with the
annotations as they are; ``apply_exif_orientation: true`` turns image, boxes, masks (and a
segmentation's label mask) together.

Oracles, none of them batchd's reader: the reference reader (Pillow: ``Image.open().convert``,
and ``ImageOps.exif_transpose`` for the turned frame), pycocotools (tests/coco_oracle.py) for the
stored frame's targets, and the pixels themselves: every object is a rectangle of its own colour
on black (aligned to JPEG blocks and saved 4:4:4 at quality 100, so its colour survives the
codec), and in the served image every box must be the bounding box of its colour's pixels and
every mask exactly those pixels.

The kinds without targets (imagefolder, manifest, webdataset) serve the upright frame (EXIF
applied) in every reader: server decode, the decoded-sample cache and ``decode_on_client``.
"""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

import cv2
import numpy as np
import pytest
from PIL import Image, ImageOps

import batchd
import coco_oracle
from conftest import running_server
from helpers import exif_segment

pytestmark = pytest.mark.timeout(180)

SHAPES = ((96, 96), (96, 144))  # square and non-square (height, width)
COLOURS = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255)], np.uint8)  # object k is painted COLOURS[k]
ORIENTATIONS = range(1, 9)


def scene(h: int, w: int) -> tuple[np.ndarray, list[tuple[int, int, int, int]]]:
    """uint8 [h, w, 3] black with three rectangles (x0, y0, x1, y1) on 16-pixel blocks, placed
    so that no flip or quarter turn maps the layout onto itself."""
    boxes = [(16, 16, 64, 48), (w - 32, h - 32, w - 16, h), (0, h - 48, 16, h - 16)]
    image = np.zeros((h, w, 3), np.uint8)
    for (x0, y0, x1, y1), colour in zip(boxes, COLOURS):
        image[y0:y1, x0:x1] = colour
    return image, boxes


def jpeg(rgb: np.ndarray, orientation: int) -> bytes:
    """``rgb`` as a 4:4:4 quality-100 JPEG whose EXIF orientation is ``orientation``."""
    ok, buf = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR),
                           [cv2.IMWRITE_JPEG_QUALITY, 100,
                            cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_444])
    assert ok
    data = buf.tobytes()
    return data[:2] + exif_segment(orientation) + data[2:]


def add_image(images: list, annotations: list, file_name: str, h: int, w: int, boxes) -> None:
    """Append a COCO image entry and one rectangle annotation per box (category k + 1 for box k)."""
    img_id = len(images) + 1
    images.append({"id": img_id, "file_name": file_name, "height": h, "width": w})
    for k, (x0, y0, x1, y1) in enumerate(boxes):
        annotations.append({"id": len(annotations) + 1, "image_id": img_id, "category_id": k + 1,
                            "bbox": [x0, y0, x1 - x0, y1 - y0], "area": (x1 - x0) * (y1 - y0), "iscrowd": 0,
                            "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]]})


def write_png_mask(path: pathlib.Path, mask: np.ndarray) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(mask, mode="L").save(path)


@pytest.fixture(scope="module")
def photos(tmp_path_factory) -> pathlib.Path:
    """images/{h}x{w}-o{k}.jpg for each shape and orientation, masks/ (label masks: object k is
    k + 1), instances.json (COCO: a polygon per object, the stored frame's size), a manifest, a
    class folder tree and a WebDataset shard of the same JPEGs."""
    root = tmp_path_factory.mktemp("exif")
    images, coco_images, annotations = root / "images", [], []
    images.mkdir()
    for h, w in SHAPES:
        image, boxes = scene(h, w)
        label_mask = np.zeros((h, w), np.uint8)
        for k, (x0, y0, x1, y1) in enumerate(boxes):
            label_mask[y0:y1, x0:x1] = k + 1
        for o in ORIENTATIONS:
            stem = f"{h}x{w}-o{o}"
            (images / f"{stem}.jpg").write_bytes(jpeg(image, o))
            write_png_mask(root / "masks" / f"{stem}.png", label_mask)
            add_image(coco_images, annotations, f"{stem}.jpg", h, w, boxes)
    categories = [{"id": k + 1, "name": f"colour{k}"} for k in range(len(COLOURS))]
    (root / "instances.json").write_text(json.dumps({"images": coco_images, "annotations": annotations,
                                                     "categories": categories}))
    names = sorted(p.name for p in images.glob("*.jpg"))
    (root / "manifest.csv").write_text("path,label\n" + "".join(f"images/{n},0\n" for n in names))
    (root / "tree" / "a").mkdir(parents=True)
    with tarfile.open(root / "shard-000000.tar", "w") as tar:
        for i, n in enumerate(names):
            data = (images / n).read_bytes()
            (root / "tree" / "a" / n).write_bytes(data)
            for member, payload in ((f"{i:06d}.jpg", data), (f"{i:06d}.cls", b"0")):
                info = tarfile.TarInfo(member)
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return root


def pil_image(path: pathlib.Path, upright: bool) -> np.ndarray:
    """The reference reader: torchvision's ``CocoDetection._load_image`` (``Image.open(...).convert("RGB")``),
    after ``ImageOps.exif_transpose`` for the upright frame."""
    with Image.open(path) as im:
        return np.asarray((ImageOps.exif_transpose(im) if upright else im).convert("RGB"))


def colour_pixels(image: np.ndarray, k: int) -> np.ndarray:
    """bool [H, W]: the pixels of object k (its colour, within the codec's rounding)."""
    return (np.abs(image.astype(np.int16) - COLOURS[k]).max(-1) <= 8)


def assert_targets_cover_their_pixels(image, boxes, masks, labels, where: str) -> None:
    """Each box is the bounding box of its object's colour pixels; each mask is exactly them."""
    assert len(boxes) == len(COLOURS), where
    for box, mask, label in zip(boxes, masks, labels):
        pixels = colour_pixels(image, int(label) - 1)
        ys, xs = np.nonzero(pixels)
        assert len(xs), f"{where}: object {label} has no pixels in the served image"
        assert np.array_equal(np.asarray(box, np.float32), np.array([xs.min(), ys.min(), xs.max() + 1, ys.max() + 1],
                                                                     np.float32)), \
            f"{where}: box {list(box)} is not over object {label}'s pixels"
        assert np.array_equal(np.asarray(mask).astype(bool), pixels), f"{where}: mask of object {label} is off its pixels"


def served(address: str, dataset: str) -> list[dict]:
    """Every sample of ``dataset`` in order, fields as numpy arrays."""
    with batchd.RemoteDataLoader(address, dataset, batch_size=4, timeout=60) as loader:
        out = []
        for b in loader:
            for j in range(len(b["index"])):
                out.append({k: (v[j].numpy() if hasattr(v[j], "numpy") else v[j]) for k, v in b.items()})
    return out


@pytest.fixture(scope="module")
def server(photos, tmp_path_factory):
    coco = {"kind": "coco", "images": str(photos / "images"), "annotations": str(photos / "instances.json"),
            "masks": True}
    seg = {"kind": "segmentation", "images": str(photos / "images"), "masks": str(photos / "masks")}
    datasets = {"coco": coco, "coco-upright": {**coco, "apply_exif_orientation": True},
                "seg": seg, "seg-upright": {**seg, "apply_exif_orientation": True}}
    with running_server(workers=2, cache_dir=tmp_path_factory.mktemp("exif-cache"), datasets=datasets) as s:
        yield s


def test_coco_serves_the_stored_pixels_with_pycocotools_targets_by_default(server, photos):
    """Orientations 1-8, square and non-square: the image torchvision's CocoDetection reads (PIL,
    no EXIF turn), and the boxes and masks pycocotools gives, which cover their objects' pixels."""
    from pycocotools.coco import COCO

    coco = COCO(str(photos / "instances.json"))
    samples = served(server.address, "coco")
    assert len(samples) == len(SHAPES) * len(ORIENTATIONS)
    for s, img_id in zip(samples, sorted(coco.imgs)):
        name = coco.imgs[img_id]["file_name"]
        assert np.array_equal(s["image"], pil_image(photos / "images" / name, upright=False)), name
        want, _ = coco_oracle.expected(coco, img_id, masks=True)
        for field in ("boxes", "labels", "masks", "iscrowd", "area"):
            assert np.array_equal(s[field], want[field]), (name, field)
        assert_targets_cover_their_pixels(s["image"], s["boxes"], s["masks"], s["labels"], name)


def test_coco_with_apply_exif_orientation_turns_image_boxes_and_masks_together(server, photos):
    from pycocotools.coco import COCO

    coco = COCO(str(photos / "instances.json"))
    samples = served(server.address, "coco-upright")
    turned = 0
    for s, img_id in zip(samples, sorted(coco.imgs)):
        name = coco.imgs[img_id]["file_name"]
        assert np.array_equal(s["image"], pil_image(photos / "images" / name, upright=True)), name
        assert_targets_cover_their_pixels(s["image"], s["boxes"], s["masks"], s["labels"], name)
        turned += s["image"].shape[:2] != (coco.imgs[img_id]["height"], coco.imgs[img_id]["width"])
    assert turned == 4, "orientations 5-8 of the non-square image swap height and width"


@pytest.mark.parametrize("dataset, upright", [("seg", False), ("seg-upright", True)])
def test_segmentation_label_masks_stay_on_their_pixels(server, photos, dataset, upright):
    samples = served(server.address, dataset)
    names = sorted(p.name for p in (photos / "images").glob("*.jpg"))
    assert len(samples) == len(names) == len(SHAPES) * len(ORIENTATIONS)
    for s, name in zip(samples, names):
        assert np.array_equal(s["image"], pil_image(photos / "images" / name, upright)), name
        with Image.open(photos / "masks" / name.replace(".jpg", ".png")) as im:
            stored = np.asarray(im)
        if not upright:
            assert np.array_equal(s["mask"], stored), name
        for k in range(len(COLOURS)):
            assert np.array_equal(s["mask"] == k + 1, colour_pixels(s["image"], k)), f"{name}: label {k + 1}"


def test_kinds_without_targets_serve_the_upright_frame_in_every_reader(photos, tmp_path):
    """imagefolder, manifest and webdataset: the server's decode, a cache hit and
    decode_on_client give PIL's upright image (``ImageOps.exif_transpose``) for orientations 1-8."""
    names = sorted(p.name for p in (photos / "images").glob("*.jpg"))
    want = [pil_image(photos / "images" / n, upright=True) for n in names]
    datasets = {"folder": {"kind": "imagefolder", "root": str(photos / "tree")},
                "table": {"kind": "manifest", "path": str(photos / "manifest.csv")},
                "shards": {"kind": "webdataset", "shards": [str(photos / "shard-000000.tar")]}}
    with running_server(workers=1, cache_dir=tmp_path, datasets=datasets, cache={"memory_bytes": "8MiB"}) as s:
        for name in datasets:
            for options in ({}, {}, {"decode_on_client": True}):  # the second epoch: cache hits
                with batchd.RemoteDataLoader(s.address, name, batch_size=1, timeout=60, **options) as loader:
                    got = [b["image"][0].numpy() for b in loader]
                assert len(got) == len(want)
                for g, w, n in zip(got, want, names):
                    assert np.array_equal(g, w), (name, options, n)
        assert s.loader.cache.stats()["folder"]["hits"] > 0


@pytest.mark.parametrize("orientation", ORIENTATIONS)
def test_keypoints_and_label_masks_turn_with_the_pixels(orientation):
    """``orient_sample`` on a sample with keypoints (no built-in kind reads keypoints from JPEGs
    yet; a python dataset could): each keypoint, a pixel index, still names the pixel of the same
    value in the turned image, and the image is Pillow's ``exif_transpose`` of the stored one."""
    from batchd.server.data.datasets._orientation import orient_sample

    rng = np.random.default_rng(orientation)
    h, w = 6, 9
    image = rng.integers(0, 256, (h, w, 3), np.uint8)
    ys, xs = rng.integers(0, h, 5), rng.integers(0, w, 5)
    keypoints = np.stack([xs, ys, np.full(5, 2)], -1).astype(np.float32).reshape(1, 5, 3)
    mask = rng.integers(0, 4, (h, w)).astype(np.uint8)
    out = orient_sample({"image": image, "mask": mask, "keypoints": keypoints, "label": 3}, orientation)
    with Image.open(io.BytesIO(jpeg(image, orientation))) as im:  # Pillow's turn of a JPEG with this tag
        turned_shape = np.asarray(ImageOps.exif_transpose(im)).shape
    assert out["image"].shape == turned_shape and out["label"] == 3
    pil = Image.fromarray(image)
    pil.getexif()[0x0112] = orientation
    want = np.asarray(ImageOps.exif_transpose(pil))
    assert np.array_equal(out["image"], want)
    for (x, y, v), (x0, y0, _) in zip(out["keypoints"][0], keypoints[0]):
        assert v == 2 and np.array_equal(out["image"][int(y), int(x)], image[int(y0), int(x0)])
    label_pil = Image.fromarray(mask)
    label_pil.getexif()[0x0112] = orientation
    assert np.array_equal(out["mask"], np.asarray(ImageOps.exif_transpose(label_pil)))


# how Pillow turns a stored image upright for each orientation (ImageOps.exif_transpose), undone
TO_STORED = {1: None, 2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180,
             4: Image.Transpose.FLIP_TOP_BOTTOM, 5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_90,
             7: Image.Transpose.TRANSVERSE, 8: Image.Transpose.ROTATE_270}


@pytest.fixture(scope="module")
def upright_photos(tmp_path_factory) -> pathlib.Path:
    """A web annotation tool's output for EXIF-turned photos: for each shape and orientation, a
    JPEG whose stored pixels Pillow turns upright (``exif_transpose``) into ``scene``, and a COCO
    file whose boxes, polygons, width and height are the upright scene's."""
    root = tmp_path_factory.mktemp("exif-upright")
    (root / "images").mkdir()
    coco_images, annotations = [], []
    for h, w in SHAPES:
        upright, boxes = scene(h, w)
        for o in ORIENTATIONS:
            stored = Image.fromarray(upright)
            stored = np.asarray(stored if TO_STORED[o] is None else stored.transpose(TO_STORED[o]))
            path = root / "images" / f"{h}x{w}-o{o}.jpg"
            path.write_bytes(jpeg(stored, o))
            assert (np.abs(pil_image(path, upright=True).astype(int) - upright).max() <= 8), (o, "not upright")
            add_image(coco_images, annotations, path.name, h, w, boxes)
    categories = [{"id": k + 1, "name": f"colour{k}"} for k in range(len(COLOURS))]
    (root / "instances.json").write_text(json.dumps({"images": coco_images, "annotations": annotations,
                                                     "categories": categories}))
    return root


def test_annotations_made_on_the_upright_photo_are_served_with_annotations_frame_upright(upright_photos, photos,
                                                                                         tmp_path):
    """``annotations_frame: upright``: the image Pillow shows upright, the boxes and masks
    pycocotools reads from the file as they are, each over its object's pixels, for orientations
    1-8, square included (before, a square photo was served misaligned without a word). The
    default frame gives the non-square turned ones a SampleError naming the EXIF orientation and
    the option; the option on a stored-frame file names the other."""
    from pycocotools.coco import COCO

    coco = {"kind": "coco", "images": str(upright_photos / "images"),
            "annotations": str(upright_photos / "instances.json"), "masks": True}
    stored = {"kind": "coco", "images": str(photos / "images"), "annotations": str(photos / "instances.json"),
              "masks": True, "annotations_frame": "upright"}
    datasets = {"upright": {**coco, "annotations_frame": "upright"}, "default": coco, "wrong": stored}
    with running_server(workers=1, cache_dir=tmp_path, datasets=datasets) as s:
        samples = served(s.address, "upright")
        reference = COCO(str(upright_photos / "instances.json"))
        assert len(samples) == len(SHAPES) * len(ORIENTATIONS)
        for sample, img_id in zip(samples, sorted(reference.imgs)):
            name = reference.imgs[img_id]["file_name"]
            assert np.array_equal(sample["image"], pil_image(upright_photos / "images" / name, upright=True)), name
            want, _ = coco_oracle.expected(reference, img_id, masks=True)
            for field in ("boxes", "labels", "masks"):
                assert np.array_equal(sample[field], want[field]), (name, field)
            assert_targets_cover_their_pixels(sample["image"], sample["boxes"], sample["masks"], sample["labels"], name)
        for dataset, says in (("default", r"the image is 96x144 pixels, but the annotation file says 144x96; its "
                                          r"EXIF orientation is [5-8] .*set annotations_frame: upright on the dataset"),
                              ("wrong", r"the image is 96x144 pixels once turned upright, but the annotation file "
                                        r"says 144x96; annotations_frame: upright turned it by its EXIF orientation "
                                        r"[5-8].*set annotations_frame: stored")):
            with pytest.raises(batchd.SampleError, match=says):
                served(s.address, dataset)
