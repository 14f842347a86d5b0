"""Plug-in engines written as docs/engines.md describes: `fsdp-verify check --engine
examples/engine/my_engine.py:shard`.

`shard` applies the stable contract (the wrap plan, the mixed-precision policy,
`reshard_after_forward`, the mesh) and declares nothing: it is drawn only what that contract
carries and what the toolkit's loop does to any FSDP2 module. `shard_everything` passes the
case's FSDP2 arguments through (`ShardSpec.fully_shard_kwargs`, `ShardSpec.after_sharding`) and
declares every engine-side knob, so every one is drawn for it."""

from torch.distributed.fsdp import fully_shard

from fsdp_verify.engines.capabilities import ENGINE_KNOBS, Capabilities


def shard(model, mesh, spec):
    for fqn in spec.wrap:
        fully_shard(
            model.get_submodule(fqn),
            mesh=mesh,
            mp_policy=spec.mp_policy,
            reshard_after_forward=spec.reshard_after_forward,
        )
    return model


def shard_everything(model, mesh, spec):
    spec.compile(model)
    kwargs = spec.fully_shard_kwargs(model, mesh)
    for fqn in spec.wrap:
        fully_shard(spec.unit_modules(model, fqn), **kwargs)  # a group's modules as one unit
    spec.after_sharding(model)
    return model


shard_everything.capabilities = Capabilities(takes=ENGINE_KNOBS)
