"""Mask R-CNN through batchd on a GPU: data-loading time per sample, sequential loop vs batchd (needs a GPU).

    python -m bench.cuda.cuda_maskrcnn [--steps 50] [--batch-size 4] [--workers 4]

The workload of the classic asynchronous-loader measurement on Mask R-CNN data: torchvision's
``maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=11)`` trained with SGD
for ``--steps`` steps on Table 13's data (``bench/data/fashion-coco-384``: COCO JSON with polygon
and RLE masks, 384-512 px canvases) under Table 13's ``det-train`` pipeline (random crop, flip,
colour, ``bbox_params``), two ways:

- sequential: each step loads its batch in the training process (``bench/peers/torch_coco.py``'s
  Dataset: OpenCV decode, pycocotools' ``annToMask``, the same albumentations Compose; what
  torchvision's references do with ``num_workers=0``), then trains on it;
- batchd: ``RemoteDataLoader(..., device="cuda", collate_fn=batchd.detection_collate)`` from a
  local server with ``--workers`` workers: batches are built ahead, copied to the GPU on a side
  stream, and handed over as torchvision's (images, targets).

Per method: data time per sample (time blocked waiting for the batch, / batch size), step time
per sample (forward, backward, optimiser step, synchronised), and images/s. Each step ends with
``torch.cuda.synchronize()`` so that the two are not mixed up by asynchronous CUDA work.

Not yet run: no GPU was lent while it was written (README, Status). torchvision's detection
models need a torchvision build that matches torch (``pip install 'batchd[gpu]'`` from the index
of your torch build); without CUDA or torchvision the script says so and exits 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

NUM_CLASSES = 11  # background + Fashion-MNIST's 10 (category ids 1..10)


def model_or_reason():
    """(Mask R-CNN on CUDA, None) or (None, why it cannot run here)."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    try:
        from torchvision.models.detection import maskrcnn_resnet50_fpn
    except Exception as e:  # ImportError, or torchvision's operators not matching this torch build
        return None, f"torchvision's detection models do not load here ({type(e).__name__}: {e})"
    model = maskrcnn_resnet50_fpn(weights=None, weights_backbone=None, num_classes=NUM_CLASSES)
    return model.cuda().train(), None


def to_model(images, targets, device):
    """(images float [3, H, W] in [0, 1], targets with boxes, labels, masks) on ``device``."""
    images = [im.to(device, non_blocking=True).permute(2, 0, 1).float().div_(255) for im in images]
    targets = [{k: t[k].to(device, non_blocking=True) for k in ("boxes", "labels", "masks")} for t in targets]
    return images, targets


def run(model, batches, steps: int, warmup: int, device) -> dict:
    """Train on ``batches`` for warmup + steps steps; data time (blocked in next()) and step time per
    step, of the timed steps."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.005, momentum=0.9, weight_decay=1e-4)
    it = iter(batches)
    data_s, step_s, images = [], [], 0
    for step in range(warmup + steps):
        t0 = time.perf_counter()
        batch_images, batch_targets = next(it)
        t1 = time.perf_counter()
        images_in, targets_in = to_model(batch_images, batch_targets, device)
        losses = model(images_in, targets_in)
        loss = sum(losses.values())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        optimizer.step()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if step >= warmup:
            data_s.append(t1 - t0)
            step_s.append(t2 - t1)
            images += len(batch_images)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"loss {loss.item()} at step {step}")
    return {"data_per_sample": statistics.median(data_s) / (images / steps),
            "step_per_sample": statistics.median(step_s) / (images / steps),
            "images_per_s": images / (sum(data_s) + sum(step_s)), "loss": float(loss)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--workers", type=int, default=4, help="batchd server workers")
    args = p.parse_args(argv)
    model, reason = model_or_reason()
    if model is None:
        print(f"{reason}: nothing to measure")
        return 0
    import batchd
    from bench.fixtures import data
    from bench.fixtures.server_proc import ServerProcess
    from bench.tables.table_detection import PRESET, pipeline_dict
    from bench.peers.torch_coco import CocoMasks, make_loader

    root = data.ensure_fashion_coco()
    images, annotations = root / "images" / "train", root / "annotations" / "instances_train.json"
    device = torch.device("cuda")
    torch.manual_seed(0)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    results = {}
    sequential, order = make_loader(CocoMasks(images, annotations, pipeline_dict()), args.batch_size, 0)
    order.set(len(sequential.dataset), (args.warmup + args.steps) * args.batch_size, seed=0)
    results["sequential (load, then train)"] = run(model, sequential, args.steps, args.warmup, device)
    model.load_state_dict(initial)  # the same start for both
    server = ServerProcess(datasets={"det": {"kind": "coco", "images": str(images), "annotations": str(annotations),
                                             "masks": True}},
                           pipelines={PRESET: pipeline_dict()}, workers=args.workers, cache_dir=data.CACHE).start()
    try:
        with batchd.RemoteDataLoader(server.address, "det", batch_size=args.batch_size, shuffle=True, seed=0,
                                     drop_last=True, transform=PRESET, device=device, prefetch=2 * args.workers,
                                     collate_fn=batchd.detection_collate) as loader:
            results[f"batchd, {args.workers} workers"] = run(model, loader, args.steps, args.warmup, device)
    finally:
        server.stop()
    print(f"| {torch.cuda.get_device_name()}, maskrcnn_resnet50_fpn, batch {args.batch_size} | data ms per sample "
          "| step ms per sample | images/s | last loss |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['data_per_sample'] * 1e3:.1f} | {r['step_per_sample'] * 1e3:.1f} | "
              f"{r['images_per_s']:.1f} | {r['loss']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
