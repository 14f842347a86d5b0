"""The built-in engine: PyTorch FSDP2, `torch.distributed.fsdp.fully_shard`, per the wrap plan,
with every knob of the case (verify/engines/spec.py): what a plug-in that passes the spec's
arguments through does, and declares, too. With tensor parallelism the case's plan comes first,
then `fully_shard` over the data-parallel dims (torchtitan's order; docs/tensor-parallel.md)."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

from fsdp_verify.engines.capabilities import FSDP2
from fsdp_verify.engines.spec import ShardSpec


def fully_shard_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    spec.convert(model, mesh)  # the dimension packages' conversions (float8), before any parallelism
    pipelined = spec.pipeline(model, mesh, fully_shard_engine)  # each stage sharded as below
    if pipelined is not None:
        return pipelined
    mesh = spec.parallelize(model, mesh)  # torchtitan's order: tp, checkpointing (the loop's), compile, fully_shard
    spec.compile(model)
    kwargs = spec.fully_shard_kwargs(model, spec.expert_parallel(model, mesh))
    for fqn in spec.wrap:
        unit = spec.unit_modules(model, fqn)  # a list for one unit over several modules
        fully_shard(unit, **spec.unit_kwargs(unit, kwargs))
    spec.after_sharding(model)
    return model


fully_shard_engine.capabilities = FSDP2
