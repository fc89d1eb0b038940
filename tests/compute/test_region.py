"""Region decoding (server/compute/region.py) against a full decode, over the random crop family.

The oracle is albumentations' own ``Compose.__call__`` on a full decode (``decode_rgb`` with
OpenCV, as ``reduced_decode: false`` decodes), under the same sample stream: the region path
draws the first transform's params ahead of decoding, decodes at m/8 and runs the rest. For every
crop of the family and every bbox format:

- the stream is consumed exactly as by the full decode (its next words after the sample are the
  same), so every later transform drew the same;
- targets equal the full decode's, bit for bit: boxes (one covers the whole image, so its output
  is the crop window: the same crop params), labels, masks, keypoints (the image's corners too);
- images are within ``region.PIXEL_BOUND`` (mean PSNR >= 32 dB, none under 20 dB), and decodes at
  m/8 < 1 did happen (a test that always fell back to a full decode would prove nothing).

Through a real server (``kind: coco``, masks, EXIF orientation 6 and 3 turned with the image):
the same, with the crop params read from the worker's output (the whole-image box), and the
server's decode counters by kind. The photos are cut from Debian's mate-backgrounds (``make
install`` installs it), 1,000-1,400 px wide: real photographs, whose fine detail a full decode's
bilinear resize aliases and a scaled decode averages.
"""

from __future__ import annotations

import json
import math
import pathlib

import albumentations as A
import cv2
import numpy as np
import pytest

from batchd.server.compute import pipeline as pipelines
from batchd.server.compute import region
from batchd.server.compute.targets import TargetPipeline
from batchd.server.data.decode import decode_rgb, upright_size
from helpers import exif_segment

pytestmark = pytest.mark.timeout(120)

MATE = pathlib.Path("/usr/share/backgrounds/mate/nature")
FORMATS = ("pascal_voc", "coco", "yolo", "albumentations")
FIRSTS = {
    "RandomResizedCrop": A.RandomResizedCrop(size=(224, 224)),
    "RandomResizedCrop-small": A.RandomResizedCrop(size=(160, 192), scale=(0.02, 0.3), ratio=(0.5, 2.0)),
    "RandomResizedCrop-p0.7-cubic": A.RandomResizedCrop(size=(224, 224), interpolation=cv2.INTER_CUBIC, p=0.7),
    "RandomResizedCrop-area": A.RandomResizedCrop(size=(128, 128), area_for_downscale="image_mask"),
    "RandomSizedCrop": A.RandomSizedCrop(min_max_height=(300, 900), size=(200, 240), w2h_ratio=1.2),
}
REST = (A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5), A.Affine(rotate=(-10, 10), p=0.5))
KEY = np.array([0x5EED, 40], np.uint64)


def photo_jpegs(n: int, seed: int = 0) -> list[bytes]:
    """``n`` JPEGs (quality 90) 1,000-1,400 px wide, each a random 40-100% cut of a mate photo."""
    sources = sorted(MATE.glob("*.jpg"))
    if not sources:
        pytest.skip(f"no photos in {MATE} (apt-get install mate-backgrounds; make install does)")
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        photo = cv2.imread(str(sources[i % len(sources)]))
        h, w = photo.shape[:2]
        area = rng.uniform(0.4, 1.0)
        ch, cw = int(h * math.sqrt(area)), int(w * math.sqrt(area))
        y0, x0 = int(rng.integers(0, h - ch + 1)), int(rng.integers(0, w - cw + 1))
        width = int(rng.integers(1000, 1401))
        cut = cv2.resize(photo[y0:y0 + ch, x0:x0 + cw], (width, round(width * ch / cw)), interpolation=cv2.INTER_AREA)
        out.append(cv2.imencode(".jpg", cut, [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    return out


@pytest.fixture(scope="module")
def photos() -> list[bytes]:
    return photo_jpegs(6)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def targets_of(image: np.ndarray, rng: np.random.Generator) -> dict:
    """Boxes (the first covers the whole image), labels, one mask per box and 4 keypoints per
    object (the first object's are the image's corners), in the image's pixels."""
    h, w = image.shape[:2]
    boxes, masks = [[0.0, 0.0, float(w), float(h)]], [np.ones((h, w), np.uint8)]
    for _ in range(2):
        x0, y0 = rng.uniform(0, w * 0.6), rng.uniform(0, h * 0.6)
        x1, y1 = x0 + rng.uniform(0.1, 0.4) * w, y0 + rng.uniform(0.1, 0.4) * h
        boxes.append([x0, y0, x1, y1])
        mask = np.zeros((h, w), np.uint8)
        mask[int(y0):int(y1), int(x0):int(x1)] = 1
        masks.append(mask)
    boxes = np.asarray(boxes, np.float32)
    corners = [[0, 0, 2], [w - 1, 0, 2], [0, h - 1, 2], [w - 1, h - 1, 2]]
    keypoints = [corners] + [[[b[0], b[1], 2], [b[2], b[1], 2], [b[0], b[3], 1], [b[2], b[3], 2]] for b in boxes[1:]]
    return {"image": image, "boxes": boxes, "labels": np.array([1, 2, 3], np.int64), "masks": np.stack(masks),
            "keypoints": np.asarray(keypoints, np.float32)}


def per_object(name: str) -> bool:
    return name in ("boxes", "labels", "masks", "keypoints")


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("first", list(FIRSTS))
def test_a_region_decode_draws_and_moves_targets_as_a_full_decode(photos, first, fmt):
    compose = pipelines.build(pipelines.canonical_json(A.to_dict(A.Compose(
        [FIRSTS[first], *REST], bbox_params=A.BboxParams(format=fmt, label_fields=["labels"])))))
    random = pipelines.SampleRandom()
    random.attach(compose)
    tp = TargetPipeline.of(compose, attach=random.attach)
    step = region.FirstStep.of(compose)
    assert step is not None
    rng = np.random.default_rng(1)
    scores, eighths = [], []
    for position in range(3 * len(photos)):  # every photo under 3 streams
        data = photos[position % len(photos)]
        full = decode_rgb(data)  # OpenCV at full size: reduced_decode off
        sample = targets_of(full, rng)
        random.start(KEY, position)
        want = tp(sample, per_object)
        after_full = random.generator.bit_generator.random_raw(4).tolist()  # where the stream stands now
        random.start(KEY, position)
        drawn = step.draw(*upright_size(data))
        window = None if drawn.params is None else drawn.window
        got = tp.end_first({**sample, "image": decode_rgb(data, eighths=drawn.eighths, window=window)}, per_object,
                           step, drawn)
        assert random.generator.bit_generator.random_raw(4).tolist() == after_full, \
            "the stream was not consumed as by a full decode"
        eighths.append(drawn.eighths)
        for name in ("boxes", "labels", "masks", "keypoints"):
            assert want[name].dtype == got[name].dtype, name
            np.testing.assert_array_equal(got[name], want[name], err_msg=f"{first} {fmt} sample {position}: {name}")
        assert got["image"].shape == want["image"].shape
        scores.append(psnr(got["image"], want["image"]))
        if drawn.params is None:
            assert np.array_equal(got["image"], want["image"]), "the crop skipped (its p): a full decode's bytes"
    finite = [min(s, 99.0) for s in scores]
    assert min(scores) >= region.PIXEL_BOUND["min_psnr_db"], (first, fmt, sorted(scores)[:3])
    assert np.mean(finite) >= region.PIXEL_BOUND["mean_psnr_db"], (first, fmt, np.mean(finite))
    assert min(eighths) < 8, f"{first}: every sample was decoded at full size ({eighths})"


def test_the_first_transforms_params_are_albumentations_own(photos):
    """The params drawn ahead of decoding are those albumentations records for the full decode
    (``save_applied_params``), sample by sample, with a generator seeded apart from batchd's."""
    import random as pyrandom

    transforms = [A.RandomResizedCrop(size=(224, 224), p=0.8), A.HorizontalFlip(p=0.5)]
    for i, data in enumerate(photos):
        full = decode_rgb(data)
        oracle = A.Compose([*transforms], save_applied_params=True)
        oracle.set_random_state(np.random.default_rng(i), pyrandom.Random(i))
        applied = dict(oracle(image=full)["applied_transforms"])
        ours = A.Compose([*transforms])
        ours.set_random_state(np.random.default_rng(i), pyrandom.Random(i))
        drawn = region.FirstStep(ours).draw(*full.shape[:2])
        if "RandomResizedCrop" not in applied:
            assert drawn.params is None and drawn.eighths == 8
        else:
            assert tuple(drawn.params["crop_coords"]) == tuple(applied["RandomResizedCrop"]["crop_coords"])


def test_other_pipelines_are_not_drawn_ahead():
    assert region.FirstStep.of(A.Compose([A.RandomCrop(64, 64)])) is None  # no downsizing: full size needed
    assert region.FirstStep.of(A.Compose([A.Resize(64, 64)])) is None  # a resize: pipeline.decode_min_size
    assert region.FirstStep.of(A.Compose([A.RandomResizedCrop(size=(8, 8))], p=0.5)) is None
    assert region.FirstStep.of(A.Compose([A.HorizontalFlip(), A.RandomResizedCrop(size=(8, 8))])) is None
    assert region.FirstStep.of(None) is None


# --- through a server ------------------------------------------------------------------------------


def write_coco(root: pathlib.Path, jpegs: list[bytes], orientations: list[int],
               upright: bool = False) -> tuple[pathlib.Path, pathlib.Path]:
    """A COCO dataset of ``jpegs`` (an EXIF orientation added where not 1): per image a
    whole-image box and two rectangles, each with its polygon, in the stored frame (``upright``:
    in the frame viewers show, as web annotation tools save them: width and height swapped for
    orientations 5-8)."""
    images, annotations, rng = [], [], np.random.default_rng(3)
    folder = root / "images"
    folder.mkdir(parents=True)
    for i, (data, orientation) in enumerate(zip(jpegs, orientations)):
        h, w = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_GRAYSCALE | cv2.IMREAD_IGNORE_ORIENTATION).shape
        if upright and orientation >= 5:
            h, w = w, h
        if orientation != 1:
            data = data[:2] + exif_segment(orientation) + data[2:]
        (folder / f"{i}.jpg").write_bytes(data)
        images.append({"id": i + 1, "file_name": f"{i}.jpg", "height": h, "width": w})
        rects = [(0.0, 0.0, float(w), float(h))]
        for _ in range(2):
            x, y = float(rng.uniform(0, w * 0.6)), float(rng.uniform(0, h * 0.6))
            rects.append((x, y, float(rng.uniform(0.1, 0.4) * w), float(rng.uniform(0.1, 0.4) * h)))
        for k, (x, y, bw, bh) in enumerate(rects):
            annotations.append({"id": len(annotations) + 1, "image_id": i + 1, "category_id": k + 1, "iscrowd": 0,
                                "bbox": [x, y, bw, bh], "area": bw * bh,
                                "segmentation": [[x, y, x + bw, y, x + bw, y + bh, x, y + bh]]})
    categories = [{"id": k, "name": f"c{k}"} for k in (1, 2, 3)]
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return folder, path


def test_a_served_region_decode_equals_reduced_decode_off(photos, make_server, tmp_path):
    import batchd
    from batchd.server.serve.stats import snapshot

    orientations = [1, 6, 1, 3, 1, 1]
    folder, annotations = write_coco(tmp_path, photos, orientations)
    det = {"kind": "coco", "images": str(folder), "annotations": str(annotations), "masks": True,
           "apply_exif_orientation": True}
    server = make_server(workers=2, datasets={"on": det, "off": {**det, "reduced_decode": False}})
    counts = []
    for fmt in FORMATS:
        compose = A.Compose([FIRSTS["RandomResizedCrop"], *REST], bbox_params=A.BboxParams(format=fmt))
        batches = {}
        for name in ("on", "off"):
            with batchd.RemoteDataLoader(server.address, name, batch_size=len(photos), shuffle=True, seed=7,
                                         transform=compose, timeout=60) as loader:
                batches[name] = next(iter(loader))
            counts.append(dict(snapshot(server.loader).decodes))
        on, off = batches["on"], batches["off"]
        assert on["index"].tolist() == off["index"].tolist()
        scores = []
        for j in range(len(photos)):
            for name in ("boxes", "labels", "masks", "iscrowd", "area"):
                np.testing.assert_array_equal(on[name][j].numpy(), off[name][j].numpy(), err_msg=f"{fmt} {j} {name}")
            scores.append(psnr(on["image"][j].numpy(), off["image"][j].numpy()))
        assert min(scores) >= region.PIXEL_BOUND["min_psnr_db"], (fmt, scores)
        assert np.mean([min(s, 99.0) for s in scores]) >= region.PIXEL_BOUND["mean_psnr_db"], (fmt, scores)
    # the worker decoded "on" at the crops' scales (some at full size: small crops) and "off" in full
    region_counts = [b["region"] - a["region"] for a, b in zip([{"region": 0, "full": 0}] + counts, counts)]
    full_counts = [b["full"] - a["full"] for a, b in zip([{"region": 0, "full": 0}] + counts, counts)]
    assert all(n > 0 for n in region_counts[0::2]), region_counts  # the "on" streams
    assert region_counts[1::2] == [0] * len(FORMATS) and full_counts[1::2] == [len(photos)] * len(FORMATS)
    assert snapshot(server.loader).decoded_pixels > 0


@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_a_decoded_region_is_that_rectangle_of_a_whole_decode(photos, m):
    """``scaled_jpeg.decode_region`` (libjpeg's crop and skip of scanlines) gives the rectangle of
    the whole image at m/8, up to libjpeg's chroma upsampling at the rectangle's edges; and
    ``decode_rgb`` with a window gives that rectangle whether the region decoder runs or not."""
    from batchd.server.data import scaled_jpeg

    if not scaled_jpeg.region_available():
        pytest.skip("the region decoder (server/data/_jpeg_region.c) is not built: no jpeglib.h or C compiler")
    rng = np.random.default_rng(m)
    for data in photos:
        buf = np.frombuffer(data, np.uint8)
        whole = scaled_jpeg.decode_eighths(buf, m)
        h, w = upright_size(buf)
        for _ in range(4):
            x1, y1 = int(rng.integers(0, w - 64)), int(rng.integers(0, h - 64))
            window = (x1, y1, int(rng.integers(x1 + 32, w + 1)), int(rng.integers(y1 + 32, h + 1)))
            x, y, rw, rh = scaled_jpeg.scaled_window(window, m, h, w)
            region = scaled_jpeg.decode_region(buf, m, (x, y, rw, rh))
            want = whole[y:y + rh, x:x + rw]
            assert region.shape == want.shape == decode_rgb(buf, eighths=m, window=window).shape
            diff = np.abs(region.astype(int) - want)
            assert diff.max() <= 16 and diff.mean() < 0.1, (m, window, diff.max(), diff.mean())


def test_the_entropy_floor_aid_reads_rows_and_reports_what_libjpeg_cannot_decode(photos):
    """``_jpeg_region.entropy`` (bench/probes/region_cpu.py's floor): decodes a JPEG's first rows'
    entropy-coded data, any count of rows up to past its end; libjpeg's errors are RuntimeError."""
    from batchd.server.data import scaled_jpeg

    ext = scaled_jpeg.extension()
    if ext is None:
        pytest.skip("the C extension (server/data/_jpeg_region.c) is not built")
    for rows in (0, 1, 100, 10_000):
        assert ext.entropy(photos[0], 4, rows) is None
    with pytest.raises(RuntimeError):
        ext.entropy(b"\xff\xd8 not a jpeg", 4, 10)


def _write_folder(root: pathlib.Path, jpegs: list[bytes]) -> pathlib.Path:
    for i, data in enumerate(jpegs):
        (root / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        (root / f"c{i % 2}" / f"{i}.jpg").write_bytes(data)
    return root


def test_reduced_decode_off_is_a_full_opencv_decode_bit_for_bit(photos, make_server, tmp_path):
    """``reduced_decode: false`` under a first RandomResizedCrop: every image is what OpenCV's full
    decode and one albumentations Compose under the sample's stream give, byte for byte."""
    import batchd
    from batchd.sampler import sample_key

    root = _write_folder(tmp_path / "photos", photos)
    compose = A.Compose([FIRSTS["RandomResizedCrop"], *REST])
    server = make_server(workers=2, datasets={"off": {"kind": "imagefolder", "root": str(root), "reduced_decode": False}})
    files = sorted(root.glob("c*/*.jpg"), key=lambda p: (p.parent.name, p.name))
    with batchd.RemoteDataLoader(server.address, "off", batch_size=len(photos), shuffle=True, seed=5,
                                 transform=compose, timeout=60) as loader:
        batch = next(iter(loader))
    oracle = A.from_dict(A.to_dict(compose))
    random = pipelines.SampleRandom()
    random.attach(oracle)
    for j, (index, position) in enumerate(zip(batch["index"].tolist(), batch["position"].tolist())):
        rgb = cv2.cvtColor(cv2.imdecode(np.fromfile(files[index], np.uint8), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
        random.start(sample_key(seed=5, epoch=0), position)
        np.testing.assert_array_equal(batch["image"][j].numpy(), oracle(image=rgb)["image"], err_msg=f"sample {index}")


def test_a_first_random_crop_gives_the_same_bytes_with_and_without_the_cache(photos, tmp_path):
    """Region decoding depends on each sample's draw, so such a pipeline's output is not cached;
    the cache keeps each sample's indexed JPEG instead (made in the first epoch, read in the
    second: scaled_jpeg.index_jpeg), from which a region decodes to the same bytes: a server with
    a cache gives the bytes of one without it, in both epochs. A cache too small for any index
    makes none (not admitted, every epoch: no index is built for nothing), same bytes."""
    import batchd
    from conftest import running_server

    root = _write_folder(tmp_path / "photos", photos)
    compose = A.Compose([FIRSTS["RandomSizedCrop"], *REST])
    folder = {"pics": {"kind": "imagefolder", "root": str(root)}}
    digests = []
    for cache in (None, {"memory_bytes": "64MiB"}, {"memory_bytes": "64KiB"}):
        with running_server(workers=2, cache_dir=tmp_path / "index", datasets=folder,
                            **({"cache": cache} if cache else {})) as server:
            with batchd.RemoteDataLoader(server.address, "pics", batch_size=3, shuffle=True, seed=9, transform=compose,
                                         timeout=60) as loader:
                got = []
                for epoch in (0, 1):
                    loader.set_epoch(epoch)
                    got += [b["image"].numpy().tobytes() for b in loader]
            digests.append(got)
            if cache:
                stats = server.loader.cache.stats()["pics"]
                decodes = server.loader.transport.decodes
                if cache["memory_bytes"] == "64MiB":  # made (and used) in epoch 0, read in epoch 1
                    assert (stats["misses"], stats["hits"]) == (len(photos), len(photos)), stats
                    assert decodes["indexed"] == 2 * len(photos), decodes
                else:  # no room: looked up each epoch, never made
                    assert (stats["misses"], stats["hits"], stats["not_admitted"]) == (2 * len(photos), 0, 0), stats
                    assert decodes["indexed"] == 0 and decodes["region"] + decodes["full"] == 2 * len(photos), decodes
    assert digests[0] == digests[1] == digests[2]


@pytest.mark.parametrize("orientation", [2, 3, 6, 8])
def test_a_turned_jpegs_window_is_cut_from_the_turned_image(photos, orientation):
    """A JPEG with an EXIF orientation: the window (in the turned frame, as albumentations sees
    the image) is cut from the whole image decoded at m/8 and turned, as OpenCV turns it."""
    from batchd.server.data import scaled_jpeg

    data = photos[0][:2] + exif_segment(orientation) + photos[0][2:]
    buf = np.frombuffer(data, np.uint8)
    full = decode_rgb(buf)  # OpenCV: turned
    h, w = upright_size(buf)
    assert full.shape[:2] == (h, w)
    window = (w // 5, h // 7, w - w // 9, h - h // 3)
    x, y, rw, rh = scaled_jpeg.scaled_window(window, 8, h, w)
    np.testing.assert_array_equal(decode_rgb(buf, eighths=8, window=window), full[y:y + rh, x:x + rw])
    for m in (1, 2, 4):
        x, y, rw, rh = scaled_jpeg.scaled_window(window, m, h, w)
        whole = decode_rgb(buf, eighths=m)
        assert whole.shape[:2] == scaled_jpeg.scaled_size(h, w, m)
        np.testing.assert_array_equal(decode_rgb(buf, eighths=m, window=window), whole[y:y + rh, x:x + rw])
        small = cv2.resize(full, (whole.shape[1], whole.shape[0]), interpolation=cv2.INTER_AREA)
        assert psnr(whole, small) > 30, (orientation, m)  # turned the same way as OpenCV's full decode


# Region decoding with the targets checks of issue 38 (server/compute/sample_checks.py): a region
# decode's sample is checked on the full frame its targets are in, in the frame annotations_frame
# names, and a JPEG of another size than its annotation file is the same SampleError either way.
TURNED = [1, 6, 3, 8, 1, 1]  # EXIF orientations of the 6 photos


def test_a_region_decode_under_annotations_frame_upright_equals_reduced_decode_off(photos, tmp_path):
    """Annotations made on the upright photo (``annotations_frame: upright``, orientations 6, 3
    and 8 among them): a first random crop drawn ahead of a decode at m/8 gives the targets of
    ``reduced_decode: false`` bit for bit (the whole-image box, which lies outside any window, is
    checked on the full frame and moved with the crop), images within ``region.PIXEL_BOUND``,
    and the windows were decoded at m/8 < 1."""
    from inworker import InWorker

    folder, annotations = write_coco(tmp_path, photos, TURNED, upright=True)
    det = {"kind": "coco", "images": str(folder), "annotations": str(annotations), "masks": True,
           "annotations_frame": "upright"}
    indices = list(range(len(photos)))
    with InWorker({"on": det, "off": {**det, "reduced_decode": False}}, tmp_path / "cache") as w:
        for fmt in ("pascal_voc", "yolo"):
            compose = A.Compose([FIRSTS["RandomResizedCrop"], *REST], bbox_params=A.BboxParams(format=fmt))
            (done_on, on), (done_off, off) = (w.batch(name, indices, compose, seed=7) for name in ("on", "off"))
            assert done_on.timings["decode_region"] > 0 and done_off.timings["decode_region"] == 0
            assert done_off.timings["decode_full"] == len(photos)
            scores = []
            for j in indices:
                for name in ("boxes", "labels", "masks", "iscrowd", "area"):
                    np.testing.assert_array_equal(on[name][j], off[name][j], err_msg=f"{fmt} {j} {name}")
                assert on["boxes"][j].dtype == np.float32
                scores.append(psnr(on["image"][j], off["image"][j]))
            assert min(scores) >= region.PIXEL_BOUND["min_psnr_db"], (fmt, scores)
            assert np.mean([min(s, 99.0) for s in scores]) >= region.PIXEL_BOUND["mean_psnr_db"], (fmt, scores)


def test_a_jpeg_of_another_size_than_its_annotations_is_the_same_sample_error_with_region_decoding(photos, tmp_path):
    """Annotations made on the upright photo but served as stored (the default frame): the
    turned photos (orientations 6, 8) are SampleErrors naming the option that fits, with region
    decoding as without it (their window is never drawn on the JPEG's frame: ``decoded_size`` is
    None), and ``on_error: skip`` leaves out those samples alone."""
    import batchd
    from batchd.server.config import ServerConfig
    from batchd.server.data.datasets import open_dataset
    from inworker import InWorker

    folder, annotations = write_coco(tmp_path, photos, TURNED, upright=True)
    det = {"kind": "coco", "images": str(folder), "annotations": str(annotations), "on_error": "skip"}
    cfg = ServerConfig.model_validate({"datasets": {"on": det}, "cache_dir": str(tmp_path / "cache")})
    ds = open_dataset("on", cfg.datasets["on"], cfg.cache_dir, build=True)
    sizes = [ds.decoded_size(i, ds.read_bytes(i)) for i in range(len(photos))]
    assert [s is None for s in sizes] == [o >= 5 for o in TURNED], sizes
    compose = A.Compose([A.RandomResizedCrop(size=(64, 64), scale=(0.01, 0.05)), A.HorizontalFlip()],
                        bbox_params=A.BboxParams(format="pascal_voc"))
    with InWorker({"on": det, "off": {**det, "reduced_decode": False}}, tmp_path / "cache") as w:
        for name in ("on", "off"):
            with pytest.raises(batchd.SampleError) as e:
                w.batch(name, [0, 1], compose)
            assert e.value.index == 1 and "set annotations_frame: upright" in e.value.reason, str(e.value)
            done, got = w.batch(name, list(range(len(photos))), compose, skip=True)
            assert [s[0] for s in done.skipped] == [1, 3] and got["index"].tolist() == [0, 2, 4, 5], name
