"""FSDP2 with `ShardedGradScaler` instead of the default `torch.amp.GradScaler`: both must be
correct on FSDP2's DTensor gradients (tests/test_loss_scaling.py)."""

from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.view import EngineView


class _ShardedScalerView(EngineView):
    def grad_scaler(self, spec, device):
        return ShardedGradScaler(device.type, **spec.scaler_kwargs())


def fsdp2_sharded_grad_scaler(model, mesh, spec):
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _ShardedScalerView(model)
    return model
