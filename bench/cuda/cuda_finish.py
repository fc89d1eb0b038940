"""GPU finishing (GpuTransform) in a ResNet-50 training step, against DataLoader with pin_memory.

    python -m bench.cuda.cuda_finish [--steps 30] [--workers N]    # needs a CUDA device
    python -m bench.cuda.cuda_finish --cpu                          # the cost table only, on the CPU

Table 1, the cost of finishing one batch (256 x 256x256x3 uint8 -> 256 x 3x224x224 bf16,
channels_last; medians): the hand-written ``.permute().float().div(255).sub(mean).div(std)``
against GpuTransform without and with crop + flips, positions on the device or on the CPU
(draws computed there, then copied), the draws alone, and the lookup through ``lut[index]``
instead of ``index_select``. On CUDA: device time (events) and host time to issue the kernels.

Table 2 (CUDA only), a ResNet-50 training step (batch 256, 224x224, bf16 autocast, channels_last,
SGD; the host synchronises after each step so that "data wait" is time blocked in ``next()``):

* ``DataLoader``: torch DataLoader, pin_memory=True, the same decode code (bench/peers/torch_loader.py),
  Resize(256) + RandomCrop(224) + HorizontalFlip and float32 normalisation in the workers (as
  ToTensor + Normalize do), ``.cuda(non_blocking=True)`` in the loop;
* ``batchd, by hand``: the server crops and flips, uint8 to the device on the side stream, the
  loop normalises by hand on the default stream;
* ``batchd + GpuTransform``: the server only resizes to 256x256; crop, flip, layout and
  normalisation run on the side stream (``gpu_transform=``; without that loader hook, in the loop).

Columns: step time, data wait as a share of the step, CPU per image of the loading processes
(server tree or DataLoader workers) and of this process, bytes per step host-to-device and the
bandwidth of that copy alone (pinned, events). Without CUDA it prints why and exits 0.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import torch

from batchd.client.device.finish import GpuTransform
from bench.peers.torch_loader import PhotoDataset

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
BATCH, SIDE, CROP = 256, 256, 224


def _median_time(fn, repeats: int, cuda: bool) -> tuple[float, float, float]:
    """(median and fastest device-or-wall ms, median host ms to issue) of ``fn()``."""
    fn()
    device, host = [], []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            start.record()
            fn()
            end.record()
            host.append((time.perf_counter() - t0) * 1e3)
            end.synchronize()
            device.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            device.append((time.perf_counter() - t0) * 1e3)
            host.append(device[-1])
    return statistics.median(device), min(device), statistics.median(host)


def cost_table(device: torch.device, batch: int, repeats: int) -> None:
    """Table 1: the cost of finishing one batch on ``device``."""
    cuda = device.type == "cuda"
    images = torch.randint(0, 256, (batch, SIDE, SIDE, 3), dtype=torch.uint8, device=device)
    positions = torch.arange(batch, device=device)
    positions_cpu = positions.cpu()
    mean, std = torch.tensor(MEAN, device=device).view(1, 3, 1, 1), torch.tensor(STD, device=device).view(1, 3, 1, 1)
    plain = GpuTransform(mean=MEAN, std=STD, dtype=torch.bfloat16, channels_last=True)
    augment = GpuTransform(mean=MEAN, std=STD, dtype=torch.bfloat16, channels_last=True, crop=CROP, hflip=0.5)
    lut = plain._lut(device, 3)
    offsets = torch.arange(0, 768, 256, dtype=torch.int32, device=device)
    rows = {
        "by hand: permute.float.div.sub.div -> bf16 channels_last": lambda: images.permute(0, 3, 1, 2).float().div(255)
        .sub(mean).div(std).to(torch.bfloat16, memory_format=torch.channels_last),
        "GpuTransform, no crop or flip": lambda: plain(images, positions, seed=1, epoch=0),
        "GpuTransform, crop 224 + hflip, positions on the device": lambda: augment(images, positions, seed=1, epoch=0),
        "GpuTransform, crop 224 + hflip, positions on the CPU": lambda: augment(images, positions_cpu, seed=1, epoch=0),
        "draws alone (Philox), on the device": lambda: augment.params(positions, seed=1, epoch=0, height=SIDE, width=SIDE),
        "draws alone (Philox), on the CPU": lambda: augment.params(positions_cpu, seed=1, epoch=0, height=SIDE, width=SIDE),
        "lookup alone via index_select": lambda: lut.index_select(0, torch.add(images, offsets).view(-1)),
        "lookup alone via lut[index]": lambda: lut[torch.add(images, offsets)],
    }
    if not cuda:  # the same thing twice on the CPU
        rows = {k: v for k, v in rows.items() if not k.endswith("on the CPU")}
    name = torch.cuda.get_device_name(device) if cuda else f"CPU ({torch.get_num_threads()} torch threads)"
    kind = "device" if cuda else "wall"
    print(f"\n| finishing {batch}x{SIDE}x{SIDE}x3 uint8 on {name} | {kind} ms, median | {kind} ms, fastest "
          f"| host ms to issue |")
    print("|---|---|---|---|")
    for label, fn in rows.items():
        med, fastest, host = _median_time(fn, repeats, cuda)
        print(f"| {label} | {med:.2f} | {fastest:.2f} | {host:.2f} |")
    if cuda:  # the hand-written expression is not the same bits on CUDA (a * (1/255) there); GpuTransform is
        cpu_images, cpu_mean, cpu_std = images.cpu(), mean.cpu(), std.cpu()
        hand = images.permute(0, 3, 1, 2).float().div(255).sub(mean).div(std).cpu()
        hand_cpu = cpu_images.permute(0, 3, 1, 2).float().div(255).sub(cpu_mean).div(cpu_std)
        ours = GpuTransform(mean=MEAN, std=STD)
        same = torch.equal(ours(images, positions, seed=1, epoch=0).cpu(), ours(cpu_images, positions_cpu, seed=1, epoch=0))
        print(f"\nfloat32 values of the hand-written expression that differ between CUDA and CPU: "
              f"{int((hand != hand_cpu).sum())} of {hand.numel()}; GpuTransform CUDA == CPU: {same}")


# --- Table 2: the training step (CUDA) -----------------------------------------------------------

def resnet50() -> torch.nn.Module:
    """torchvision's resnet50 when installed, else the same architecture written out (He et al. 2016)."""
    try:
        from torchvision.models import resnet50 as tv_resnet50

        return tv_resnet50()
    except ImportError:
        pass
    nn = torch.nn

    class Bottleneck(nn.Module):
        def __init__(self, cin, width, stride):
            super().__init__()
            cout = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
                nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
            self.skip = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, cin = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
                   nn.MaxPool2d(3, 2, 1)], 64
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, stride if i == 0 else 1))
            cin = width * 4
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2048, 1000))


class Trainer:
    """One SGD step of ResNet-50 on (images [B, 3, 224, 224] on the device, labels [B])."""

    def __init__(self, device: torch.device):
        self.model = resnet50().to(device, memory_format=torch.channels_last)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = torch.nn.functional.cross_entropy(self.model(images), labels)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def _own_cpu() -> float:
    t = os.times()
    return t.user + t.system


def _nbytes(batch) -> int:
    return sum(t.nbytes for t in (batch.values() if isinstance(batch, dict) else batch))


def _forever(loader):
    """Epoch after epoch of a RemoteDataLoader (each pass advances its epoch)."""
    while True:
        yield from loader


def run_steps(batches, finish, trainer: Trainer, warmup: int, steps: int, loader_cpu, copied=_nbytes) -> dict:
    """Time ``steps`` training steps; finish(batch) -> (images, labels) on the device; copied(batch) -> H2D bytes."""
    it = iter(batches)
    h2d_bytes = 0
    for _ in range(warmup):
        trainer(*finish(next(it)))
    torch.cuda.synchronize()
    c0, o0, t0, waited, images = loader_cpu(), _own_cpu(), time.perf_counter(), 0.0, 0
    for _ in range(steps):
        ta = time.perf_counter()
        batch = next(it)
        waited += time.perf_counter() - ta
        x, y = finish(batch)
        h2d_bytes = copied(batch)
        trainer(x, y)
        torch.cuda.synchronize()
        images += len(y)
    total = time.perf_counter() - t0
    return {"step_ms": total / steps * 1e3, "wait": waited / total, "loader_cpu_ms": (loader_cpu() - c0) / images * 1e3,
            "own_cpu_ms": (_own_cpu() - o0) / images * 1e3, "h2d_bytes": h2d_bytes, "images_s": images / total}


def h2d_gbps(nbytes: int, device: torch.device) -> float:
    """Bandwidth of one pinned host-to-device copy of ``nbytes`` (median of 10, CUDA events)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms, _, _ = _median_time(lambda: dst.copy_(src, non_blocking=True), 10, True)
    return nbytes / ms / 1e6


def training_table(args) -> None:
    """Table 2: the three loaders feeding the same training step."""
    import albumentations as A

    import batchd
    from bench import common
    from bench.fixtures import data
    from bench.measure import tree_cpu_seconds
    from bench.fixtures.server_proc import ServerProcess
    from bench.peers.torch_loader import Plan, _init_worker

    device = torch.device("cuda")
    data.ensure_photos()
    cfg = common.photos_x4_config()  # 12,000 samples: 46 batches of 256 per epoch
    presets = {  # plain JSON types, for the server's YAML config
        "crop_flip": json.loads(json.dumps(A.to_dict(A.Compose([A.Resize(SIDE, SIDE), A.RandomCrop(CROP, CROP),
                                                                A.HorizontalFlip(p=0.5)])))),
        "resize": json.loads(json.dumps(A.to_dict(A.Compose([A.Resize(SIDE, SIDE)])))),
    }
    trainer = Trainer(device)
    mean = torch.tensor(MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(STD, device=device).view(1, 3, 1, 1)
    finishing = GpuTransform(mean=MEAN, std=STD, dtype=torch.bfloat16, channels_last=True, crop=CROP, hflip=0.5)
    hook = "gpu_transform" in inspect.signature(batchd.RemoteDataLoader.__init__).parameters
    n = args.warmup + args.steps
    results = {}

    dataset = NormalisedPhotos("photos", cfg, data.LOCAL_CACHE, presets)
    plan = Plan()
    plan.set("crop_flip", len(dataset), BATCH, n, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_sampler=plan, num_workers=args.workers, pin_memory=True,
                                         worker_init_fn=_init_worker, multiprocessing_context="forkserver")
    me = os.getpid()
    results["DataLoader, pin_memory=True"] = run_steps(
        loader, lambda b: (b[0].to(device, non_blocking=True, memory_format=torch.channels_last),
                           b[1].to(device, non_blocking=True)),
        trainer, args.warmup, args.steps, lambda: tree_cpu_seconds(me) - _own_cpu())
    del loader

    with ServerProcess(datasets=common.server_datasets(photos=cfg), pipelines=presets, workers=args.workers,
                       cache_dir=data.CACHE) as server:
        server_cpu = lambda: tree_cpu_seconds(server.pid)  # noqa: E731
        kw = dict(batch_size=BATCH, shuffle=True, seed=0, drop_last=True, device="cuda", transport="shm")
        with batchd.RemoteDataLoader(server.address, "photos", transform="crop_flip", **kw) as ld:
            results["batchd, finish by hand"] = run_steps(
                _forever(ld), lambda b: (b["image"].permute(0, 3, 1, 2).float().div(255).sub(mean).div(std)
                               .contiguous(memory_format=torch.channels_last), b["label"]),
                trainer, args.warmup, args.steps, server_cpu)
        if hook:
            with batchd.RemoteDataLoader(server.address, "photos", transform="resize", gpu_transform=finishing,
                                         **kw) as ld:
                results["batchd + GpuTransform (side stream)"] = run_steps(
                    _forever(ld), lambda b: (b["image"], b["label"]), trainer, args.warmup, args.steps, server_cpu,
                    copied=lambda b: _nbytes(b) - b["image"].nbytes + len(b["label"]) * SIDE * SIDE * 3)
        else:
            print("RemoteDataLoader has no gpu_transform hook: GpuTransform runs in the loop, on the default stream")
            with batchd.RemoteDataLoader(server.address, "photos", transform="resize", **kw) as ld:
                results["batchd + GpuTransform (in the loop)"] = run_steps(
                    _forever(ld), lambda b: (finishing(b["image"], b["position"], seed=0, epoch=0), b["label"]),
                    trainer, args.warmup, args.steps, server_cpu)

    print(f"\n| ResNet-50, batch {BATCH}, bf16, {torch.cuda.get_device_name()}, {args.workers} loading processes "
          f"| step ms | img/s | data wait / step | loader CPU ms/img | trainer process CPU ms/img "
          f"| H2D MB/step | H2D GB/s (copy alone) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['step_ms']:.1f} | {r['images_s']:.0f} | {r['wait']:.1%} | {r['loader_cpu_ms']:.2f} "
              f"| {r['own_cpu_ms']:.2f} | {r['h2d_bytes'] / 1e6:.1f} | {h2d_gbps(r['h2d_bytes'], device):.1f} |")


class NormalisedPhotos(PhotoDataset):
    """PhotoDataset whose items are float32 [3, H, W] normalised in the worker (ToTensor + Normalize)."""

    def __getitem__(self, item):
        image, label = super().__getitem__(item)
        x = torch.from_numpy(image).permute(2, 0, 1).float().div(255)
        return x.sub(torch.tensor(MEAN).view(3, 1, 1)).div(torch.tensor(STD).view(3, 1, 1)), label


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cpu", action="store_true", help="only the cost table, on the CPU")
    parser.add_argument("--batch", type=int, default=BATCH, help="batch of the cost table")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per loader")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="server workers = DataLoader workers")
    args = parser.parse_args()
    if args.cpu:
        cost_table(torch.device("cpu"), args.batch, args.repeats)
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (python -m bench.cuda.cuda_finish --cpu gives the CPU cost table)")
        return 0
    cost_table(torch.device("cuda"), args.batch, args.repeats)
    training_table(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
