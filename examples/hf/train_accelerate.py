"""A training loop run by Accelerate, recorded with fsdp-verify: run it once on one process (the
reference) and once under torchrun or `accelerate launch` (the sharded twin), then
`fsdp-verify compare` the two runs (docs/accelerate.md).

    python examples/hf/train_accelerate.py --out runs/ref
    FSDP_VERIFY_PERTURB=1 python examples/hf/train_accelerate.py --out runs/ref-perturbed
    torchrun --nproc-per-node 2 examples/hf/train_accelerate.py --fsdp own --out runs/sharded
    fsdp-verify compare runs/ref runs/sharded --calibration runs/ref-perturbed

The tiny Llama and the data of common.py, every label counted (no padding: each rank's mean loss
is then a mean over the same number of tokens, and their average the global one); AdamW.

--fsdp (under torchrun):
  plugin              Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2)):
                      on a CPU-only machine Accelerate 1.15 ignores the plugin and wraps the model in
                      DistributedDataParallel, without a word: compare says NOT SHARDED
  plugin-without-cpu  the same plugin without cpu=True: on a CPU-only machine Accelerate runs each
                      process as if alone (DistributedType.NO): every rank reads the same batches
                      and trains its own copy. compare says NOT SHARDED (plain parameters on every
                      rank), and the data check names the batches every rank read
  own                 fully_shard (FSDP2) applied here, then Accelerator() (one process to
                      Accelerate: on CPU, cpu=True would wrap the sharded model in DDP, which fails
                      on DTensors), a DistributedSampler per rank
  none                (default) Accelerator(cpu=True): DistributedDataParallel under torchrun
"""

from __future__ import annotations

import argparse
import gc
import os

import torch
import torch.distributed as dist
from accelerate import Accelerator, FullyShardedDataParallelPlugin
from common import Tokens, make_model, shard
from torch.utils.data import DataLoader, DistributedSampler

from fsdp_verify.integrations.accelerate import recorder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the recorder's run directory")
    p.add_argument("--fsdp", choices=["none", "plugin", "plugin-without-cpu", "own"], default="none")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8, help="samples per step, all ranks together")
    p.add_argument("--no-record", action="store_true", help="train without the recorder")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    cpu = not torch.cuda.is_available()
    if args.fsdp.startswith("plugin"):
        plugin = FullyShardedDataParallelPlugin(
            fsdp_version=2,
            auto_wrap_policy="transformer_based_wrap",
            transformer_cls_names_to_wrap=["LlamaDecoderLayer"],
        )
        accelerator = Accelerator(cpu=cpu and args.fsdp == "plugin", fsdp_plugin=plugin)
    else:
        accelerator = Accelerator(cpu=cpu and args.fsdp == "none")
    model = make_model()
    if args.fsdp == "own":
        shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Tokens(padded=False)
    # The same shuffle on one process and on W. Where Accelerate shards the data itself (DDP, FSDP)
    # it slices each global batch; with our own sharding it sees one process, so a sampler per rank.
    ranks, rank = (dist.get_world_size(), dist.get_rank()) if args.fsdp == "own" else (1, 0)
    sampler = DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.global_batch // world, sampler=sampler)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    rec = None if args.no_record else recorder(accelerator, model, optimizer, out=args.out)
    for step, batch in enumerate(loader, start=1):
        outputs = model(**batch)
        accelerator.backward(outputs.loss)
        optimizer.step()
        optimizer.zero_grad()
        if rec:
            rec.step(loss=outputs.loss, logits=outputs.logits, batch=batch)
        if step == args.steps:
            break
    if rec:
        rec.close()
    # The model goes before its process group: Accelerate's DDP Reducer must not hold the group's
    # last reference, or torch 2.13's gloo can deadlock at exit (tests/upstream/
    # test_ddp_gloo_teardown_deadlock.py).
    accelerator.free_memory()
    del model, optimizer, loader, rec
    gc.collect()
    if dist.is_initialized():
        # Every rank past its last collective before any tears its connections down: once in 8
        # runs of --fsdp trainer a rank aborted at exit ("terminate called without an active
        # exception") after training and recording were done.
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
