"""One training script for the transformers Trainer, recorded with fsdp-verify's RecorderCallback:
run it once on one process (the reference) and once under torchrun (the sharded twin), then
`fsdp-verify compare` the two runs (docs/hf-trainer.md).

    python examples/hf/train_trainer.py --out runs/ref
    FSDP_VERIFY_PERTURB=1 python examples/hf/train_trainer.py --out runs/ref-perturbed    # calibration
    torchrun --nproc-per-node 2 examples/hf/train_trainer.py --fsdp own --out runs/sharded
    fsdp-verify compare runs/ref runs/sharded --calibration runs/ref-perturbed

The model is a tiny Llama (fsdp_verify.models.hf.tiny_llama: 2 layers of width 16, built from a
config, nothing downloaded); the data 64 random sequences of 16 tokens whose labels end in -100
padding after a random length, so ranks hold different numbers of tokens (a per-rank mean loss
is then wrong, see --bug); both in common.py.

--fsdp (under torchrun):
  trainer  the Trainer's own FSDP2: TrainingArguments(fsdp=..., fsdp_config={"fsdp_version": 2}).
           On a CPU-only machine Accelerate 1.15 ignores it and trains under
           DistributedDataParallel, without a word: compare says NOT SHARDED.
  own      fully_shard (FSDP2) applied here, each decoder layer then the root, and the sharded
           model handed to the Trainer. On CPU the Trainer must then not wrap it (use_cpu=True
           makes Accelerate wrap it in DDP, which fails on DTensors): Accelerate runs as one
           process (DistributedType.NO), so this script does what it would do for several: a
           sampler per rank, and the loss normalised by the tokens of all ranks (its count
           all-reduced, the loss multiplied by the world size, as the Trainer does with
           average_tokens_across_devices).
  none     (default) the Trainer's data parallelism: DDP under torchrun.

Planted bugs:
  --bug per-rank-mean  compute_loss returns the mean over this rank's tokens: the ranks' means
                       averaged are not the mean over all tokens when ranks hold different counts
  --grad-accum K       gradient accumulation steps: a sharded run with another K than its
                       reference's trains on another batch per optimizer step
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.nn.functional as F
from common import Tokens, make_model, shard
from torch.utils.data import DistributedSampler
from transformers import Trainer, TrainingArguments

from fsdp_verify.integrations.trainer import RecorderCallback


class ExampleTrainer(Trainer):
    def __init__(self, *args, own_sharding: bool = False, per_rank_mean: bool = False, **kwargs):
        self.own_sharding, self.per_rank_mean = own_sharding, per_rank_mean
        super().__init__(*args, **kwargs)

    def _get_train_sampler(self, train_dataset=None):
        """The same shuffle on one process and on W: each rank's share is a slice of the global
        batch. Under the Trainer's own data parallelism Accelerate slices the batches itself."""
        data = train_dataset if train_dataset is not None else self.train_dataset
        ranks, rank = (dist.get_world_size(), dist.get_rank()) if self.own_sharding else (1, 0)
        return DistributedSampler(data, num_replicas=ranks, rank=rank, shuffle=True, seed=self.args.seed)

    def _get_num_items_in_batch(self, batch_samples, device):
        count = super()._get_num_items_in_batch(batch_samples, device)
        if self.own_sharding and count is not None:  # the tokens of every rank's share
            count = count.clone()
            dist.all_reduce(count)
        return count

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.per_rank_mean:  # the bug: the mean over this rank's tokens
            outputs = model(input_ids=inputs["input_ids"])
            logits, labels = outputs.logits[:, :-1], inputs["labels"][:, 1:]
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)
            return (loss, outputs) if return_outputs else loss
        result = super().compute_loss(model, inputs, True, num_items_in_batch)
        loss, outputs = result
        if self.own_sharding and num_items_in_batch is not None:  # FSDP2 averages the ranks' gradients
            loss = loss * dist.get_world_size()
        return (loss, outputs) if return_outputs else loss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the recorder's run directory")
    p.add_argument("--fsdp", choices=["none", "trainer", "own"], default="none")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=8, help="samples per micro-batch, all ranks together")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--bug", choices=["per-rank-mean"])
    p.add_argument("--no-record", action="store_true", help="train without the recorder")
    args = p.parse_args()
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    fsdp = {}
    if args.fsdp == "trainer":
        fsdp = {
            "fsdp": "full_shard",
            "fsdp_config": {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]},
        }
    scratch = tempfile.TemporaryDirectory(prefix="hf-trainer-")  # the Trainer's output_dir: it saves nothing
    training = TrainingArguments(
        output_dir=scratch.name,
        per_device_train_batch_size=args.global_batch // world,
        gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps,
        learning_rate=1e-3,
        seed=0,
        # own sharding on a CPU-only machine: Accelerate must not wrap the sharded model in DDP
        use_cpu=not torch.cuda.is_available() and args.fsdp != "own",
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        disable_tqdm=True,
        **fsdp,
    )
    model = make_model()
    if args.fsdp == "own":
        shard(model)
    trainer = ExampleTrainer(
        model=model,
        args=training,
        train_dataset=Tokens(),
        own_sharding=args.fsdp == "own",
        per_rank_mean=args.bug == "per-rank-mean",
    )
    if not args.no_record:
        RecorderCallback(trainer, out=args.out)
    trainer.train()
    # The model goes before its process group: the Trainer's DDP Reducer must not hold the group's
    # last reference, or torch 2.13's gloo can deadlock at exit (tests/upstream/
    # test_ddp_gloo_teardown_deadlock.py).
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    if dist.is_initialized():
        # Every rank past its last collective before any tears its connections down: once in 8
        # runs of --fsdp trainer a rank aborted at exit ("terminate called without an active
        # exception") after training and recording were done.
        dist.barrier()
        dist.destroy_process_group()
    scratch.cleanup()


if __name__ == "__main__":
    main()
