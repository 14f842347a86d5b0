"""A correct engine whose arithmetic the reference does not emulate: FSDP2 dividing every rank's
gradient by the world size before the reduce-scatter sums them (what NCCL's PreMulSum does),
instead of dividing the sum. Equal in exact arithmetic, a rounding apart in floating point: for
tests that need a passing case whose records move.

Not `set_gradient_divide_factor(W)`: torch 2.13's FSDP2 takes a factor equal to the shard
group's size as ReduceOp.AVG, the default path, so that engine was bit-exact on nearly every case
(`_get_gradient_divide_factors`); the division is made here, in a custom reduce-scatter."""

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec


class _DivideThenSum(DefaultReduceScatter):
    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        input_tensor.div_(group.size())
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=dist.ReduceOp.SUM, group=group)


def divide_before_summing(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    fully_shard_engine(model, mesh, spec)
    if spec.case is not None and spec.case.grad_reduction == "sum":
        return model  # a SUM reduction divides nothing (the loop divides each rank's loss)
    for module in model.modules():
        if isinstance(module, FSDPModule) and module._get_fsdp_state()._fsdp_param_groups:
            module.set_custom_reduce_scatter(_DivideThenSum())
    return model
