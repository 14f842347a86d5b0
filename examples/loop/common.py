"""What the two example scripts share, as a user's single-GPU script and its sharded twin would
(a model module and a dataset module both import): the model, the data and the loss."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from fsdp_verify.models import ModelSpec, build_model

SPEC = ModelSpec(kind="transformer", vocab_size=256, dim=64, n_layers=2, n_heads=4, ffn_hidden=172, seq_len=32)


def make_model() -> torch.nn.Module:
    return build_model(SPEC, seed=0)  # every value drawn from seed 0 on the CPU generator


def make_dataset(samples: int = 256) -> TensorDataset:
    g = torch.Generator().manual_seed(1234)
    tokens = torch.randint(0, SPEC.vocab_size, (samples, SPEC.seq_len + 1), generator=g)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def add_common_arguments(p) -> None:
    p.add_argument("--out", required=True, help="the recorder's run directory")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--full-steps", type=int, nargs="*", default=[], help="steps whose tensors are stored whole")
    p.add_argument("--no-record", action="store_true", help="train without the recorder")
    p.add_argument(
        "--bf16",
        action="store_true",
        help="FSDP2 mixed precision (bf16 parameters in forward and backward, gradients reduced in fp32)",
    )


def shard(model: torch.nn.Module, mesh, bf16: bool) -> None:
    """fully_shard per block, then the root; with --bf16 under BF16_POLICY. The single-process
    script calls it too (on a one-rank mesh) when --bf16: then it rounds where the sharded run does."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    kwargs = {"mesh": mesh, **({"mp_policy": policy} if policy else {})}
    for block in model.layers:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
