"""Deliberately broken engines, written against the plug-in contract. Each is a small mutation
of the correct FSDP2 engine modelled on a real bug report; the toolkit's own tests (and the
self-test) require every one of them to be caught, by the right comparator, at the right place.
Use as `--engine verify.mutants:NAME`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from verify.engines.fsdp2 import fully_shard_engine
from verify.engines.spec import ShardSpec


def _units(model: nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def grads_divided_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages over ranks, then divides by the world size once more (a manual `/ world_size`
    on top of ReduceOp.AVG)."""
    fully_shard_engine(model, mesh, spec)
    world = mesh.size()
    for unit in _units(model):
        unit.set_all_reduce_hook(lambda t: t.div_(world))
    return model


def grad_sync_off_for_one_unit(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Leaves gradient sync off for the first wrapped module (a `no_sync` that never ended)."""
    fully_shard_engine(model, mesh, spec)
    model.get_submodule(spec.wrap[0]).set_requires_gradient_sync(False, recurse=False)
    return model


def rank1_different_init(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Rank 1 re-initialises before sharding and nothing syncs module states (no broadcast from
    rank 0), so its shards hold other values."""
    if dist.get_rank() == 1:
        generator = torch.Generator().manual_seed(12345)
        with torch.no_grad():
            for p in model.parameters():
                p.normal_(0.0, 0.02, generator=generator)
    return fully_shard_engine(model, mesh, spec)


def inputs_cast_to_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Casts floating inputs to bf16 (and back) although the policy is full precision."""

    def cast(_module, args):
        return tuple(a.to(torch.bfloat16).to(a.dtype) if torch.is_floating_point(a) else a for a in args)

    model.register_forward_pre_hook(cast)
    return fully_shard_engine(model, mesh, spec)
