"""The built-in engine: PyTorch FSDP2, `torch.distributed.fsdp.fully_shard`, per the wrap plan."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, OffloadPolicy, fully_shard

from fsdp_verify.engines.placement import placement_fn
from fsdp_verify.engines.prefetch import set_prefetching
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.models import is_ignored


def fully_shard_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    case = spec.case
    offload = CPUOffloadPolicy(pin_memory=False) if case is not None and case.offload else OffloadPolicy()
    rule = case.shard_placement if case is not None else "dim0"
    placements = placement_fn(rule, model, mesh.size(mesh.ndim - 1))  # before any unit replaces its params
    names = case.ignored if case is not None else ()
    ignored = {p for n, p in model.named_parameters() if is_ignored(names, n)} or None
    for fqn in spec.wrap:
        fully_shard(
            model.get_submodule(fqn),
            mesh=mesh,
            mp_policy=spec.mp_policy,
            reshard_after_forward=spec.reshard_after_forward,
            offload_policy=offload,
            shard_placement_fn=placements,
            ignored_params=ignored,
        )
    if case is not None and case.grad_reduction == "sum":
        sum_reduction(model)
    if case is not None and case.prefetch is not None:
        set_prefetching(model, spec.wrap, case.prefetch)
    if spec.case is not None and spec.case.model.experts:
        # Routed experts: a rank whose micro-batch reaches none of an expert's samples has no
        # gradient for it, and FSDP2 would reduce-scatter fewer parameters there than on the
        # others; zeros keep every rank's reduce-scatter the same (as a MoE trainer sets it).
        model.set_reduce_scatter_unused_params(True)
    return model


def sum_reduction(model: nn.Module) -> None:
    """`grad_reduction: sum`: `set_gradient_divide_factor(1.0)` on every unit, so FSDP2 sums the
    gradients over the shard group and the replicas (the loop divides each rank's loss by the
    world size instead). With a factor of 1 torch 2.13 issues PREMUL_SUM(1.0) on fp32 and bf16
    (`_get_gradient_divide_factors`), which gloo lacks; `set_force_sum_reduction_for_comms`
    makes it SUM in both collectives and no division (`_div_if_needed` skips 1), as fp16 already
    is: the same sum. NCCL takes PREMUL_SUM, so only gloo gets the second call."""
    gloo = dist.get_backend() == "gloo"
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_gradient_divide_factor(1.0)
            if gloo:
                unit.set_force_sum_reduction_for_comms(True)
