"""Activation checkpointing on the units of a wrap plan, as torchtitan applies it before sharding:
each unit's forward runs under `torch.utils.checkpoint` (non-reentrant) and is recomputed in
backward. With `preserve_rng_state=True` the recomputation replays the forward's dropout masks
(the generator's state is stashed and restored around it), so gradients are those of the forward
that ran; with False it draws new masks from wherever the generator stands: a silent bug (the zoo's
`checkpoint_without_rng_state`). The root is left alone: checkpointing it recomputes everything.

The forward is replaced on the instance, so parameter names and FQNs stay as they were (no
`_checkpoint_wrapped_module.` prefix) and an engine's hooks on the module still run around it."""

from __future__ import annotations

import functools

import torch
from torch import nn


def checkpoint_units(model: nn.Module, plan: tuple[str, ...], preserve_rng_state: bool = True) -> None:
    for fqn in plan:
        if fqn:
            module = model.get_submodule(fqn)
            module.forward = functools.partial(_checkpointed, module.forward, preserve_rng_state)


def _checkpointed(forward, preserve_rng_state: bool, *args, **kwargs):
    return torch.utils.checkpoint.checkpoint(
        forward, *args, use_reentrant=False, preserve_rng_state=preserve_rng_state, **kwargs
    )
