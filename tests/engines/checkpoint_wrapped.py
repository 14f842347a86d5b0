"""Engines that checkpoint with PyTorch's own `apply_activation_checkpointing` before sharding, as
most FSDP2 training scripts (and torchtitan, through `checkpoint_wrapper`) do: each unit but the
root becomes a `CheckpointWrapper`, its parameters named `..._checkpoint_wrapped_module....`.
The case asks for no checkpointing: the engine does it on its own, and a correct engine must still
pass (the names are read through, verify/module_names.py). And one that recomputes with new
dropout masks (`preserve_rng_state=False`), which must not."""

import functools
from pathlib import Path

from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)

from fsdp_verify.imports import load_object

PLAIN = Path(__file__).resolve().parents[2] / "examples" / "engine" / "my_engine.py"


def _shard(model, mesh, spec, preserve_rng_state: bool):
    units = {id(model.get_submodule(fqn)) for fqn in spec.wrap if fqn}
    wrapper = functools.partial(checkpoint_wrapper, preserve_rng_state=preserve_rng_state)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper, check_fn=lambda m: id(m) in units)
    # then the plain plug-in, unchanged: the wrappers answer to their units' names (`layers.0`)
    return load_object(f"{PLAIN}:shard", "engine")(model, mesh, spec)


def shard(model, mesh, spec):
    return _shard(model, mesh, spec, preserve_rng_state=True)


def without_rng_state(model, mesh, spec):
    return _shard(model, mesh, spec, preserve_rng_state=False)
