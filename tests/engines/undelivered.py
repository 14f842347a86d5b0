"""Engines that declare every engine-side knob (verify/engines/capabilities.py) and drop one:
the knobs check must name the knob ("did not apply"), not report what its absence breaks later
(a gloo abort, a DTensor sharding-strategy error, gradients 1/W)."""

from __future__ import annotations

from dataclasses import replace

from torch.distributed.fsdp import OffloadPolicy, fully_shard

from fsdp_verify.engines.capabilities import FSDP2
from fsdp_verify.units import modules_of

# What each knob's dropping leaves of fully_shard's arguments, or of the case after_sharding reads.
_ARGUMENT_OFF = {"offload": ("offload_policy", OffloadPolicy()), "shard_placement": ("shard_placement_fn", None)}
_ARGUMENT_OFF["ignored"] = ("ignored_params", None)
_CASE_OFF = {"grad_reduction": {"grad_reduction": "avg"}, "prefetch": {"prefetch": None}}


def _dropping(knob: str):
    def engine(model, mesh, spec):
        kwargs = spec.fully_shard_kwargs(model, mesh)
        if knob in _ARGUMENT_OFF:
            name, value = _ARGUMENT_OFF[knob]
            kwargs[name] = value
        for fqn in spec.wrap:
            fully_shard(spec.unit_modules(model, fqn), **kwargs)
        after = replace(spec, case=spec.case.with_(**_CASE_OFF[knob])) if knob in _CASE_OFF else spec
        after.after_sharding(model)
        if knob == "experts":
            model.set_reduce_scatter_unused_params(False)
        return model

    engine.capabilities = FSDP2
    engine.__name__ = f"drops_{knob}"
    return engine


drops_offload = _dropping("offload")
drops_shard_placement = _dropping("shard_placement")
drops_ignored = _dropping("ignored")
drops_grad_reduction = _dropping("grad_reduction")
drops_prefetch = _dropping("prefetch")
drops_experts = _dropping("experts")
drops_compile = _dropping("compile")  # never calls spec.compile(model)


def drops_groups(model, mesh, spec):
    """Declares `groups` and shards each module of a unit over several modules on its own."""
    kwargs = spec.fully_shard_kwargs(model, mesh)
    for fqn in spec.wrap:
        for module in modules_of(model, fqn):
            fully_shard(module, **kwargs)
    spec.after_sharding(model)
    return model


drops_groups.capabilities = FSDP2


def drops_ep(model, mesh, spec):
    """Declares ep, shards the grouped experts over every rank like the dense parameters: each
    rank computes every expert (right numbers, no expert parallelism)."""
    from fsdp_verify.engines.expert_parallel import dense_mesh

    kwargs = spec.fully_shard_kwargs(model, dense_mesh(mesh))
    for fqn in spec.wrap:
        fully_shard(spec.unit_modules(model, fqn), **kwargs)
    spec.after_sharding(model)
    return model


def drops_ep_divide_factor(model, mesh, spec):
    """Declares ep and applies it, but leaves the experts' unit dividing by its own mesh."""
    kwargs = spec.fully_shard_kwargs(model, spec.expert_parallel(model, mesh))
    for fqn in spec.wrap:
        unit = spec.unit_modules(model, fqn)
        fully_shard(unit, **spec.unit_kwargs(unit, kwargs))
    replace(spec, case=spec.case.with_(ep=1)).after_sharding(model)
    return model


drops_ep.capabilities = drops_ep_divide_factor.capabilities = FSDP2


def drops_prefetch_off_rank_0(model, mesh, spec):
    """Applies every knob, then, on every rank but 0, empties the explicit prefetch lists (a
    recipe that sets them where `rank == 0` logs): only another rank than the reporting one finds
    the knob not applied, and rank 0 must still name it."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from fsdp_verify.engines.fsdp2 import fully_shard_engine

    fully_shard_engine(model, mesh, spec)
    if dist.get_rank() != 0:
        for unit in model.modules():
            if isinstance(unit, FSDPModule):
                unit.set_modules_to_forward_prefetch([])
                unit.set_modules_to_backward_prefetch([])
    return model


drops_prefetch_off_rank_0.capabilities = FSDP2
