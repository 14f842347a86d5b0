"""The names of a user's model as its modules spell them, read through the wrappers an engine may
put around them: `checkpoint_wrapper` (PyTorch's `apply_activation_checkpointing`, torchtitan's
activation checkpointing, both applied before `fully_shard`), `torch.compile`'s OptimizedModule
and FSDP1's unit wrapper each insert a segment (`layers.0._checkpoint_wrapped_module.attention
.wq.weight`), while the reference's model, which no engine touched, has none. Every record that
names a parameter, buffer or module of the engine's model is keyed by the stripped name, so the
two sides pair up and a wrapper is not a divergence.

Each wrapper forwards attribute lookups to the module it wraps (`CheckpointWrapper.__getattr__`,
OptimizedModule's, FSDP1's), so `get_submodule("layers.0.attention")` already reaches through
them; only enumerating needs this."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

# Inserted anywhere in the path (FSDP1's unit wrapper, torch.compile, activation checkpointing).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")


def original(fqn: str) -> str:
    """`fqn` without the segments wrappers insert."""
    if not any(s in fqn for s in WRAPPER_SEGMENTS):
        return fqn
    return ".".join(p for p in fqn.split(".") if p not in WRAPPER_SEGMENTS)


def named_parameters(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
    for name, p in module.named_parameters(remove_duplicate=remove_duplicate):
        yield original(name), p


def named_buffers(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, b in module.named_buffers():
        yield original(name), b


def named_modules(module: nn.Module, remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Module]]:
    """Each module once under its original name: a wrapper and the module it wraps share one
    (`layers.0`), and the wrapper, met first, keeps it: it is the module `fully_shard` was called
    on and whose hooks run around the whole forward (the wrapped module's run again inside a
    recomputation)."""
    seen: set[str] = set()
    for name, m in module.named_modules(remove_duplicate=remove_duplicate):
        name = original(name)
        if remove_duplicate and name in seen:
            continue
        seen.add(name)
        yield name, m
