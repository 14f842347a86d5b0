"""Arithmetic: what an engine computes in an order of its own, declared so that the reference can
emulate it bit for bit instead of leaving it to a tolerance.

Two correct engines differ only in the order they add things: where a unit's gradient is cut into
rank chunks (FSDP2 by rows of each parameter; a FlatParameter engine along one flat, padded
buffer per unit, FSDP1 with each parameter's start aligned to 16 bytes), how a clip's global norm
is put together from the pieces each rank holds, and whether an identity autograd node on unit
inputs regroups gradient sums. An engine states its choices as an attribute of its entry point,
`fn.arithmetic = Arithmetic(...)`; an engine that states none is emulated as FSDP2, and anything it
does otherwise is left to the calibrated tolerance and its derived floor.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Arithmetic:
    # "rows": every parameter cut into rank chunks along dim 0 (FSDP2's Shard(0)); "flat": each
    # unit's parameters (frozen ones too) flattened in registration order into one buffer, padded
    # to a multiple of the world size and cut into equal contiguous chunks.
    layout: str = "rows"
    # "flat" only: each parameter's start aligned to this many bytes of the compute dtype
    # (FSDP1 with use_orig_params: 16, from TorchInductor's alignment), 0 for none.
    align_bytes: int = 0
    # "flat" only, the clip's norm: units in the order of the wrap plan ("plan", children first)
    # or of the module tree ("preorder", the root first, as FSDP1's handles are listed); a rank
    # that holds no element of a parameter counts a zero norm for it (True) or skips it (False).
    unit_order: str = "plan"
    empty_pieces_in_norm: bool = False
    # FSDP2's identity node on unit inputs (RegisterPostBackwardFunction); FSDP1 has none.
    unit_input_node: bool = True
    # Whether a (non-root) unit that holds no parameters of its own still casts its inputs to
    # param_dtype (FSDP2 does; FSDP1 casts only where it has a FlatParameter: `_pre_forward`).
    casts_inputs_without_params: bool = True
    # At world size 1 the clip's norm is torch.nn.utils.clip_grad_norm_'s over the parameters in
    # registration order (FSDP1 switches to NO_SHARD, whose clip is exactly that).
    plain_norm_unsharded: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("rows", "flat") or self.unit_order not in ("plan", "preorder"):
            raise ValueError(f"arithmetic: unknown layout or unit_order in {self!r}")


FSDP2 = Arithmetic()


def arithmetic_of(engine: object) -> Arithmetic:
    """The engine's declared arithmetic, FSDP2's if it declares none."""
    declared = getattr(engine, "arithmetic", None)
    return declared if isinstance(declared, Arithmetic) else FSDP2
