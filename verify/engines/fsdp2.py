"""The built-in engine: PyTorch FSDP2, `torch.distributed.fsdp.fully_shard`, per the wrap plan."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

from fsdp_verify.engines.placement import placement_fn
from fsdp_verify.engines.prefetch import set_prefetching
from fsdp_verify.engines.spec import ShardSpec


def fully_shard_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    case = spec.case
    offload = CPUOffloadPolicy(pin_memory=False) if case is not None and case.offload else OffloadPolicy()
    rule = case.shard_placement if case is not None else "dim0"
    placements = placement_fn(rule, model, mesh.size(mesh.ndim - 1))  # before any unit replaces its params
    for fqn in spec.wrap:
        fully_shard(
            model.get_submodule(fqn),
            mesh=mesh,
            mp_policy=spec.mp_policy,
            reshard_after_forward=spec.reshard_after_forward,
            offload_policy=offload,
            shard_placement_fn=placements,
        )
    if case is not None and case.prefetch is not None:
        set_prefetching(model, spec.wrap, case.prefetch)
    if spec.case is not None and spec.case.model.experts:
        # Routed experts: a rank whose micro-batch reaches none of an expert's samples has no
        # gradient for it, and FSDP2 would reduce-scatter fewer parameters there than on the
        # others; zeros keep every rank's reduce-scatter the same (as a MoE trainer sets it).
        model.set_reduce_scatter_unused_params(True)
    return model
