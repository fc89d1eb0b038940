"""Train a small CenterNet-style detector through a batchd server, then print the val mAP (COCOeval).

    python examples/train_detection.py            # generates the data if missing, starts a local server
    python examples/train_detection.py --quick    # a smoke run: few images, one short epoch

The data (examples/make_fashion_coco.py, made in ``--data`` if missing): Fashion-MNIST items on
canvases of 96-160 px with a COCO "instances" JSON. The local server serves it as ``kind: coco``;
its ``train`` preset carries ``bbox_params`` (an affine scale and shift, a 128x128 crop, a flip:
boxes, labels and iscrowd move and drop with the image, each sample on its own random stream), its
``val`` preset pads each canvas to 160x160 at the top left (boxes keep their coordinates). Batches
come as ``(images, targets)`` through ``batchd.detection_collate``, as torchvision's detection
references batch them.

The model (plain torch, after Zhou et al., "Objects as Points", 2019): a small encoder-decoder with
output stride 4 and three heads per cell: a heatmap per class (penalty-reduced focal loss on
Gaussian peaks at the box centres), the box's width and height (L1, pixels), and the centre's
sub-cell offset (L1). Decoding: 3x3 max-pool peaks, top 50 per image. The metric is pycocotools'
``COCOeval`` (bbox) on the val JSON: mAP@[.5:.95] and mAP@.5 (crowd boxes are not trained on;
COCOeval ignores detections matched to them).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import pathlib
import sys
import tempfile
import time

import albumentations as A
import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import batchd
import make_fashion_coco
from local_server import local_server, write_config

STRIDE, CROP, VAL_SIDE, TOP_K = 4, 128, 160, 50
NUM_CLASSES = len(make_fashion_coco.CLASSES)  # category id c is class c - 1


def presets() -> dict:
    """``train``: affine, crop, flip with bbox_params (objects under 40% visible are dropped); ``val``: pad to 160x160."""
    constant = {"border_mode": cv2.BORDER_CONSTANT, "fill": 0}
    train = A.Compose([A.Affine(scale=(0.8, 1.25), translate_percent=(-0.1, 0.1), p=0.7, **constant),
                       A.PadIfNeeded(CROP, CROP, **constant), A.RandomCrop(CROP, CROP), A.HorizontalFlip(p=0.5),
                       A.RandomBrightnessContrast(p=0.3)],
                      bbox_params=A.BboxParams(format="pascal_voc", label_fields=["labels"], min_visibility=0.4))
    val = A.Compose([A.PadIfNeeded(VAL_SIDE, VAL_SIDE, position="top_left", **constant)])
    return {"train": A.to_dict(train), "val": A.to_dict(val)}


def datasets(data: pathlib.Path) -> dict:
    return {f"det-{split}": {"kind": "coco", "images": str(data / "images" / split),
                             "annotations": str(data / "annotations" / f"instances_{split}.json")}
            for split in ("train", "val")}


def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class CenterNet(nn.Module):
    """float [B, 3, H, W] (H, W multiples of 16) -> (heatmap logits [B, classes, H/4, W/4], size
    [B, 2, H/4, W/4] (box width, height in pixels), offset [B, 2, H/4, W/4] (centre - its cell, in cells))."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.s1 = block(3, 24, 2)                                  # 1/2
        self.s2 = nn.Sequential(block(24, 32, 2), block(32, 32))   # 1/4
        self.s3 = nn.Sequential(block(32, 64, 2), block(64, 64))   # 1/8
        self.s4 = nn.Sequential(block(64, 96, 2), block(96, 96))   # 1/16
        self.r4, self.r3 = nn.Conv2d(96, 48, 1), nn.Conv2d(64, 32, 1)
        self.d3, self.d2 = block(48 + 64, 64), block(32 + 32, 48)
        self.neck = block(48, 48)
        self.heat, self.size, self.offset = nn.Conv2d(48, classes, 1), nn.Conv2d(48, 2, 1), nn.Conv2d(48, 2, 1)
        nn.init.constant_(self.heat.bias, -2.19)  # CenterNet's prior: sigmoid = 0.1

    def forward(self, x: torch.Tensor):
        x2 = self.s2(self.s1(x))
        x3 = self.s3(x2)
        x4 = self.s4(x3)
        y = self.d3(torch.cat([F.interpolate(self.r4(x4), scale_factor=2.0), x3], 1))
        y = self.neck(self.d2(torch.cat([F.interpolate(self.r3(y), scale_factor=2.0), x2], 1)))
        return self.heat(y), self.size(y), self.offset(y)


def to_input(images) -> torch.Tensor:
    """B uint8 [H, W, 3] tensors of one size -> float [B, 3, H, W], about zero mean and unit variance."""
    return (torch.stack(list(images)).permute(0, 3, 1, 2).float() - 60.0) / 60.0


def gaussian_radius(h: float, w: float, min_overlap: float = 0.7) -> float:
    """The Gaussian radius (cells) of CenterNet's reference code (``gaussian_radius``, after
    CornerNet): the smallest of three corner-displacement bounds for IoU >= min_overlap."""
    b1, c1 = h + w, w * h * (1 - min_overlap) / (1 + min_overlap)
    r1 = (b1 + math.sqrt(b1 ** 2 - 4 * c1)) / 2
    b2, c2 = 2 * (h + w), (1 - min_overlap) * w * h
    r2 = (b2 + math.sqrt(b2 ** 2 - 16 * c2)) / 2
    a3, b3, c3 = 4 * min_overlap, -2 * min_overlap * (h + w), (min_overlap - 1) * w * h
    r3 = (b3 + math.sqrt(b3 ** 2 - 4 * a3 * c3)) / 2
    return min(r1, r2, r3)


def targets_of(targets, out_h: int, out_w: int):
    """CenterNet's training targets from B target dicts (boxes float32 [N, 4] xyxy pixels, labels
    category ids, iscrowd): heatmap [B, C, h, w], and per object (crowds left out): its batch
    sample, flat cell, class, size (w, h pixels) and offset, as tensors."""
    heat = np.zeros((len(targets), NUM_CLASSES, out_h, out_w), np.float32)
    ys, xs = np.mgrid[0:out_h, 0:out_w]
    where, size, offset = [], [], []
    for b, t in enumerate(targets):
        for box, label, crowd in zip(t["boxes"].tolist(), t["labels"].tolist(), t["iscrowd"].tolist()):
            w, h = box[2] - box[0], box[3] - box[1]
            if crowd or w <= 0 or h <= 0:
                continue
            cx, cy = (box[0] + box[2]) / 2 / STRIDE, (box[1] + box[3]) / 2 / STRIDE
            ix, iy = min(int(cx), out_w - 1), min(int(cy), out_h - 1)
            sigma = max(0.0, gaussian_radius(h / STRIDE, w / STRIDE)) * 2 / 6 + 1e-3
            peak = np.exp(-((xs - ix) ** 2 + (ys - iy) ** 2) / (2 * sigma ** 2))
            np.maximum(heat[b, label - 1], peak, out=heat[b, label - 1])
            where.append((b, iy * out_w + ix))
            size.append((w, h))
            offset.append((cx - ix, cy - iy))
    index = torch.tensor(where, dtype=torch.int64).reshape(-1, 2)
    return (torch.from_numpy(heat), index, torch.tensor(size, dtype=torch.float32).reshape(-1, 2),
            torch.tensor(offset, dtype=torch.float32).reshape(-1, 2))


def focal_loss(logits: torch.Tensor, heat: torch.Tensor) -> torch.Tensor:
    """CenterNet's penalty-reduced pixel-wise focal loss (alpha 2, beta 4), summed over cells / objects."""
    p = logits.sigmoid().clamp(1e-4, 1 - 1e-4)
    pos = heat.eq(1).float()
    pos_loss = (torch.log(p) * (1 - p) ** 2 * pos).sum()
    neg_loss = (torch.log(1 - p) * p ** 2 * (1 - heat) ** 4 * (1 - pos)).sum()
    return -(pos_loss + neg_loss) / pos.sum().clamp(min=1)


def gather(field: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[B, 2, h, w] at the objects' (sample, flat cell) -> [K, 2]."""
    flat = field.flatten(2)
    return flat[index[:, 0], :, index[:, 1]]


def loss_of(outputs, targets) -> torch.Tensor:
    heat_logits, size, offset = outputs
    heat, index, want_size, want_offset = targets_of(targets, *heat_logits.shape[2:])
    loss = focal_loss(heat_logits, heat)
    if len(index):
        loss = loss + 0.1 * F.l1_loss(gather(size, index), want_size) + F.l1_loss(gather(offset, index), want_offset)
    return loss


def decode(outputs, k: int = TOP_K) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per image: (boxes float [k, 4] xyxy pixels, scores [k], category ids [k]) of the k best peaks."""
    heat_logits, size, offset = outputs
    heat = heat_logits.sigmoid()
    peaks = heat * (F.max_pool2d(heat, 3, 1, 1) == heat)
    b, c, h, w = heat.shape
    scores, flat = peaks.reshape(b, -1).topk(k)
    cls, cell = flat // (h * w), flat % (h * w)
    cy, cx = (cell // w).float(), (cell % w).float()
    out = []
    for i in range(b):
        sw, sh = size[i, 0].flatten()[cell[i]].clamp(min=1.0), size[i, 1].flatten()[cell[i]].clamp(min=1.0)
        x = (cx[i] + offset[i, 0].flatten()[cell[i]]) * STRIDE
        y = (cy[i] + offset[i, 1].flatten()[cell[i]]) * STRIDE
        boxes = torch.stack([x - sw / 2, y - sh / 2, x + sw / 2, y + sh / 2], 1)
        out.append((boxes.numpy(), scores[i].numpy(), (cls[i] + 1).numpy()))
    return out


def evaluate(model: nn.Module, loader: batchd.RemoteDataLoader, annotations: pathlib.Path) -> tuple[float, float]:
    """(mAP@[.5:.95], mAP@.5) of COCOeval (bbox) on the val split; prints COCOeval's summary."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO(str(annotations))
    results = []
    model.eval()
    with torch.no_grad():
        for images, targets in loader:
            for (boxes, scores, cats), target in zip(decode(model(to_input(images))), targets):
                image = gt.imgs[int(target["image_id"])]
                boxes[:, 0::2] = boxes[:, 0::2].clip(0, image["width"])
                boxes[:, 1::2] = boxes[:, 1::2].clip(0, image["height"])
                for (x0, y0, x1, y1), score, cat in zip(boxes.tolist(), scores.tolist(), cats.tolist()):
                    if x1 > x0 and y1 > y0:
                        results.append({"image_id": image["id"], "category_id": int(cat), "score": score,
                                        "bbox": [x0, y0, x1 - x0, y1 - y0]})
    if not results:
        return 0.0, 0.0
    with contextlib.redirect_stdout(io.StringIO()):
        evaluation = COCOeval(gt, gt.loadRes(results), "bbox")
        evaluation.evaluate()
        evaluation.accumulate()
    evaluation.summarize()
    return float(evaluation.stats[0]), float(evaluation.stats[1])


def train(args: argparse.Namespace, address: str) -> float:
    torch.manual_seed(args.seed)
    train_loader = batchd.RemoteDataLoader(address, "det-train", batch_size=args.batch_size, shuffle=True,
                                           seed=args.seed, transform="train", drop_last=True, prefetch=4,
                                           collate_fn=batchd.detection_collate)
    val_loader = batchd.RemoteDataLoader(address, "det-val", batch_size=32, transform="val",
                                         collate_fn=batchd.detection_collate)
    model = CenterNet(NUM_CLASSES)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr,
                                                    total_steps=args.epochs * len(train_loader))
    with train_loader, val_loader:
        for epoch in range(args.epochs):
            train_loader.set_epoch(epoch)
            model.train()
            start, seen, wait, t = time.perf_counter(), 0, 0.0, time.perf_counter()
            for step, (images, targets) in enumerate(train_loader):
                wait += time.perf_counter() - t
                loss = loss_of(model(to_input(images)), targets)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                seen += len(images)
                if step % 20 == 0:
                    print(f"epoch {epoch + 1} step {step}/{len(train_loader)}: loss {loss.item():.3f}", flush=True)
                t = time.perf_counter()
            seconds = time.perf_counter() - start
            print(f"epoch {epoch + 1}: {seen} images in {seconds:.1f} s ({seen / seconds:.0f} img/s; waiting for "
                  f"data {wait / seconds:.1%} of it)", flush=True)
        ap, ap50 = evaluate(model, val_loader, args.data / "annotations" / "instances_val.json")
    print(f"val mAP@[.5:.95]: {ap:.4f}  mAP@.5: {ap50:.4f}")
    return ap


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=pathlib.Path, default=pathlib.Path(tempfile.gettempdir()) / "fashion-coco",
                        help="the generated dataset (made here if missing)")
    parser.add_argument("--images", type=int, default=2000, help="train canvases to generate (val: a fifth)")
    parser.add_argument("--fmnist", type=pathlib.Path, default=pathlib.Path("/usr/share/datasets/fashion-mnist"))
    parser.add_argument("--workers", type=int, default=2, help="worker processes of the local server")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="64 train images (in DATA-quick), 1 epoch of batches of 16: a smoke run")
    parser.add_argument("--min-map", type=float, default=0.0, help="exit 1 if the val mAP@[.5:.95] is lower")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.epochs, args.batch_size = 64, 1, 16
        args.data = args.data.with_name(args.data.name + "-quick")
    make_fashion_coco.ensure(args.data, args.images, seed=args.seed, fmnist=args.fmnist)
    with tempfile.TemporaryDirectory(prefix="batchd-det-") as tmp:
        config = write_config(pathlib.Path(tmp) / "server.yaml", datasets(args.data), presets(), args.workers)
        with local_server(config, args.workers) as address:
            ap = train(args, address)
    return 0 if ap >= args.min_map else 1


if __name__ == "__main__":
    sys.exit(main())
