"""A user's plain plug-in engine (as docs/engines.md describes it, declaring nothing) with one
bug planted: the fuzz, the sweep and the pytest plugin must still catch it."""

from torch.distributed.fsdp import FSDPModule, fully_shard


def plain_with_a_bug(model, mesh, spec):
    """One `fully_shard` per unit of the plan, then an all-reduce hook that divides every reduced
    gradient by the world size once more (a manual `/ world_size` on top of FSDP2's average)."""
    for fqn in spec.wrap:
        fully_shard(
            model.get_submodule(fqn),
            mesh=mesh,
            mp_policy=spec.mp_policy,
            reshard_after_forward=spec.reshard_after_forward,
        )
    world = mesh.size()
    for unit in model.modules():
        if isinstance(unit, FSDPModule):
            unit.set_all_reduce_hook(lambda t: t.div_(world))
    return model
