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

import torch


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
    # How the average over the data-parallel ranks is divided: "fp16" (FSDP2's
    # `_get_gradient_divide_factors`: with an fp16 reduce_dtype, which overflows, each rank's
    # gradient is divided by a power of two f ~ sqrt(world) before the SUM reduction and the sum
    # by world / f after it; other dtypes are summed and divided by the world size), "always"
    # (FSDP1: that pre- and post-divide whatever the dtype) or "never" (sum, then divide). The
    # power-of-two pre-divide is exact unless a value is subnormal, but it decides whether an
    # fp16 sum overflows: under fp16 loss scaling, whether a step is skipped.
    predivide: str = "fp16"
    # A shard group of one (world size 1, or a (W, 1) mesh): FSDP1's NO_SHARD keeps the reduced
    # gradient in the FlatParameter's .grad, the next synced micro-batch's backward adds into it,
    # and it reduces that running sum again (`_reduce_grad_no_shard`) instead of reducing each
    # micro-batch's gradient alone and adding the results (`reference.reduction.FlatLayout.carry`).
    no_shard_reduces_running_sum: bool = False
    # "flat" only: the engine computes on views of each unit's unsharded flat buffer, at the
    # layout's offsets. A matmul's rounding depends on where its operands start (CPU BLAS takes
    # another kernel path when a row starts off a 16-byte boundary: `x @ W.t()` with W at element
    # offset 1, 2 or 3 of an fp32 buffer rounds 4 to 10 of 24 outputs otherwise, measured), so the
    # reference keeps its parameters at the same offsets (`reference.reduction.FlatLayout.compute`).
    # FSDP1 aligns every start to 16 bytes and computes as on standalone tensors.
    computes_on_flat_views: bool = False

    def __post_init__(self) -> None:
        if self.layout not in ("rows", "flat") or self.unit_order not in ("plan", "preorder"):
            raise ValueError(f"arithmetic: unknown layout or unit_order in {self!r}")
        if self.predivide not in ("fp16", "always", "never"):
            raise ValueError(f"arithmetic: unknown predivide in {self!r}")

    def divide_factors(self, reduce_dtype: torch.dtype, world: int) -> tuple[float, float]:
        """(pre, post): each rank's gradient (in reduce_dtype) is divided by `pre` before the sum,
        the sum by `post` after it; pre * post == world. The loop is torch 2.13's (FSDP2's
        `_get_gradient_divide_factors`, FSDP1's `DefaultState._get_gradient_predivide_factor`):
        world 2 -> (2, 1), 3 -> (2, 1.5), 4 -> (2, 2), 8 -> (4, 2)."""
        if self.predivide == "never" or (self.predivide == "fp16" and reduce_dtype != torch.float16):
            return 1.0, float(world)
        pre = 1
        while world % pre == 0 and world / pre > pre:
            pre *= 2
        return float(pre), world / pre


FSDP2 = Arithmetic()


def arithmetic_of(engine: object) -> Arithmetic:
    """The engine's declared arithmetic, FSDP2's if it declares none."""
    declared = getattr(engine, "arithmetic", None)
    return declared if isinstance(declared, Arithmetic) else FSDP2


def gloo_scalar_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """The sum of one value per rank as gloo's all-reduce adds a one-element tensor: from the last
    rank down to rank 0 (the element lies in the ring's first segment; measured on torch 2.13's
    gloo at world sizes 3 and 4, where the flat engines' clip norms then agree to the bit)."""
    total = values[-1]
    for v in values[-2::-1]:
        total = total + v
    return total


def gloo_allreduce_sum(values: list[torch.Tensor]) -> torch.Tensor:
    """The elementwise sum of one 1-D tensor per rank as gloo's ring all-reduce adds it (FSDP1's
    NO_SHARD all-reduce, and HYBRID_SHARD's over the replicas). gloo cuts the buffer into 2W (or
    more) segments of `ceil(bytes / 2W)` bytes rounded up to an element, a whole number per
    rank; the elements of rank r's segments are added in the order r-1, r-2, ..., r+1, r, as
    in the reduce-scatter (`reference.reduction.average`). Measured on torch 2.13's gloo at
    W = 3 and 4 for 1 to 5000 fp32 elements (and for a single element it is `gloo_scalar_sum`);
    gloo's segment cap (`maxSegmentSize`, far above the models here) is not modelled."""
    world = len(values)
    if world == 1:
        return values[0]
    numel, item = values[0].numel(), values[0].element_size()
    segment = -(-numel * item // (2 * world))
    segment = -(-segment // item) * item  # bytes, a whole number of elements
    segments = max(-(-numel * item // segment), 2 * world)
    segments = -(-segments // world) * world
    chunk = segments // world * segment // item  # elements per rank
    total = torch.empty_like(values[0])
    for r in range(world):
        lo, hi = r * chunk, min((r + 1) * chunk, numel)
        if lo >= hi:
            continue
        order = [(r - k) % world for k in range(1, world)] + [r]
        acc = values[order[0]][lo:hi] + values[order[1]][lo:hi]
        for q in order[2:]:
            acc = acc + values[q][lo:hi]
        total[lo:hi] = acc
    return total


def squared_norms_reduced(per_rank: list[torch.Tensor]) -> torch.Tensor:
    """Every rank's vector of norms made whole as DTensor reduces a `_NormPartial` vector: squared,
    summed over the ranks as gloo's ring all-reduce adds a vector (element by element, in the
    order of the segment each falls in: `gloo_allreduce_sum`); the roots are the caller's."""
    return gloo_allreduce_sum([n**2 for n in per_rank]) if len(per_rank) > 1 else per_rank[0] ** 2
