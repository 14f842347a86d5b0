"""A Lightning training script recorded with fsdp-verify's RecorderCallback: run it once on one
process (the reference) and once under torchrun (the sharded twin), then `fsdp-verify compare`
the two runs (docs/lightning.md).

    python examples/lightning/train_lightning.py --out runs/ref
    FSDP_VERIFY_PERTURB=1 python examples/lightning/train_lightning.py --out runs/ref-perturbed
    torchrun --nproc-per-node 2 examples/lightning/train_lightning.py --strategy fsdp2 --out runs/sharded
    fsdp-verify compare runs/ref runs/sharded --calibration runs/ref-perturbed

The model is fsdp-verify's built-in Transformer (2 layers of width 64), trained with Adam on 256
random sequences, next-token cross-entropy. Under a distributed strategy Lightning replaces the
training DataLoader's sampler with DistributedSampler(shuffle=True, seed=0) whatever the
DataLoader said; on one process it keeps the DataLoader's. So the single-process run uses that
same sampler with one replica: step i's batch there is the union of the ranks' batches.

--strategy (under torchrun):
  fsdp2  ModelParallelStrategy, fully_shard (FSDP2) applied in configure_model to each layer and
         the root: the FSDP2 path Lightning runs on CPU (FSDPStrategy, FSDP1, refuses a CPU
         accelerator: "The strategy `fsdp` requires a GPU accelerator")
  ddp    DDPStrategy: replicated on purpose, recorded so
Planted bugs:
  --bug no-fully-shard     ModelParallelStrategy, but configure_model never calls fully_shard: the
                           strategy does not wrap the model either, so each rank trains its own copy
  --bug unsharded-sampler  use_distributed_sampler=False: every rank reads the same batches
  --accumulate K           accumulate_grad_batches: another K than the reference's trains on
                           another batch per optimizer step
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from fsdp_verify.integrations.lightning import RecorderCallback
from fsdp_verify.models import ModelSpec, build_model

SPEC = ModelSpec(kind="transformer", vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=172, seq_len=32)


class LitTransformer(L.LightningModule):
    def __init__(self, lr: float, shard: bool):
        super().__init__()
        self.model = build_model(SPEC, seed=0)  # every value drawn from seed 0 on the CPU generator
        self.lr, self.shard = lr, shard

    def configure_model(self) -> None:
        """ModelParallelStrategy's hook: FSDP2 over the data-parallel mesh."""
        if not self.shard:
            return
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for layer in self.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

    def training_step(self, batch, batch_idx):
        inputs, targets = batch
        logits = self.model(inputs)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return {"loss": loss, "logits": logits.detach()}

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def dataset(samples: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, SPEC.vocab_size, (samples, SPEC.seq_len + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="the recorder's run directory")
    p.add_argument("--strategy", choices=["single", "fsdp2", "ddp"], default="single")
    p.add_argument("--ranks", type=int, default=1, help="processes (torchrun's --nproc-per-node)")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps")
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=1, help="accumulate_grad_batches")
    p.add_argument("--bug", choices=["no-fully-shard", "unsharded-sampler"])
    p.add_argument("--no-record", action="store_true", help="train without the recorder")
    args = p.parse_args()
    torch.set_num_threads(1)
    if args.strategy == "single":
        strategy, devices = "auto", 1
    else:
        from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

        devices = args.ranks
        if args.strategy == "fsdp2":
            strategy = ModelParallelStrategy(data_parallel_size=devices, tensor_parallel_size=1)
        else:
            strategy = DDPStrategy(process_group_backend="gloo")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=args.steps,
        accumulate_grad_batches=args.accumulate,
        use_distributed_sampler=args.bug != "unsharded-sampler",
        callbacks=[] if args.no_record else [RecorderCallback(out=args.out)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = dataset()
    # One process: the shuffle Lightning's distributed strategies put in (see the docstring).
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0) if devices == 1 else None
    loader = DataLoader(data, batch_size=args.global_batch // devices, sampler=sampler)
    shard = args.strategy == "fsdp2" and args.bug != "no-fully-shard"
    trainer.fit(LitTransformer(lr=1e-3, shard=shard), loader)


if __name__ == "__main__":
    main()
