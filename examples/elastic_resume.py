"""Elastic resume with torchrun: train with 4 processes, checkpoint, resume the same epoch with 3.

    batchd serve --config examples/fashion_mnist.yaml --address 127.0.0.1:50051 &
    torchrun --nproc-per-node=4 examples/elastic_resume.py --address 127.0.0.1:50051 --transform train \
        --steps 20 --checkpoint ckpt.pt
    torchrun --nproc-per-node=3 examples/elastic_resume.py --address 127.0.0.1:50051 --transform train \
        --checkpoint ckpt.pt --resume

On the CPU (the gloo backend). Every rank reads its shard through ``RemoteDataLoader`` (rank and
world size from the process group). The first job stops after ``--steps`` steps and rank 0 saves
the model, the optimizer and ``loader.state_dict()``; every rank of the second job loads that
same checkpoint and ``load_state_dict`` continues the epoch from the global position the first
job reached, sharded over its 3 ranks: every remaining sample once, with the bytes (the
augmentation included) the 4-process job would have given it. ``--record DIR`` writes each
rank's (position, sample index) pairs as JSON, to check that (tests/client/test_elastic.py).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import pathlib

import torch
import torch.distributed as dist
from torch import nn

import batchd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--address", required=True, help="a running batchd server (HOST:PORT)")
    p.add_argument("--dataset", default="fmnist-train")
    p.add_argument("--transform", help="a pipeline preset of the server (e.g. train); default: none")
    p.add_argument("--batch-size", type=int, default=64, help="samples per batch per rank")
    p.add_argument("--steps", type=int, default=0, help="stop after this many steps and checkpoint (0: the epoch)")
    p.add_argument("--checkpoint", type=pathlib.Path, required=True)
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--record", type=pathlib.Path, help="write rank R's (position, index) pairs to DIR/RANK.json")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    loader = batchd.RemoteDataLoader(
        args.address, args.dataset, batch_size=args.batch_size, shuffle=True, seed=0, transform=args.transform,
        transport="inline",
    )  # rank and world_size: from the process group
    checkpoint = torch.load(args.checkpoint, weights_only=False) if args.resume else None  # the same file on every rank
    if checkpoint is not None:
        loader.load_state_dict(checkpoint["loader"])  # saved by rank 0 of a job of another size
    batches = iter(loader)
    first = next(batches)  # its image's shape sizes the model (a preset may resize)
    model = nn.Sequential(nn.Flatten(), nn.Linear(first["image"][0].numel(), max(1, len(loader.info.classes))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    if checkpoint is not None:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
    model = nn.parallel.DistributedDataParallel(model)
    seen, steps = [], 0
    for batch in itertools.chain([first], batches):
        x = batch["image"].float() / 255.0
        loss = nn.functional.cross_entropy(model(x), batch["label"])
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the ranks
        optimizer.step()
        seen += zip(batch["position"].tolist(), batch["index"].tolist())
        steps += 1
        if steps == args.steps:
            break
    state = loader.state_dict()  # the global position reached: the same on every rank
    if rank == 0 and args.steps:
        torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "loader": state},
                   args.checkpoint)
    if args.record is not None:
        args.record.mkdir(parents=True, exist_ok=True)
        (args.record / f"{rank}.json").write_text(json.dumps({"world_size": world, "steps": steps, "seen": seen}))
    print(f"rank {rank}/{world}: {steps} steps, {len(seen)} samples, loss {loss.item():.3f}, "
          f"loader at epoch {state['epoch']}, position {state['position']}", flush=True)
    loader.close()
    del model, optimizer, loss  # free DDP while Python still runs: it sits in a reference cycle, and
    gc.collect()  # collected at exit, gloo's threads may abort the process (pytorch/pytorch#190489)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
