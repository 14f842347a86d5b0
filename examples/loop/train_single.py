"""A plain single-process training script (the one a user trusts), with the recorder.

    python examples/loop/train_single.py --out runs/ref
    FSDP_VERIFY_PERTURB=1 python examples/loop/train_single.py --out runs/ref-perturbed   # calibration

The sampler is DistributedSampler with one replica: the same shuffle as the sharded twin's
samplers, so step i's batch here is the union of the ranks' batches there.

With --bf16 the script runs under FSDP2's `fully_shard` on a one-rank mesh with the sharded twin's
MixedPrecisionPolicy (one process, a gloo group of one): it casts and reduces where the sharded run
does, so `compare` can judge the pair; only the reduction order and the world size differ.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
from common import add_common_arguments, loss_fn, make_dataset, make_model, shard
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_verify.recorder import Recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_common_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = make_model()
    if args.bf16:
        from torch.distributed.device_mesh import init_device_mesh

        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        shard(model, init_device_mesh("cpu", (1,)), bf16=True)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = make_dataset()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch, sampler=sampler, drop_last=True)
    rec = None if args.no_record else Recorder(model, optimizer, out=args.out, full_steps=args.full_steps)
    for step, (inputs, targets) in enumerate(loader, start=1):
        logits = model(inputs)
        loss = loss_fn(logits, targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if rec:
            rec.step(loss=loss, logits=logits, batch=(inputs, targets))
        print(f"step {step}: loss {loss.item():.10f}", flush=True)
        if step == args.steps:
            break
    if rec:
        rec.close()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
