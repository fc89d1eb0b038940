"""Copy/compute overlap of the client's CUDA double buffering: prints a table (needs a GPU).

    python -m bench.cuda.cuda_overlap [--batch 256] [--repeats 5]

For a [B, 224, 224, 3] uint8 batch: time of the host-to-device transfer alone (pinned copy +
side-stream H2D), of a compute block alone (matmuls on the default stream), and of both issued
together as RemoteDataLoader does. Perfect overlap gives together = max(copy, compute).
Medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from batchd.client.device.transfer import CudaTransfer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--matmuls", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    transfer = CudaTransfer(torch.device("cuda"), slots=2)
    batch = {"image": torch.randint(0, 255, (args.batch, 224, 224, 3), dtype=torch.uint8)}
    a = torch.randn(4096, 4096, device="cuda")

    def compute():
        for _ in range(args.matmuls):
            a @ a

    def copy():
        out, event = transfer.to_device(batch)
        transfer.hand_over(out, event)

    def both():
        out, event = transfer.to_device(batch)
        compute()
        transfer.hand_over(out, event)

    def timed(fn) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    for fn in (copy, compute, both):
        fn()  # warm-up: pinned buffers, cuBLAS handles
    rows = {name: statistics.median(timed(fn) for _ in range(args.repeats)) * 1e3
            for name, fn in (("copy", copy), ("compute", compute), ("together", both))}
    ideal = max(rows["copy"], rows["compute"])
    print(f"| {torch.cuda.get_device_name()} | batch {args.batch}x224x224x3 uint8 |")
    print("|---|---|")
    for name, ms in rows.items():
        print(f"| {name} | {ms:.2f} ms |")
    print(f"| together / max(copy, compute) | {rows['together'] / ideal:.2f} |")
    print(f"| together / (copy + compute) | {rows['together'] / (rows['copy'] + rows['compute']):.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
