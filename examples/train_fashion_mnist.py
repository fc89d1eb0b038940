"""Train a small CNN on Fashion-MNIST through a batchd server, then report test accuracy.

    python examples/train_fashion_mnist.py                      # starts a local server itself
    python examples/train_fashion_mnist.py --address HOST:PORT  # uses a running server

The local server is ``batchd serve --config examples/fashion_mnist.yaml`` on a free port; its
``train`` preset (a light Affine + flip) augments the training batches. With 2 epochs the test
accuracy is about 0.88-0.90 on a CPU.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

import batchd
from local_server import local_server

HERE = pathlib.Path(__file__).resolve().parent
# Fashion-MNIST's pixel mean and std over the training set (x / 255).
MEAN, STD = 0.2860, 0.3530


class SmallCNN(nn.Module):
    """[B, 1, 28, 28] float -> [B, 10] logits."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.drop = nn.Dropout(0.25)
        self.fc1 = nn.Linear(64 * 7 * 7, 128)
        self.fc2 = nn.Linear(128, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        x = self.drop(torch.flatten(x, 1))
        return self.fc2(self.drop(F.relu(self.fc1(x))))


def to_input(image: torch.Tensor) -> torch.Tensor:
    """uint8 [B, 28, 28, 1] -> normalised float [B, 1, 28, 28]."""
    return (image.permute(0, 3, 1, 2).float() / 255.0 - MEAN) / STD


def evaluate(model: nn.Module, loader: batchd.RemoteDataLoader, device: torch.device) -> float:
    model.eval()
    correct = total = 0
    with torch.no_grad():
        for batch in loader:
            logits = model(to_input(batch["image"].to(device)))
            correct += (logits.argmax(1) == batch["label"].to(device)).sum().item()
            total += batch["label"].numel()
    return correct / total


def transport_summary(loader: batchd.RemoteDataLoader) -> str:
    """How a loader's batches came, as one line of JSON: ``batches_per_server`` {address: batches}
    and ``bytes_received`` {"shm", "socket", "inline": bytes} (``RemoteDataLoader.stats()``)."""
    stats = loader.stats()
    return json.dumps({k: stats[k] for k in ("batches_per_server", "bytes_received")}, sort_keys=True)


def train(args: argparse.Namespace, address: str | list[str]) -> float:
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.manual_seed(args.seed)
    train_loader = batchd.RemoteDataLoader(
        address, "fmnist-train", batch_size=args.batch_size, shuffle=True, seed=args.seed,
        transform=args.transform or None, device=device, prefetch=4, transport=args.transport,
    )
    test_loader = batchd.RemoteDataLoader(address, "fmnist-test", batch_size=1000, device=device,
                                          transport=args.transport)
    model = SmallCNN().to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=args.lr, total_steps=args.epochs * len(train_loader))
    with train_loader, test_loader:
        for epoch in range(args.epochs):
            train_loader.set_epoch(epoch)
            model.train()
            bar = tqdm(train_loader, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch",
                       mininterval=0.5 if sys.stderr.isatty() else 10.0)
            start, seen = time.perf_counter(), 0
            for batch in bar:
                x, y = to_input(batch["image"]), batch["label"]
                loss = F.cross_entropy(model(x), y)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()
                seen += y.numel()
                bar.set_postfix(loss=f"{loss.item():.3f}", img_s=f"{seen / (time.perf_counter() - start):.0f}", refresh=False)
            accuracy = evaluate(model, test_loader, device)
            print(f"epoch {epoch + 1}: {seen} images in {time.perf_counter() - start:.1f} s, "
                  f"test accuracy {accuracy:.4f}", flush=True)
        for name, loader in (("train", train_loader), ("test", test_loader)):
            print(f"{name} loader: {transport_summary(loader)}")
    print(f"test accuracy: {accuracy:.4f}")
    return accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--address", action="append",
                        help="a running batchd server (default: start a local one); give it several times to read "
                             "from several servers at once (e.g. a sidecar's socket and a remote pool)")
    parser.add_argument("--config", type=pathlib.Path, default=HERE / "fashion_mnist.yaml",
                        help="config of the local server")
    parser.add_argument("--workers", type=int, help="worker processes of the local server")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--transform", default="train", help="preset pipeline name ('' for none)")
    parser.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--transport", default="auto", choices=["auto", "shm", "socket", "inline"],
                        help="shared memory with a same-host server, the socket data plane with a remote one (auto: "
                             "whichever works), or bytes in the messages")
    parser.add_argument("--min-accuracy", type=float, default=0.0, help="exit 1 if the test accuracy is lower")
    args = parser.parse_args(argv)
    if args.address:
        accuracy = train(args, args.address)
    else:
        with local_server(args.config, args.workers) as address:
            accuracy = train(args, address)
    return 0 if accuracy >= args.min_accuracy else 1


if __name__ == "__main__":
    sys.exit(main())
