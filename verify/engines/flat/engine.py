"""`--engine flat`: the bundled FlatParameter engine applied per the Case's wrap plan, and the view
the toolkit reads it through. A worked example of a plug-in engine without DTensors."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.arithmetic import Arithmetic
from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.contracts import Contracts
from fsdp_verify.engines.flat.api import Collect, fully_shard, shard_all, units, unmanaged_params
from fsdp_verify.engines.flat.meta_init import construct_on_meta, materialize
from fsdp_verify.engines.flat.view import FlatView, Holding
from fsdp_verify.engines.spec import ShardSpec


def flat_engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, collect: Collect = unmanaged_params) -> nn.Module:
    """With `init: meta` the engine builds its own model on the meta device and materialises
    it, as a trainer too big for one device would (the built model only gives the device and
    which weights are frozen)."""
    if spec.case is not None and spec.case.init == "meta":
        from fsdp_verify.models import _construct

        device = next(model.parameters()).device
        frozen = {name for name, p in model.named_parameters() if not p.requires_grad}
        model = construct_on_meta(lambda: _construct(spec.case.model))
        for name, p in model.named_parameters():
            p.requires_grad_(name not in frozen)
        wrap_per_plan(model, mesh, spec, collect)
        return with_view(materialize(model, _init_from_seed(spec.case.seed), device))
    wrap_per_plan(model, mesh, spec, collect)
    return with_view(shard_all(model))


# Units in creation order (the plan's), every trainable parameter's (maybe empty) shard view has
# a gradient, and, like FSDP2, an identity node on unit inputs (verify/engines/flat/unit.py).
# It sums the gradients in reduce_dtype and divides the sum by the world size (no pre-divide).
flat_engine.arithmetic = Arithmetic(
    layout="flat", unit_order="plan", empty_pieces_in_norm=True, predivide="never", computes_on_flat_views=True
)
flat_engine.contracts = Contracts(
    comm=False, memory=False, why="the flat engine gathers one padded FlatParameter per unit: not FSDP2's model"
)
# It shards over one process group (verify/engines/flat/api.py): a 1-D mesh only; an int
# reshard_after_forward counts as True.
# Routed experts are taken: their gate's near-cancelling gradient once came out a few ulp from the
# reference (Adam's second moment of `moe.gate.bias` 0.4x to 1.6x its tolerance, at world size 1
# too), not from any reduction but from the compute parameters' addresses. A unit computes with
# views of its one buffer, and a one-row Linear (an expert, or any layer on one sample) whose weight
# starts off a 16-byte boundary adds its products in another order (`computes_on_flat_views` above:
# the reference computes with views laid out alike, and the cases are bit-exact).
# It fixes what trains when it shards (a FlatParameter's requires_grad): no unfreezing, and none
# of the loop's FSDP2 setters.
flat_engine.capabilities = Capabilities(
    mesh_dims=(1,), takes=("experts",), module_takes=(), reshard_int_divides_shard=False
)


def wrap_per_plan(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, collect: Collect = unmanaged_params) -> None:
    """`fully_shard` every module of the wrap plan, in its order (children first, root last)."""
    for fqn in spec.wrap:
        fully_shard(
            model.get_submodule(fqn),
            mesh=mesh,
            mp_policy=spec.mp_policy,
            reshard_after_forward=spec.reshard_after_forward,
            name=fqn,
            collect=collect,
        )


def _init_from_seed(seed: int):
    """The models' own init, from an explicit CPU generator, as `fsdp_verify.models.build_model`."""
    import torch

    def init(model: nn.Module) -> None:
        model.init_weights(torch.Generator().manual_seed(seed))

    return init


def with_view(model: nn.Module) -> nn.Module:
    """Give the sharded model the `verify_view()` the toolkit's loop looks for."""
    model.verify_view = lambda: FlatEngineView(model)
    return model


class FlatEngineView(FlatView):
    def __init__(self, model: nn.Module):
        self.units = [u for u in units(model) if u.flat is not None]
        super().__init__(model, self.units[0].group if self.units else None)

    def holdings(self) -> list[Holding]:
        return [
            Holding(slot.fqn, unit.name, slot.shape, view)
            for unit in self.units
            for slot, view in zip(unit.slots, unit.flat.shard_views)
        ]

    def set_requires_gradient_sync(self, sync: bool) -> None:
        for unit in self.units:
            unit.sync_gradients = sync
