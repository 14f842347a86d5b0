"""FSDP2 engines whose numbers are right and whose traffic is not, for the communication contract's
rules on degenerate meshes and on units no backward runs through (verify/checks/comm.py)."""

from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.fsdp2 import fully_shard_engine


def gathers_every_unit_in_backward(model, mesh, spec):
    """The root prefetches every unit at the start of backward, frozen units that no backward runs
    through included (a hand-written prefetch list that ignores requires_grad): their all-gathers
    are wasted bytes, the gradients are FSDP2's."""
    fully_shard_engine(model, mesh, spec)
    units = [m for m in model.modules() if isinstance(m, FSDPModule) and m is not model]
    model.set_modules_to_backward_prefetch(units)
    return model


def shards_over_the_replicas(model, mesh, spec):
    """A 2-D mesh flattened to one dimension (`mesh._flatten()`): the parameters sharded over every
    rank instead of replicated over the first dimension; the same average over the same ranks,
    all-gathers where FSDP2's HSDP all-reduces."""
    return fully_shard_engine(model, mesh._flatten() if mesh.ndim == 2 else mesh, spec)


def gathers_the_sequence_per_linear(model, mesh, spec):
    """Sequence parallelism whose feed-forward gathers the sequence once per colwise linear (w1 and
    w3 each `ColwiseParallel(input_layouts=Shard(1))`, the block's PrepareModuleInput dropped):
    the same activations, gathered twice forward and reduce-scattered twice backward."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    from fsdp_verify.engines.tensor_parallel import plan_for
    from fsdp_verify.zoo.mutants.tensor_parallel import _parallel_then_shard

    plan = plan_for(spec.case, model, mesh["tp"])
    for fqn in [k for k, v in plan.items() if isinstance(v, PrepareModuleInput) and k.endswith("feed_forward")]:
        del plan[fqn]
        for w in ("w1", "w3"):
            plan[f"{fqn}.{w}"] = ColwiseParallel(input_layouts=Shard(1))
    return _parallel_then_shard(model, mesh, spec, plan)


gathers_the_sequence_per_linear.capabilities = fully_shard_engine.capabilities
