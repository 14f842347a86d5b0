"""The step's gradient across ranks, around the correct FSDP2 engine: its reduction over the
ranks and divide factor, the loss's normalisation by real tokens, the norm a clip measures, one
rank's gradient off. Each is a sum or a division over ranks the step needs, done wrong."""

from __future__ import annotations

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.zoo.mutants._shared import _units
from fsdp_verify.zoo.pins import CHEAP, MICROBATCHES
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

# Lengths drawn in [1, seq_len] differ between micro-batches and ranks only if seq_len > 1; the
# normalisation bugs cannot show otherwise (equal token counts make them correct).
_PADDED = {"data.padded": True, "model.seq_len": st.integers(4, 8), "model.dropout": 0.0}


@bug(
    "gradients averaged over ranks, then divided by the world size once more",
    "a manual `/ world_size` on top of ReduceOp.AVG (DDP/FSDP migration reports)",
    ("grads",),
    pins=dict(CHEAP),
)
def grads_divided_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages over ranks, then divides by the world size once more (a manual `/ world_size`
    on top of ReduceOp.AVG)."""
    fully_shard_engine(model, mesh, spec)
    world = mesh.size()
    for unit in _units(model):
        unit.set_all_reduce_hook(lambda t: t.div_(world))
    return model


@bug(
    "gradients summed over ranks, never divided by the world size",
    "gradient divide factor 1 / SUM reduce op (FSDP2 set_gradient_divide_factor misuse)",
    ("grads",),
    pins=dict(CHEAP),
)
def grads_not_averaged(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Sums gradients over ranks instead of averaging them (a gradient divide factor of 1, as
    when a custom reduce op or loss scaling forgets the `/ world_size`). SUM reduction is forced
    because gloo has no PREMUL_SUM."""
    fully_shard_engine(model, mesh, spec)
    for unit in _units(model):
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    return model


class _LocalNormView(EngineView):
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        local = [p.grad.to_local() for p in self.parameters().values() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(local, max_norm)


@bug(
    "gradients clipped by each rank's local norm, not the global one",
    "seed 001: local norms 2.236, 5, 7.81, 10.63; the global norm is 14.283, not 10.63",
    ("grad_norm",),
    pins={**CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
)
def clip_with_local_norm(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips each rank's shards by that rank's own norm (`clip_grad_norm_` on the local tensors),
    not the global one (seed 001: local norms 2.236, 5, 7.81, 10.63; the global one is 14.283)."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _LocalNormView(model)
    return model


@bug(
    "each micro-batch's loss is its own token mean, averaged over micro-batches: with padded"
    " sequences of different lengths, tokens of short micro-batches weigh more",
    "seed 000: scale the loss by dp_size / global_batch_tokens for accumulation, not per micro-batch",
    ("loss", "grads"),
    world_sizes=(1, 2, 3, 4),
    model_kinds=("transformer",),
    pins={**CHEAP, **_PADDED, "microbatches": MICROBATCHES},
)
def loss_normalised_per_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each micro-batch's loss is the mean over its own real tokens, divided by the number of
    micro-batches (then ReduceOp.AVG): a mean of means, right only when every micro-batch holds
    as many real tokens (seed 000 asks for loss_sum * dp_size / global_batch_tokens)."""
    fully_shard_engine(model, mesh, spec)
    microbatches = spec.case.microbatches if spec.case is not None else 1
    model.loss_scale = lambda mb_items, rank_items, global_items, dp: 1.0 / (max(mb_items, 1) * microbatches)
    return model


@bug(
    "each rank's loss is the mean over its own tokens, then averaged over ranks: with padded"
    " sequences, ranks holding fewer real tokens weigh each token more",
    "seed 000: loss_sum * dp_size / global_batch_tokens, each rank summing its own tokens",
    ("loss", "grads"),
    model_kinds=("transformer",),
    pins={**CHEAP, **_PADDED},
)
def loss_normalised_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each rank divides its loss sum by its own real tokens (a per-rank mean, then ReduceOp.AVG):
    ranks with fewer tokens weigh each token more."""
    fully_shard_engine(model, mesh, spec)
    model.loss_scale = lambda mb_items, rank_items, global_items, dp: 1.0 / max(rank_items, 1)
    return model


class _ScaleGradOnce(torch.autograd.Function):
    """Identity forward; backward multiplies the incoming gradient by `factor`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.factor, None


def rank1_grad_off_by_2e6_once(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The smallest bug the toolkit promises to see in fp32: on rank 1 only, in the first
    backward only, every local gradient is 1 + 2e-6 times what it should be (logits and loss
    untouched), as a rank whose backward kernel rounded differently once would produce."""
    fully_shard_engine(model, mesh, spec)
    if dist.get_rank() != 1:
        return model
    calls = {"n": 0}

    def scale(_module, _args, out):
        calls["n"] += 1
        return _ScaleGradOnce.apply(out, 1 + 2e-6) if calls["n"] == 1 else out

    model.register_forward_hook(scale)
    return model
