"""The data the benchmarks read: the photo folder, a 4x manifest of it, the N-row scale manifest."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import time

BENCH = pathlib.Path(__file__).resolve().parent
DATA = BENCH / "data"
PHOTOS = DATA / "photos"
CACHE = DATA / "cache"              # the servers' index cache
LOCAL_CACHE = DATA / "cache-local"  # this process's (sequential loop, DataLoader) index cache
PHOTO_COUNT = 3000
FASHION_COCO = DATA / "fashion-coco-384"  # detection: canvases of 384-512 px, up to 8 objects


def ensure_photos(count: int = PHOTO_COUNT) -> pathlib.Path:
    """bench/make_photos.py (idempotent: a no-op when the folder already holds the images)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(BENCH / "make_photos.py"), "--out", str(PHOTOS), "--count", str(count)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"bench/make_photos.py failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    if "nothing to do" not in r.stdout:
        print(r.stdout.strip(), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return PHOTOS


def photo_files() -> list[str]:
    return sorted(str(p.relative_to(PHOTOS)) for p in PHOTOS.glob("class_*/img_*.jpg"))


def ensure_repeated_manifest(times: int = 4) -> pathlib.Path:
    """A CSV listing every photo ``times`` times (for batches of up to 1000 over several epochs' worth)."""
    out = DATA / f"photos_x{times}.csv"
    files = photo_files()
    rows = [f"{f},{int(f.split('/')[0].split('_')[1])}" for f in files] * times
    text = "path,label\n" + "\n".join(f"photos/{r}" for r in rows) + "\n"
    if not out.exists() or out.read_text() != text:
        out.write_text(text)
    return out


def ensure_big_manifest(rows: int) -> tuple[pathlib.Path, float]:
    """A CSV of ``rows`` (path, label) rows, ImageNet-21k-like paths that do not exist.

    Built with pyarrow compute (no Python strings), written atomically, reused when present.
    Returns (path, seconds spent building; 0 when reused).
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pcsv

    out = DATA / f"manifest_{rows // 1_000_000}M.csv" if rows % 1_000_000 == 0 else DATA / f"manifest_{rows}.csv"
    if out.exists():
        return out, 0.0
    DATA.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tmp = out.with_suffix(".csv.tmp")
    chunk = 2_000_000
    with pcsv.CSVWriter(str(tmp), pa.schema([("path", pa.string()), ("label", pa.int64())]),
                        write_options=pcsv.WriteOptions(quoting_style="none")) as w:
        for start in range(0, rows, chunk):
            i = np.arange(start, min(rows, start + chunk), dtype=np.int64)
            label = (i * 7919) % 1000
            wnid = pc.utf8_lpad(pc.cast(pa.array(1_440_764 + label * 9_973), pa.string()), 8, "0")
            num = pc.utf8_lpad(pc.cast(pa.array(i), pa.string()), 8, "0")
            path = pc.binary_join_element_wise("imagenet21k/train/n", wnid, "/n", wnid, "_", num, ".JPEG", "")
            w.write_table(pa.table({"path": path, "label": pa.array(label)}))
    os.replace(tmp, out)
    return out, time.perf_counter() - t0


def ensure_fashion_coco(count: int = 1000) -> pathlib.Path:
    """examples/make_fashion_coco.py: ``count`` train canvases of 384-512 px with up to 8 Fashion-MNIST
    items each (COCO JSON with polygon and RLE masks), in FASHION_COCO; made once (about a minute)."""
    import json

    annotations = FASHION_COCO / "annotations" / "instances_train.json"
    try:
        if len(json.loads(annotations.read_text())["images"]) == count:
            return FASHION_COCO
    except (OSError, ValueError, KeyError):
        pass
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, str(BENCH.parent / "examples" / "make_fashion_coco.py"), "--out",
                        str(FASHION_COCO), "--images", str(count), "--val-images", "0", "--min-size", "384",
                        "--max-size", "512", "--max-items", "8", "--seed", "0"], capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"examples/make_fashion_coco.py failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    print(r.stdout.strip(), f"({time.perf_counter() - t0:.0f} s)", flush=True)
    return FASHION_COCO
