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
