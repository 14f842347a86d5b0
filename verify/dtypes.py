"""One spelling for each dtype, everywhere: every command, the pytest options, Case files and
reports accept `fp32`/`float32`, `bf16`/`bfloat16` and `fp16`/`float16` (and `torch.` prefixed
names), and print the short name. Case files store the short name too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NAMES = ("fp32", "bf16", "fp16")
_ALIASES = {
    "fp32": "fp32",
    "float32": "fp32",
    "float": "fp32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "float16": "fp16",
    "half": "fp16",
}
ACCEPTED = "fp32/float32, bf16/bfloat16 or fp16/float16"
# The named precision policies generated cases draw from: "fp32" (full precision) and "bf16"
# (bf16 parameters with an fp32 or bf16 reduction).
PRECISION_POLICIES = ("fp32", "bf16")
# Drawn only when asked for: "fp16", fp16 parameters with dynamic loss scaling (Case.loss_scaling;
# fp16's range needs it). Not among the defaults, so a seed draws the cases it always drew.
DRAWABLE_POLICIES = PRECISION_POLICIES + ("fp16",)


def canonical(name: str) -> str:
    """The printed name for any accepted spelling; ValueError (saying what is accepted) otherwise."""
    key = name.strip().lower().removeprefix("torch.") if isinstance(name, str) else None
    if key not in _ALIASES:
        raise ValueError(f"expected a dtype ({ACCEPTED}), got {name!r}")
    return _ALIASES[key]


def canonical_or_none(name: str | None) -> str | None:
    return None if name is None else canonical(name)


def to_torch(name: str | None) -> torch.dtype | None:
    """torch dtype of a name (None stays None: "as the parameter")."""
    import torch

    if name is None:
        return None
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[canonical(name)]


def name_of(dtype: torch.dtype) -> str:
    """The printed name of a torch dtype: torch.bfloat16 -> "bf16"; others as torch names them."""
    text = str(dtype).removeprefix("torch.")
    return _ALIASES.get(text, text)
