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
  optimizer-not-loaded  on --resume-from, the model is loaded and the optimizer is not (a fresh
                     Adam: its moments zero, its step count restarted)
  ddp-fallback       the model wrapped in DistributedDataParallel instead of fully_shard (what
                     Accelerate and the transformers Trainer do on CPU with an FSDP config): a correct
                     data-parallel run, but not sharded; compare says NOT SHARDED
  not-sharded        fully_shard never applied and nothing else either: each rank trains its own copy
                     on its share of the data; compare says NOT SHARDED (the replicas drift apart)

--ddp: the same loop as plain DistributedDataParallel, recorded with `sharded=False` (replicated on
purpose): compare judges it like the sharded run, and checks that its replicas agree.

Checkpoint and resume (docs/resume.md), with torch.distributed.checkpoint (resharded on load):
    torchrun --nproc-per-node 2 train_fsdp.py --out runs/a --save-after 2 --checkpoint ckpt
    torchrun --nproc-per-node 3 train_fsdp.py --out runs/b --resume-from ckpt --recorded-before runs/a
    fsdp-verify compare runs/ref runs/b --calibration runs/ref-perturbed   # runs/a and runs/b as one run
"""

from __future__ import annotations

import argparse
import gc

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from common import add_common_arguments, loss_fn, make_dataset, make_model, shard
from torch.distributed.checkpoint.state_dict import get_state_dict, set_model_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_verify.recorder import Recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(p)
    p.add_argument(
        "--bug",
        choices=[
            "unsharded-sampler",
            "grad-noise",
            "optimizer-before-shard",
            "optimizer-not-loaded",
            "ddp-fallback",
            "not-sharded",
        ],
    )
    p.add_argument("--ddp", action="store_true", help="DistributedDataParallel instead of FSDP2, on purpose")
    p.add_argument("--save-after", type=int, help="save a checkpoint into --checkpoint after this step, and stop")
    p.add_argument("--checkpoint", help="the checkpoint directory --save-after writes")
    p.add_argument("--resume-from", help="a checkpoint directory to load before training on")
    p.add_argument("--recorded-before", help="with --resume-from: the run directory the saving run recorded")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    model = make_model()
    if args.bug == "optimizer-before-shard":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    if args.ddp or args.bug == "ddp-fallback":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif args.bug != "not-sharded":
        shard(model, mesh, args.bf16)
    if args.bug != "optimizer-before-shard":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    data = make_dataset()
    if args.bug == "unsharded-sampler":
        sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    else:
        sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler, drop_last=True)
    done = load(args.resume_from, model, optimizer, args.bug) if args.resume_from else 0
    record = dict(full_steps=args.full_steps, resumed_from=args.recorded_before, sharded=False if args.ddp else None)
    rec = None if args.no_record else Recorder(model, optimizer, out=args.out, **record)
    for step, (inputs, targets) in enumerate(loader, start=1):
        if step <= done:  # the data position: the batches the run before consumed
            continue
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
        if step == args.save_after:
            save(args.checkpoint, model, optimizer, step)
            break
        if step == args.steps:
            break
    if rec:
        rec.close()
    # The model goes before its process group: DDP's Reducer must not hold the group's last
    # reference, or torch 2.13's gloo can deadlock at exit (tests/upstream/
    # test_ddp_gloo_teardown_deadlock.py). The group's own Python handle frees it without the GIL.
    del model, optimizer, rec
    gc.collect()
    dist.destroy_process_group()


def save(path: str, model, optimizer, step: int) -> None:
    """Model and optimizer as DCP saves them (each rank its shards), and the step: the data
    position (the sampler's shuffle is seeded, so the batches are those after it)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd, "step": torch.tensor([step])}, checkpoint_id=path)


def load(path: str, model, optimizer, bug: str | None) -> int:
    """Load into this run's sharding (DCP reshards on read); returns the step saved after."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "step": torch.tensor([0])}
    if bug != "optimizer-not-loaded":
        state["optim"] = optim_sd
    dcp.load(state, checkpoint_id=path)
    if bug == "optimizer-not-loaded":
        set_model_state_dict(model, state["model"])
        # get_state_dict gave the fresh Adam a zero-gradient step's state (step 1, zero moments);
        # dropped, it is the fresh optimizer of a loop that only restores the model.
        optimizer.state.clear()
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return int(state["step"][0])


if __name__ == "__main__":
    main()
