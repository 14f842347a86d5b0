"""The sharded twin of train_single.py: FSDP2 (`fully_shard` per block, then the root), each rank
its share of every global batch through DistributedSampler, with the recorder.

    torchrun --nproc-per-node 2 examples/loop/train_fsdp.py --out runs/sharded
    (--bf16 on both scripts: FSDP2 mixed precision; the reference then runs fully_shard on one rank)
    fsdp-verify compare runs/ref runs/sharded --calibration runs/ref-perturbed

Planted bugs (`--bug`), each one a classic of hand-written sharded loops:
  unsharded-sampler  every rank reads the same samples (the sampler is not given the rank)
  grad-noise         rank 1 scales its gradient shards by 1 + 2e-6 before the optimizer step
                     (with --bf16, by 1 + 2e-2: 2e-6 is far below a bf16 ulp, 7.8e-3, so no
                     comparison of bf16 runs can see it)
  optimizer-before-shard  the optimizer built before fully_shard: it holds (and steps) the old,
                     unsharded parameters; the Recorder refuses it at once
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import add_common_arguments, loss_fn, make_dataset, make_model, shard
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_verify.recorder import Recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument("--bug", choices=["unsharded-sampler", "grad-noise", "optimizer-before-shard"])
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    if args.bug == "optimizer-before-shard":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    shard(model, mesh, args.bf16)
    if args.bug != "optimizer-before-shard":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = make_dataset()
    if args.bug == "unsharded-sampler":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    rec = None if args.no_record else Recorder(model, optimizer, out=args.out, full_steps=args.full_steps)
    for step, (inputs, targets) in enumerate(loader, start=1):
        logits = model(inputs)
        loss = loss_fn(logits, targets)
        loss.backward()
        if args.bug == "grad-noise" and rank == 1:
            with torch.no_grad():
                for param in model.parameters():
                    param.grad.to_local().mul_(1 + (2e-2 if args.bf16 else 2e-6))
        optimizer.step()
        optimizer.zero_grad()
        if rec:
            rec.step(loss=loss, logits=logits, batch=(inputs, targets))
        if rank == 0:
            print(f"step {step}: loss {loss.item():.10f} (rank 0's share)", flush=True)
        if step == args.steps:
            break
    if rec:
        rec.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
