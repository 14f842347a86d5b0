"""Gradient accumulation over micro-batches and FSDP2's gradient sync (`no_sync`): a micro-batch
that replaces the sum, a sync never turned back on for the last micro-batch or for one unit."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.units import modules_of
from fsdp_verify.zoo.pins import CHEAP, MICROBATCHES
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


@bug(
    "each micro-batch's gradient replaces the accumulated one instead of adding to it",
    "`grad = new` for `grad += new` / zero_grad inside the accumulation loop (seed 000's"
    " loss * dp_size / global_batch_size accumulation)",
    ("grads",),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "microbatches": MICROBATCHES, "sync_every_microbatch": True},
)
def microbatch_accumulation_overwrites(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Every micro-batch's forward drops the gradient accumulated so far (a `zero_grad` inside
    the accumulation loop; `grad = new` for `grad += new`): only the last micro-batch counts."""
    fully_shard_engine(model, mesh, spec)
    sharded = list(model.parameters())  # in forward, a unit's module holds unsharded params instead

    def drop_grads(_module, _args):
        for p in sharded:
            p.grad = None

    model.register_forward_pre_hook(drop_grads)
    return model


class _NoSyncView(EngineView):
    def set_requires_gradient_sync(self, sync: bool) -> None:
        self.module.set_requires_gradient_sync(False)


@bug(
    "accumulating without communication, gradient sync is never turned back on for the last"
    " micro-batch: nothing is reduced",
    "seed 000: local accumulation in bf16, reduce-scatter on the last micro-batch only"
    " (`no_sync` wrapping the final backward)",
    ("grads",),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "microbatches": MICROBATCHES, "sync_every_microbatch": False},
)
def grad_sync_off_on_last_microbatch(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accumulating without communication, it never turns gradient sync back on for the last
    micro-batch (a `no_sync` that also wraps the final backward): no gradient is ever reduced."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _NoSyncView(model)
    return model


@bug(
    "gradient sync left off for one shard unit (a `no_sync` that never ended)",
    "FSDP no_sync / set_requires_gradient_sync misuse",
    ("grads",),
    pins=dict(CHEAP),
)
def grad_sync_off_for_one_unit(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Leaves gradient sync off for the first wrapped module (a `no_sync` that never ended)."""
    fully_shard_engine(model, mesh, spec)
    modules_of(model, spec.wrap[0])[0].set_requires_gradient_sync(False, recurse=False)  # the unit's state
    return model
