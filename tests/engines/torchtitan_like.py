"""Engines that shard the built-in Transformer as torchtitan's `apply_fsdp_to_decoder` does,
without torchtitan: the token embeddings and each block resharded after forward, one unit over
`[norm, output]` not resharded, the root with FSDP2's default (no reshard after forward either);
and one that ignores the spec's `reshard_after_forward` without declaring that it sets it per
unit."""

from torch.distributed.fsdp import fully_shard

from fsdp_verify.engines.capabilities import Capabilities


def shard(model, mesh, spec):
    kwargs = {"mesh": mesh, "mp_policy": spec.mp_policy}
    fully_shard(model.tok_embeddings, reshard_after_forward=True, **kwargs)
    for block in model.layers:
        fully_shard(block, reshard_after_forward=True, **kwargs)
    fully_shard([model.norm, model.output], reshard_after_forward=False, **kwargs)
    fully_shard(model, **kwargs)  # FSDP2's default: the root keeps its parameters after forward
    return model


shard.capabilities = Capabilities(takes=("groups",), reshard_per_unit=True)


def always_reshards(model, mesh, spec):
    for fqn in spec.wrap:
        fully_shard(model.get_submodule(fqn), mesh=mesh, mp_policy=spec.mp_policy, reshard_after_forward=True)
    return model
