"""A plain single-process training script (the one a user trusts), with the recorder.

    python examples/loop/train_single.py --out runs/ref
    FSDP_VERIFY_PERTURB=1 python examples/loop/train_single.py --out runs/ref-perturbed   # calibration

The sampler is DistributedSampler with one replica: the same shuffle as the sharded twin's
samplers, so step i's batch here is the union of the ranks' batches there.
"""

from __future__ import annotations

import argparse

import torch
from common import add_common_arguments, loss_fn, make_dataset, make_model
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_verify.recorder import Recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    add_common_arguments(p)
    args = p.parse_args()
    torch.set_num_threads(1)
    model = make_model()
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


if __name__ == "__main__":
    main()
