"""Parameter names as the user wrote them: the FQN segments that wrappers insert are dropped, so
the single-GPU script's `layers.0.attn.wq.weight` and its sharded twin's
`_orig_mod.layers.0._checkpoint_wrapped_module.attn.wq.weight` pair up in `compare`."""

from __future__ import annotations

# Inserted anywhere in the path (FSDP1's unit wrapper, torch.compile, activation checkpointing).
WRAPPER_SEGMENTS = ("_fsdp_wrapped_module", "_orig_mod", "_checkpoint_wrapped_module")
# Only ever a prefix (DDP and DataParallel's `.module`): a user's own submodule may be called
# `module` deeper in the tree, and that name is kept.
WRAPPER_PREFIXES = ("module",)


def strip_wrappers(fqn: str) -> str:
    parts = fqn.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES + WRAPPER_SEGMENTS:
        parts = parts[1:]
    return ".".join(p for p in parts if p not in WRAPPER_SEGMENTS)
