"""A correct engine whose arithmetic the reference does not emulate: FSDP2 dividing every rank's
gradient by the world size before the reduce-scatter sums them (`set_gradient_divide_factor`,
as NCCL's PreMulSum does), instead of dividing the sum. Equal in exact arithmetic, a rounding
apart in floating point: for tests that need a passing case whose records move."""

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec


def divide_before_summing(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    fully_shard_engine(model, mesh, spec)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(mesh.size()))
    return model
