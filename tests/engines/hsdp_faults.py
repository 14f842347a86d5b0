"""FSDP2 engines that get HSDP's reduction wrong on a (replicate, shard) mesh (loaded by file path)."""

from torch.distributed.fsdp import FSDPModule

from fsdp_verify.engines.fsdp2 import fully_shard_engine


def replicas_not_reduced(model, mesh, spec):
    """FSDP2 over the shard dimension alone (the intra-node submesh passed for the whole mesh):
    each replica reduce-scatters and averages its own ranks' gradients and never all-reduces with
    the others, so the replicas step apart."""
    return fully_shard_engine(model, mesh[mesh.mesh_dim_names[-1]] if mesh.ndim == 2 else mesh, spec)


def divides_by_shard_group(model, mesh, spec):
    """HSDP whose gradient divide factor is the shard group's size, not the data-parallel world's
    (`set_gradient_divide_factor(S)`: the reduce-scatter averages, the all-reduce over the replicas
    sums): gradients R times the average."""
    model = fully_shard_engine(model, mesh, spec)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(float(mesh.size(mesh.ndim - 1)))
    return model
