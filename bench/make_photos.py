"""Cut a folder of ImageNet-sized JPEG photos out of a few large photos, for the benchmarks.

    python bench/make_photos.py [--src DIR] [--out DIR] [--count N] [--classes K] [--seed S] [--quality Q]

The sources default to the nature wallpapers of Debian's ``mate-backgrounds`` package (12 photos
of 1280..2560 px; ``make bench`` installs it). The output is an image folder::

    OUT/class_00/img_00000.jpg, OUT/class_01/img_00001.jpg, ..., OUT/class_09/img_02999.jpg

Image ``i`` belongs to class ``i % classes``; class ``c`` is cut from source photo
``c % len(sources)`` (sources sorted by name), so labels are learnable. Each image is
``width`` 400..520 px, aspect ratio (width/height) log-uniform in 3:4..4:3, a crop of 10..100%
of its source's area at a random place, flipped left-right with p=0.5 and upside down with
p=0.1, resized with OpenCV and written at JPEG ``--quality``.

Deterministic: image ``i`` depends only on ``--seed``, ``i``, ``--classes``, ``--quality`` and
the sources. Idempotent: when OUT already holds exactly these ``count`` images (same parameters,
recorded in OUT/.make_photos.json, written last) nothing is done; otherwise the images are
made again. Progress is shown with tqdm only when stderr is a terminal.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import sys
import time

import cv2
import numpy as np

SOURCE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".tif", ".tiff")
PARAMS_FILE = ".make_photos.json"
MIN_WIDTH, MAX_WIDTH = 400, 520
MIN_ASPECT, MAX_ASPECT = 3 / 4, 4 / 3
MIN_AREA, MAX_AREA = 0.10, 1.0
P_HFLIP, P_VFLIP = 0.5, 0.1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", type=pathlib.Path, default=pathlib.Path("/usr/share/backgrounds/mate/nature"),
                   help="folder of source photos (default: %(default)s)")
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("bench/data/photos"),
                   help="output folder (default: %(default)s)")
    p.add_argument("--count", type=int, default=3000, help="images to make (default: %(default)s)")
    p.add_argument("--classes", type=int, default=10, help="class subfolders (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default: %(default)s)")
    p.add_argument("--quality", type=int, default=90, help="JPEG quality 1..100 (default: %(default)s)")
    args = p.parse_args(argv)
    if args.count < 1:
        p.error("--count must be at least 1")
    if not 1 <= args.classes <= args.count:
        p.error("--classes must be between 1 and --count")
    if not 1 <= args.quality <= 100:
        p.error("--quality must be between 1 and 100")
    if args.seed < 0:
        p.error("--seed must be non-negative")
    return args


def find_sources(src: pathlib.Path) -> list[pathlib.Path]:
    if not src.is_dir():
        return []
    return sorted(p for p in src.iterdir() if p.is_file() and p.suffix.lower() in SOURCE_EXTENSIONS)


def params_of(args: argparse.Namespace, sources: list[pathlib.Path]) -> dict:
    return {
        "count": args.count,
        "classes": args.classes,
        "seed": args.seed,
        "quality": args.quality,
        "sources": [[p.name, p.stat().st_size] for p in sources],
        "version": 1,
    }


def image_path(out: pathlib.Path, i: int, classes: int, count: int) -> pathlib.Path:
    digits = max(5, len(str(count - 1)))
    return out / f"class_{i % classes:02d}" / f"img_{i:0{digits}d}.jpg"


def existing_images(out: pathlib.Path) -> list[pathlib.Path]:
    return sorted(out.glob("class_*/img_*.jpg")) if out.is_dir() else []


def is_done(out: pathlib.Path, params: dict) -> bool:
    try:
        recorded = json.loads((out / PARAMS_FILE).read_text())
    except (OSError, ValueError):
        return False
    if recorded != params:
        return False
    expected = {image_path(out, i, params["classes"], params["count"]) for i in range(params["count"])}
    return set(existing_images(out)) == expected


def cut(photo: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """One random crop of photo, resized to a random ImageNet-like size, maybe flipped."""
    src_h, src_w = photo.shape[:2]
    width = int(rng.integers(MIN_WIDTH, MAX_WIDTH + 1))
    aspect = math.exp(rng.uniform(math.log(MIN_ASPECT), math.log(MAX_ASPECT)))  # width / height
    height = max(1, round(width / aspect))
    area = rng.uniform(MIN_AREA, MAX_AREA) * src_w * src_h
    crop_w, crop_h = math.sqrt(area * aspect), math.sqrt(area / aspect)
    shrink = max(1.0, crop_w / src_w, crop_h / src_h)  # keep the aspect ratio, fit the photo
    crop_w, crop_h = max(1, min(src_w, int(crop_w / shrink))), max(1, min(src_h, int(crop_h / shrink)))
    x0 = int(rng.integers(0, src_w - crop_w + 1))
    y0 = int(rng.integers(0, src_h - crop_h + 1))
    crop = photo[y0:y0 + crop_h, x0:x0 + crop_w]
    interpolation = cv2.INTER_AREA if crop_w > width else cv2.INTER_CUBIC
    image = cv2.resize(crop, (width, height), interpolation=interpolation)
    if rng.random() < P_HFLIP:
        image = image[:, ::-1]
    if rng.random() < P_VFLIP:
        image = image[::-1]
    return np.ascontiguousarray(image)


def write_atomically(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def progress(iterable, total: int):
    if sys.stderr.isatty():
        try:
            from tqdm import tqdm
        except ImportError:
            return iterable
        return tqdm(iterable, total=total, unit="img", desc="photos")
    return iterable


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sources = find_sources(args.src)
    if not sources:
        print(f"make_photos: no source photos in {args.src} "
              f"(Debian: apt-get install mate-backgrounds, or pass --src DIR)", file=sys.stderr)
        return 2
    out: pathlib.Path = args.out
    params = params_of(args, sources)
    if is_done(out, params):
        print(f"make_photos: {out} already holds the {args.count} images (seed {args.seed}); nothing to do")
        return 0

    start = time.monotonic()
    # Start over: drop our own earlier output (and only that), then the stale parameters.
    (out / PARAMS_FILE).unlink(missing_ok=True)
    for old in existing_images(out):
        old.unlink()
    for d in out.glob("class_*") if out.is_dir() else ():
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
    for c in range(args.classes):
        (out / f"class_{c:02d}").mkdir(parents=True, exist_ok=True)

    photos: dict[int, np.ndarray] = {}
    total_bytes, widths, heights = 0, [], []
    for i in progress(range(args.count), args.count):
        c = i % args.classes
        s = c % len(sources)
        if s not in photos:
            photo = cv2.imread(str(sources[s]), cv2.IMREAD_COLOR)
            if photo is None:
                print(f"make_photos: cannot read {sources[s]}", file=sys.stderr)
                return 1
            photos[s] = photo
        rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([args.seed, i])))
        image = cut(photos[s], rng)
        ok, buf = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, args.quality])
        if not ok:
            print(f"make_photos: cannot encode image {i}", file=sys.stderr)
            return 1
        data = buf.tobytes()
        write_atomically(image_path(out, i, args.classes, args.count), data)
        total_bytes += len(data)
        heights.append(image.shape[0])
        widths.append(image.shape[1])
    (out / PARAMS_FILE).write_text(json.dumps(params, indent=1) + "\n")

    elapsed = time.monotonic() - start
    print(
        f"make_photos: wrote {args.count} JPEGs in {args.classes} classes to {out} "
        f"from {min(len(sources), args.classes)} of {len(sources)} source photos in {args.src}: "
        f"{total_bytes / 1e6:.1f} MB, {total_bytes / args.count / 1e3:.0f} kB/image, "
        f"width {min(widths)}..{max(widths)} (mean {np.mean(widths):.0f}), "
        f"height {min(heights)}..{max(heights)} (mean {np.mean(heights):.0f}), "
        f"{elapsed:.1f} s"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
