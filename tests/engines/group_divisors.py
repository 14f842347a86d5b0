"""FSDP2 engines that divide the gradients by the wrong group of ranks, one a group (the data-
parallel ranks, the world, the experts' ep group), each a whole-step factor the step hints must
name by the group and its size from the case's mesh (tests/test_hints.py)."""

from __future__ import annotations

import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.expert_parallel import on_ep_mesh
from fsdp_verify.engines.fsdp2 import fully_shard_engine


def _units(model) -> list[FSDPModule]:
    """Every FSDP2 unit this rank holds: a pipeline's are in its stage modules."""
    pipeline = getattr(model, "pipeline", None)
    roots = [model] + (list(pipeline.modules) if pipeline is not None else [])
    found = {id(m): m for root in roots for m in root.modules() if isinstance(m, FSDPModule)}
    return list(found.values())


def divides_by_the_world(model, mesh, spec):
    """Sets every unit's divide factor to the whole world (`dist.get_world_size()`) where the
    data-parallel size is meant: under tp or pp the other dimension's ranks counted as replicas."""
    fully_shard_engine(model, mesh, spec)
    world = float(dist.get_world_size())
    sum_needed = dist.get_backend() == "gloo" and spec.case.dp_size > 1  # gloo has no PREMUL_SUM
    for unit in _units(model):
        unit.set_gradient_divide_factor(world)
        if sum_needed:
            unit.set_force_sum_reduction_for_comms(True)
    return model


def divides_by_dp_twice(model, mesh, spec):
    """Divides each reduced gradient by the data-parallel size once more (a manual `/ dp` on top of
    FSDP2's average)."""
    fully_shard_engine(model, mesh, spec)
    dp = spec.case.dp_size
    for unit in _units(model):
        unit.set_all_reduce_hook(lambda t: t.div_(dp))
    return model


def divides_by_the_world_twice(model, mesh, spec):
    """Divides each reduced gradient by the whole world once more (a manual `/ world_size` on top
    of FSDP2's average over the data-parallel ranks)."""
    fully_shard_engine(model, mesh, spec)
    world = dist.get_world_size()
    for unit in _units(model):
        unit.set_all_reduce_hook(lambda t: t.div_(world))
    return model


def experts_divided_by_ep(model, mesh, spec):
    """The experts' units divide their reduced gradients by the ep degree once more (as if each
    expert's gradient were averaged over the ep ranks that hold other experts); the dense ones
    are right."""
    fully_shard_engine(model, mesh, spec)
    ep = spec.case.ep
    for unit in _units(model):
        if any(on_ep_mesh(p) for p in unit.parameters(recurse=False)):
            unit.set_all_reduce_hook(lambda t: t.div_(ep))
    return model


for _engine in (divides_by_the_world, divides_by_dp_twice, divides_by_the_world_twice, experts_divided_by_ep):
    _engine.capabilities = fully_shard_engine.capabilities  # drawn and taken what fsdp2 is
