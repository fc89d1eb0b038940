"""Train a small FCN for semantic segmentation through a batchd server, then print the val mIoU.

    python examples/train_segmentation.py            # generates the data if missing, starts a local server
    python examples/train_segmentation.py --quick    # a smoke run: few images, one short epoch

The data (examples/make_fashion_coco.py, made in ``--data`` if missing): Fashion-MNIST items placed
on canvases of 96-160 px, and VOC-style palette masks of class indices (the item's category id
1..10, 0 for the background, 255 on item borders: ignored). The local server serves them as
``kind: segmentation``; its ``train`` preset crops 96x96 with a flip and a brightness/contrast
jitter, moving image and mask together (each sample draws from its own random stream), its
``val`` preset pads each canvas to 160x160 (mask padding 255, ignored). The model is a small
encoder-decoder in plain torch; mIoU is the mean over the 11 classes of the val split's
intersection over union, from one confusion matrix over every val pixel that is not 255.
"""

from __future__ import annotations

import argparse
import pathlib
import sys
import tempfile
import time

import albumentations as A
import cv2
import torch
import torch.nn.functional as F
from torch import nn

import batchd
import make_fashion_coco
from local_server import local_server, write_config

HERE = pathlib.Path(__file__).resolve().parent
CLASSES = ["background", *make_fashion_coco.CLASSES]  # mask value v is CLASSES[v]
IGNORE = make_fashion_coco.BORDER
CROP, VAL_SIDE = 96, 160


def presets() -> dict:
    """The server's presets: ``train`` (random 96x96 crop, flip, colour jitter) and ``val`` (pad to 160x160)."""
    train = A.Compose([A.RandomCrop(CROP, CROP), A.HorizontalFlip(p=0.5), A.RandomBrightnessContrast(p=0.5)])
    val = A.Compose([A.PadIfNeeded(VAL_SIDE, VAL_SIDE, position="top_left", border_mode=cv2.BORDER_CONSTANT,
                                   fill=0, fill_mask=IGNORE)])
    return {"train": A.to_dict(train), "val": A.to_dict(val)}


def datasets(data: pathlib.Path) -> dict:
    return {f"seg-{split}": {"kind": "segmentation", "images": str(data / "images" / split),
                             "masks": str(data / "masks" / split), "ignore_index": IGNORE}
            for split in ("train", "val")}


def block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class SmallFCN(nn.Module):
    """float [B, 3, H, W] (H, W multiples of 8) -> logits [B, classes, H, W]: three stride-2 stages
    (1/2, 1/4, 1/8), a decoder back to 1/2 with skips (U-Net's), logits upsampled bilinearly."""

    def __init__(self, classes: int) -> None:
        super().__init__()
        self.s1 = nn.Sequential(block(3, 32, 2), block(32, 32))
        self.s2 = nn.Sequential(block(32, 64, 2), block(64, 64))
        self.s3 = nn.Sequential(block(64, 128, 2), block(128, 128), block(128, 128))
        self.r3, self.r2 = nn.Conv2d(128, 64, 1), nn.Conv2d(64, 32, 1)
        self.d2, self.d1 = block(128, 64), block(64, 32)
        self.head = nn.Conv2d(32, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1 = self.s1(x)
        x2 = self.s2(x1)
        x3 = self.s3(x2)
        y = self.d2(torch.cat([F.interpolate(self.r3(x3), scale_factor=2.0), x2], 1))
        y = self.d1(torch.cat([F.interpolate(self.r2(y), scale_factor=2.0), x1], 1))
        return F.interpolate(self.head(y), scale_factor=2.0, mode="bilinear", align_corners=False)


def to_input(image: torch.Tensor) -> torch.Tensor:
    """uint8 [B, H, W, 3] -> float [B, 3, H, W], about zero mean and unit variance."""
    return (image.permute(0, 3, 1, 2).float() - 60.0) / 60.0


def confusion(pred: torch.Tensor, mask: torch.Tensor, classes: int) -> torch.Tensor:
    """int64 [classes, classes]: counts of (true class, predicted class) over the pixels not IGNORE."""
    keep = mask != IGNORE
    return torch.bincount(mask[keep].long() * classes + pred[keep], minlength=classes * classes).view(classes, classes)


def miou(matrix: torch.Tensor) -> tuple[float, list[float]]:
    """(mean IoU over the classes that occur or are predicted, IoU per class; nan where neither)."""
    inter = matrix.diag().double()
    union = matrix.sum(0).double() + matrix.sum(1).double() - inter
    iou = torch.where(union > 0, inter / union.clamp(min=1), torch.tensor(float("nan"), dtype=torch.float64))
    return float(iou[~iou.isnan()].mean()), iou.tolist()


def evaluate(model: nn.Module, loader: batchd.RemoteDataLoader) -> tuple[float, list[float]]:
    model.eval()
    matrix = torch.zeros(len(CLASSES), len(CLASSES), dtype=torch.int64)
    with torch.no_grad():
        for batch in loader:
            pred = model(to_input(batch["image"])).argmax(1)
            matrix += confusion(pred, batch["mask"], len(CLASSES))
    return miou(matrix)


def train(args: argparse.Namespace, address: str) -> float:
    torch.manual_seed(args.seed)
    train_loader = batchd.RemoteDataLoader(address, "seg-train", batch_size=args.batch_size, shuffle=True,
                                           seed=args.seed, transform="train", drop_last=True, prefetch=4)
    val_loader = batchd.RemoteDataLoader(address, "seg-val", batch_size=32, transform="val")
    model = SmallFCN(len(CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-4)
    steps = args.epochs * len(train_loader)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=steps)
    with train_loader, val_loader:
        for epoch in range(args.epochs):
            train_loader.set_epoch(epoch)
            model.train()
            start, seen, wait, t = time.perf_counter(), 0, 0.0, time.perf_counter()
            for step, batch in enumerate(train_loader):
                wait += time.perf_counter() - t
                logits = model(to_input(batch["image"]))
                loss = F.cross_entropy(logits, batch["mask"].long(), ignore_index=IGNORE)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                seen += len(batch["index"])
                if step % 20 == 0:
                    print(f"epoch {epoch + 1} step {step}/{len(train_loader)}: loss {loss.item():.3f}", flush=True)
                t = time.perf_counter()
            seconds = time.perf_counter() - start
            print(f"epoch {epoch + 1}: {seen} images in {seconds:.1f} s ({seen / seconds:.0f} img/s; waiting for "
                  f"data {wait / seconds:.1%} of it)", flush=True)
        mean, per_class = evaluate(model, val_loader)
    print("val IoU per class: " + ", ".join(f"{n} {v:.3f}" for n, v in zip(CLASSES, per_class)))
    print(f"val mIoU: {mean:.4f}")
    return mean


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
    parser.add_argument("--min-miou", type=float, default=0.0, help="exit 1 if the val mIoU is lower")
    args = parser.parse_args(argv)
    if args.quick:
        args.images, args.epochs, args.batch_size = 64, 1, 16
        args.data = args.data.with_name(args.data.name + "-quick")
    make_fashion_coco.ensure(args.data, args.images, seed=args.seed, fmnist=args.fmnist)
    with tempfile.TemporaryDirectory(prefix="batchd-seg-") as tmp:
        config = write_config(pathlib.Path(tmp) / "server.yaml", datasets(args.data), presets(), args.workers)
        with local_server(config, args.workers) as address:
            mean = train(args, address)
    return 0 if mean >= args.min_miou else 1


if __name__ == "__main__":
    sys.exit(main())
