"""Parameter names as the user wrote them: the FQN segments that wrappers insert are dropped, so
the single-GPU script's `layers.0.attn.wq.weight` and its sharded twin's
`_orig_mod.layers.0._checkpoint_wrapped_module.attn.wq.weight` pair up in `compare`."""

from __future__ import annotations

from fsdp_verify.module_names import WRAPPER_SEGMENTS, original

# Only ever a prefix (DDP and DataParallel's `.module`): a user's own submodule may be called
# `module` deeper in the tree, and that name is kept.
WRAPPER_PREFIXES = ("module",)


def strip_wrappers(fqn: str) -> str:
    parts = fqn.split(".")
    while len(parts) > 1 and parts[0] in WRAPPER_PREFIXES + WRAPPER_SEGMENTS:
        parts = parts[1:]
    return original(".".join(parts))
