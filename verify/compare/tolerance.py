"""How far apart two records may be: derived, not guessed.

Deviation is measured normwise: err = max|sharded - reference| / max|reference| (the inf-norm
relative error). Elementwise relative error is reported too, but not judged: it explodes wherever
the reference is near zero, and a correct engine produces such elements every step.

Three modes, in the order DESIGN.md prefers them:

* exact: the quantity is copied, never recomputed, so a correct engine reproduces it bit for bit
  (initial parameters: sharding and all-gathering move bits; nothing rounds). Limit 0.
* bound: the reference emulates the engine's arithmetic (per-rank micro-batches, casts, reduction
  in `reduce_dtype`), so what remains is reassociation: the order in which a collective adds the
  ranks' contributions, the order of the per-parameter norms in a clip, of the per-rank losses. One
  reassociated sum of fp32 values differs by a few units of roundoff of its result; FLOOR_ULPS such
  units of the tensor's largest element leaves room for that (and for one extra rounding in a
  record stored in a low-precision dtype, measured in that dtype's unit), yet stays far below the
  1e-5 relative error on one rank's activations that must be caught in fp32
  (16 * 2**-24 = 9.5e-7).
* calibrated: reassociation noise compounds over steps (an fp32 ulp that flips a bf16 rounding of
  a parameter at step 2 moves every logit by a bf16 ulp at step 3). Its size is not known a priori,
  so it is measured: the reference is run again in numerically equivalent ways, each a freedom a
  correct engine has (ranks reduced in rank order, in reverse order, and in ring order along each
  unit's flattened gradient as a FlatParameter engine's reduce-scatter adds them; and without
  FSDP2's identity autograd node on unit inputs, which regroups the gradient sum of the residual
  stream; not the global batch in one piece, whose bf16 roundings no sharded run shows) and each
  record may deviate NOISE_MULTIPLE times the largest deviation seen between those runs and the
  emulating reference, and never less than the bound. Each run added here can only raise that
  limit, so each is a freedom measured on a correct engine (the flat order and the missing node:
  FSDP1 false alarms at 1.01x and 16 ulp), never a loosening to pass; the bug zoo still catches
  every bug at 17.6x or more. Calibration costs four more reference runs, so it runs only when
  some record exceeds its bound.

Every finding says which mode held it, the limit, and the ratio of its deviation to that limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

UNIT_ROUNDOFF = {
    torch.float64: 2.0**-53,
    torch.float32: 2.0**-24,
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-11,
}
FLOOR_ULPS = 16.0
NOISE_MULTIPLE = 10.0
# The perturbed run moves every order-dependent result by the worst case in magnitude with random
# signs (reference/perturbation.py). At the reduction itself that is already the bound; downstream
# a real reordering's errors are smaller and no more aligned than random signs: 2 for the signs.
# Only for a pool whose inputs were not moved too (CompareContext._moved_only_directly); a pool
# that also inherits earlier moves holds a sample and gets NOISE_MULTIPLE.
FLOOR_MULTIPLE = 2.0
# A record past this fraction of its bound is judged against the calibrated tolerance instead:
# the bound is the tightest limit, not the one the arithmetic allows, and a correct engine should
# pass with margin (worst deviation/tolerance at most 0.5).
MARGIN = 0.5


@dataclass(frozen=True)
class Tolerance:
    mode: str  # "exact" | "bound" | "calibrated"
    limit: float  # on the normwise relative error
    why: str


def unit_roundoff(dtype: torch.dtype) -> float:
    return UNIT_ROUNDOFF.get(dtype, 2.0**-24)


@dataclass(frozen=True)
class Deviation:
    max_abs: float
    normwise: float  # max_abs / max|reference|
    max_rel: float  # elementwise, relative to max(|reference|, tiny)
    max_ulp: int  # in the sharded record's dtype
    scale: float  # max|reference|


EXACT_MATCH = Deviation(0.0, 0.0, 0.0, 0, 0.0)  # two records equal to the bit


def measure(ref: torch.Tensor, got: torch.Tensor) -> Deviation:
    a, b = ref.detach().double(), got.detach().double()
    diff = (a - b).abs()
    scale = a.abs().max().item() if a.numel() else 0.0
    max_abs = diff.max().item() if diff.numel() else 0.0
    tiny = torch.finfo(torch.float64).tiny
    normwise = max_abs / scale if scale > 0 else (0.0 if max_abs == 0 else float("inf"))
    max_rel = (diff / a.abs().clamp_min(tiny)).max().item() if diff.numel() else 0.0
    return Deviation(max_abs, normwise, max_rel, ulp_distance(ref.to(got.dtype), got), scale)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest number of representable values between corresponding elements."""
    if a.numel() == 0 or not a.is_floating_point():
        return 0
    int_type = {8: torch.int64, 4: torch.int32, 2: torch.int16}[a.element_size()]

    def ordered(t: torch.Tensor) -> torch.Tensor:
        i = t.contiguous().view(int_type).long()
        return torch.where(i < 0, torch.iinfo(int_type).min - i, i)

    return int((ordered(a) - ordered(b)).abs().max().item())


def bound_tolerance(dtype: torch.dtype) -> Tolerance:
    """FLOOR_ULPS fp32 units of the largest element, plus one ulp (2u) of the record's own dtype
    when that is coarser than fp32 (a bf16 logit whose fp32 input moved by an ulp may round the
    other way)."""
    u32 = unit_roundoff(torch.float32)
    extra = 2 * unit_roundoff(dtype) if unit_roundoff(dtype) > u32 else 0.0
    limit = FLOOR_ULPS * u32 + extra
    why = f"{FLOOR_ULPS:g} fp32 units of roundoff of the largest element (reassociated sums)"
    if extra:
        why += f" + one {str(dtype).replace('torch.', '')} ulp (one rounding flip)"
    return Tolerance("bound", limit, why)


def calibrated_tolerance(dtype: torch.dtype, noise: float, floor: float = 0.0, moved: bool = False) -> Tolerance:
    """The largest of three limits, and the reason names the one that set it: the bound, the
    measured noise between equivalent runs, or the derived floor (the perturbed run's deviation:
    FLOOR_MULTIPLE times it where the run moved this record directly by its error bound,
    NOISE_MULTIPLE times it where the move only reached it through rounding flips, a sample)."""
    bound = bound_tolerance(dtype)
    multiple = FLOOR_MULTIPLE if moved else NOISE_MULTIPLE
    candidates = [
        (bound.limit, f"the bound {bound.limit:.3g} ({bound.why})"),
        (
            NOISE_MULTIPLE * noise,
            f"{NOISE_MULTIPLE:g}x the deviation {noise:.3g} between numerically equivalent reference runs",
        ),
        (
            multiple * floor,
            f"{multiple:g}x the derived floor {floor:.3g} (every reduction and clip norm moved by its"
            f" error bound for any summation order{'' if moved else ', reaching this record through later steps'})",
        ),
    ]
    limit, why = max(candidates, key=lambda c: c[0])
    others = "; ".join(w for lim, w in candidates if w != why and lim > 0)
    return Tolerance("calibrated", limit, why + (f" (at least: {others})" if others else ""))


EXACT = Tolerance("exact", 0.0, "copied, never recomputed: a correct engine reproduces every bit")
