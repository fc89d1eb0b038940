"""Table 20: RandomResizedCrop(224) + flip on large photos: region decoding against a DataLoader and tf.data.

The work: 1,536 JPEGs 1,000-1,600 px wide cut from real photographs (``data.ensure_large_photos``,
Debian's mate-backgrounds), ``A.Compose([A.RandomResizedCrop(size=(224, 224)),
A.HorizontalFlip(p=0.5)])``, batch 64, 2 workers each:

- ``dataloader``: PyTorch DataLoader, 2 persistent forkserver workers, each sample ``cv2.imread``
  + BGR -> RGB + the same Compose (``bench.peers.torch_loader.ImreadDataset``);
- ``batchd_full``: batchd over shared memory, the dataset with ``reduced_decode: false`` (a full
  decode by OpenCV, as before region decoding);
- ``batchd``: batchd over shared memory, ``reduced_decode`` on (the default): the crop drawn
  first, the JPEG decoded at the cheapest M/8 its window needs (server/compute/region.py), the
  window's MCUs cut from the sample's indexed JPEG in the server's cache (``cache.memory_bytes``
  ``CACHE_BYTES``: every photo's index fits; server/data/scaled_jpeg.py ``index_jpeg``), made in
  one untimed epoch before the rounds, whose rate is reported beside them (the first epoch of a
  server pays the indexing, about 7 ms per photo, once);
- ``tf_data_crop``: tf.data with TensorFlow's own ``decode_and_crop_jpeg`` (only the crop's
  rows and columns decoded), 2 parallel calls (``bench.peers.tf_peer._crop_pipeline``), when
  TensorFlow is installed.

Each round times every method once, the order rotated every round (the machine is shared: other
processes slow all methods alike); medians of the rounds. The server's Prometheus counters
(``batchd_decodes_total``, ``batchd_decoded_pixels_total``) give the decoded pixels per image of
each batchd method over its measurements, and the mean PSNR of ``batchd`` against
``batchd_full`` is computed on one batch of each (the same seed: the same crops).
"""

from __future__ import annotations

import math
import re
import socket
import sys
import urllib.request

import albumentations as A
import numpy as np

from bench import common
from bench.fixtures import data
from bench.fixtures.server_proc import ServerProcess
from bench.measure import median, spread, time_stream
from bench.noise import measure
from bench.peers import tf_peer
from bench.peers.torch_loader import ImreadDataset, make_loader, time_loader
from bench.report import fx, md_table

NAME = "table20"
TITLE = "Table 20: RandomResizedCrop(224) + flip on large photos (2 workers, batch 64)"
WORKERS, BATCH = 2, 64
PIPELINE = "rrc"
METHODS = ("dataloader", "batchd_full", "batchd")
LABELS = {"dataloader": "DataLoader (cv2.imread + Compose)", "batchd_full": "batchd, reduced_decode: false",
          "batchd": "batchd (region decoding)", tf_peer.CROP_METHOD: "tf.data decode_and_crop_jpeg"}
DATASET = {"batchd_full": "large_full", "batchd": "large"}
CACHE_BYTES = "512MiB"  # the 1,536 photos' indexes (about 1.3x their 292 MB) and a few dozen full decodes


def compose() -> A.Compose:
    return A.Compose([A.RandomResizedCrop(size=(224, 224)), A.HorizontalFlip(p=0.5)])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _decode_counters(port: int) -> tuple[dict[str, float], float]:
    """(images decoded so far by kind: full, scaled, region, indexed; pixels decoded), from the
    server's /metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    kinds = {k: float(v) for k, v in re.findall(r'^batchd_decodes_total\{kind="([a-z]+)"\} (\S+)$', text, re.M)}
    pixels = re.search(r"^batchd_decoded_pixels_total (\S+)$", text, re.M)
    return kinds, float(pixels.group(1)) if pixels else math.nan


def _psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return math.inf if mse == 0 else 10 * math.log10(255.0 ** 2 / mse)


def run(s, log=print) -> dict:
    folder = data.ensure_large_photos()
    files = data.photo_files(folder)
    paths = [str(folder / f) for f in files]
    labels = [int(f.split("/")[0].split("_")[1]) for f in files]
    rounds = s.pick(5, 1)
    timed = s.pick(16, 4)
    warmup = WORKERS
    presets = {PIPELINE: A.to_dict(compose())}
    cfg = common.server_datasets(large=common.imagefolder_config(folder))
    cfg["large_full"] = {**cfg["large"], "reduced_decode": False}
    port = _free_port()
    peers = (tf_peer.CROP_METHOD,) if tf_peer.available() else ()
    peer = tf_peer.TFPeer(paths, labels, WORKERS).start() if peers else None
    srv = ServerProcess(datasets=cfg, pipelines=presets, workers=WORKERS, cache_dir=data.CACHE,
                        extra={"metrics_port": port, "cache": {"memory_bytes": CACHE_BYTES}}).start()
    dl, plan = make_loader(ImreadDataset(paths, labels, presets), WORKERS)
    rates: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    pixels: dict[str, list[float]] = {m: [0.0, 0.0] for m in DATASET}
    methods = METHODS + peers
    try:
        plan.set(PIPELINE, len(paths), BATCH, WORKERS, seed=0)
        for _ in dl:  # the DataLoader's workers start
            pass
        first_epoch = None
        for m in ("batchd", "batchd_full"):  # the server's workers build the pipeline; "batchd": a whole
            # epoch first, which indexes every photo into the cache (before large_full's decodes fill it)
            with common.remote(srv.address, DATASET[m], batch_size=BATCH, pipeline=PIPELINE, workers=WORKERS,
                               transport="shm") as rl:
                t = time_stream(rl, 0, len(paths) // BATCH if m == "batchd" else WORKERS)
                first_epoch = t.rate if m == "batchd" else first_epoch
            srv.wait_idle()
        indexed_before = _decode_counters(port)[0].get("indexed", 0.0)

        def one(m: str, seed: int):
            if m in peers:
                try:
                    return peer.measure(m, seed, warmup, timed)
                finally:
                    peer.wait_idle()
            if m == "dataloader":
                return time_loader(dl, plan, PIPELINE, len(paths), BATCH, warmup, timed, seed)
            before = _decode_counters(port)
            try:
                with common.remote(srv.address, DATASET[m], batch_size=BATCH, pipeline=PIPELINE, workers=WORKERS,
                                   transport="shm", seed=seed) as rl:
                    return time_stream(rl, warmup, timed)
            finally:
                srv.wait_idle()
                after = _decode_counters(port)
                pixels[m][0] += sum(after[0].values()) - sum(before[0].values())
                pixels[m][1] += after[1] - before[1]

        for r in range(rounds):
            k = r % len(methods)
            for m in methods[k:] + methods[:k]:
                t = measure(lambda: one(m, 1000 + r))
                rates.setdefault(m, []).append(t.rate)
                cpus.setdefault(m, []).append(t.cpu_per_image)
            log(f"  table20: round {r + 1}/{rounds}: " + ", ".join(f"{m} {rates[m][-1]:.0f}" for m in methods))
        psnr = _region_psnr(srv.address)
        indexed = _decode_counters(port)[0].get("indexed", 0.0) - indexed_before
    finally:
        del dl
        srv.stop()
        if peer is not None:
            peer.stop()
    widths = [_jpeg_width(p) for p in paths]
    return {"rounds": rounds, "timed_images": timed * BATCH, "images": len(paths), "width_range": [min(widths), max(widths)],
            "rates": rates, "cpu_per_image": {m: median(v) for m, v in cpus.items()},
            "median": {m: median(v) for m, v in rates.items()}, "spread": {m: spread(v) for m, v in rates.items()},
            "pixels_per_image": {m: (p / n if n else math.nan) for m, (n, p) in pixels.items()},
            "psnr": psnr, "tf_version": peer.version if peer else "",
            "first_epoch_rate": first_epoch, "indexed_decodes": indexed,
            "peers": "measured" if peers else tf_peer.SKIPPED}


def _jpeg_width(path: str) -> int:
    from batchd.server.data.decode import image_size

    return image_size(np.fromfile(path, np.uint8))[0]


def _region_psnr(address: str) -> dict:
    """PSNR of ``batchd``'s images against ``batchd_full``'s, one batch each under one seed (the same crops)."""
    import batchd

    got = {}
    for m, ds in DATASET.items():
        with batchd.RemoteDataLoader(address, ds, batch_size=BATCH, shuffle=True, seed=99, transform=PIPELINE,
                                     timeout=120) as rl:
            got[m] = next(iter(rl))["image"].numpy()
    scores = [_psnr(a, b) for a, b in zip(got["batchd"], got["batchd_full"])]
    finite = [min(x, 99.0) for x in scores]
    return {"mean": float(np.mean(finite)), "min": float(min(scores)), "images": len(scores),
            "identical": sum(math.isinf(x) for x in scores)}


def render(r: dict) -> str:
    m, c = r["median"], r["cpu_per_image"]
    px = r["pixels_per_image"]
    head = ["method", "img/s", "batchd / this", "CPU ms/image", "decoded Mpx/image", "spread"]
    rows = []
    for k in m:
        rows.append([LABELS[k], f"{m[k]:.0f}", fx(m["batchd"] / m[k]), f"{c[k] * 1e3:.2f}",
                     f"{px[k] / 1e6:.2f}" if k in px else "", f"{r['spread'][k]:.0%}"])
    p = r["psnr"]
    notes = (f"\n{r['images']} JPEGs {r['width_range'][0]}-{r['width_range'][1]} px wide (quality 90, cut from "
             f"mate-backgrounds' photographs), `RandomResizedCrop(size=(224, 224))` + `HorizontalFlip(p=0.5)`, batch "
             f"{BATCH}, 2 workers per method; {r['timed_images']} images timed per measurement after 2 batches; "
             f"median of {r['rounds']} rounds, each method once per round in a rotated order (the machine is "
             "shared with other engineers' processes: rounds alternate so that their load hits every method alike). "
             "Decoded Mpx/image: the server's batchd_decoded_pixels_total over batchd_decodes_total during the "
             f"measurements. Region decoding against `reduced_decode: false`, one batch under one seed: mean PSNR "
             f"{p['mean']:.1f} dB, lowest {p['min']:.1f} dB ({p['identical']} of {p['images']} images byte for byte "
             "equal).")
    if r.get("first_epoch_rate"):
        notes += (f" batchd's regions are cut from each photo's indexed JPEG in the server's cache ({CACHE_BYTES}; "
                  f"{r['indexed_decodes']:.0f} indexed decodes during the rounds), made in an untimed first epoch "
                  f"before them: {r['first_epoch_rate']:.0f} img/s over that epoch, which pays the indexing once.")
    if r.get("peers") != "measured":
        notes += f" tf.data: {r.get('peers')}."
    else:
        notes += f" tf.data: tensorflow-cpu {r.get('tf_version', '?')}, bench/peers/tf_peer.py `_crop_pipeline`."
    return md_table(head, rows) + "\n" + notes


def targets(r: dict) -> list[dict]:
    m, c = r["median"], r["cpu_per_image"]
    out = [{"name": "batchd >= 1.3x a DataLoader running the same albumentations pipeline (large photos, RRC(224) + flip)",
            "passed": m["batchd"] / m["dataloader"] >= 1.3,
            "detail": f"{m['batchd'] / m['dataloader']:.2f}x ({m['batchd']:.0f} vs {m['dataloader']:.0f} img/s); "
                      f"{c['dataloader'] / c['batchd']:.2f}x less CPU per image; before region decoding: "
                      f"{m['batchd_full'] / m['dataloader']:.2f}x ({c['dataloader'] / c['batchd_full']:.2f}x the CPU)"}]
    if tf_peer.CROP_METHOD in m:
        ratio, peer = m["batchd"] / m[tf_peer.CROP_METHOD], tf_peer.CROP_METHOD
        out.append({"name": "batchd >= 1.2x tf.data with decode_and_crop_jpeg (same files, same work)",
                    "passed": ratio >= 1.2,
                    "detail": f"{ratio:.2f}x ({m['batchd']:.0f} vs {m[peer]:.0f} img/s); "
                              f"{c[peer] / c['batchd']:.2f}x less CPU per image"})
    else:
        out.append({"name": "batchd >= 1.2x tf.data with decode_and_crop_jpeg", "passed": None, "detail": r.get("peers")})
    return out


if __name__ == "__main__":
    raise SystemExit(common.table_main(sys.modules[__name__], quick_help="1 round of 4 batches"))
