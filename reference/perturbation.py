"""Perturbation: the reference run that sets the floor under every calibrated tolerance.

Calibration runs sample summation orders someone thought of (rank order, reverse, ring, flat);
an engine that adds in an order nobody sampled (FSDP1's pre- and post-divide with its alignment
padding, NCCL's trees, a home-grown ring) can round differently while every sampled order agrees
to the bit, and the tolerance then collapses to the fp32 bound on, say, a bf16 reduction. So the
floor is derived from what each computation is, not from what was sampled: every result that a
correct engine may compute in another order is moved by its worst-case difference between two
orders, with a random sign, and the run carries those moves through everything downstream
(clipping, Adam's normalisation, the next steps' forward passes). The deviation of that run from
the emulating reference is the floor; calibration may raise a tolerance above it, never lower it.

The bounds (first order in the unit roundoff u of the dtype the engine computes in):

* an average over W ranks, fl(sum_r x_r) / W: recursive summation errs by at most (W - 1) u sum_r|x_r|,
  the division (or a pre-multiplication of each term by 1/W, as NCCL's AVG does, or FSDP1's
  pre-/post-divide) by u sum_r|x_r| / W more, so one order is within u sum_r|x_r| of the exact
  average and two orders within 2 u sum_r|x_r|. With W <= 2 there is no other order (x0 + x1 is
  commutative; halving is exact), so nothing moves: a correct engine is bit-exact there.
* a clip's total norm over N gradient elements held in P pieces (a piece per parameter and rank):
  each square rounds once, a blocked or tree reduction of n elements has depth about log2 n, each
  piece's norm is a square root squared again (2 more roundings), the pieces are summed in some
  order (P - 1), and the final square root halves the relative error and adds one: one evaluation
  is within (log2 N + P + 3) u / 2 + u of the exact norm, two within (log2 N + P + 5) u.

The signs are random (seeded per case, so the floor is reproducible), the magnitudes are the worst
case. Where a result is moved directly (`moved`: the gradients of a step, its loss, its clip
norm) a real reordering errs less and no more aligned than random signs, so a small multiple of
the move covers it (FLOOR_MULTIPLE in verify/compare/tolerance.py). Everything downstream only
inherits the moves through roundings that flip one way or the other (a parameter's last bit after
Adam, then every logit of the next step), and which of them flip is a sample, as between the
calibration runs: those records get the noise multiple.
"""

from __future__ import annotations

import math

import torch

from fsdp_verify.compare.tolerance import unit_roundoff


class Perturbation:
    def __init__(self, seed: int, world_size: int):
        self.generator = torch.Generator().manual_seed(seed)
        self.world_size = world_size
        self.moved: set[str] = set()  # "step/phase" of every record moved directly

    def _signs(self, shape: torch.Size) -> torch.Tensor:
        return torch.randint(0, 2, shape, generator=self.generator).double() * 2 - 1

    def reduction(self, result: torch.Tensor, terms: list[torch.Tensor], where: str) -> torch.Tensor:
        """`result` = the average of `terms` (one per rank) as the emulation computed it, moved by
        2 u sum_r|x_r| (u of `result`'s dtype) with a random sign per element."""
        if self.world_size <= 2:
            return result
        self.moved.add(where)
        magnitude = torch.stack([t.detach().to(result.dtype).double().abs() for t in terms]).sum(0)
        moved = result.detach().double() + self._signs(result.shape) * 2 * unit_roundoff(result.dtype) * magnitude
        return moved.to(result.dtype)

    def rank_rounding(self, result: torch.Tensor, terms: list[torch.Tensor], u: float, where: str) -> torch.Tensor:
        """`result` = the average of `terms`, each of which a correct rank may have rounded one
        way or the other in a dtype of unit roundoff `u` (a rank's gradient computed at a loss
        scale an ulp away from the reference's: reference/user_step.py), moved by
        2 u sum_r|x_r| / W with a random sign per element."""
        self.moved.add(where)
        magnitude = torch.stack([t.detach().double().abs() for t in terms]).sum(0) / len(terms)
        moved = result.detach().double() + self._signs(result.shape) * 2 * u * magnitude
        return moved.to(result.dtype)

    def norm(self, norm: torch.Tensor, grads: list[torch.Tensor], where: str) -> torch.Tensor:
        """The clip's total norm, moved by (log2 N + P + 5) u of itself, with a random sign."""
        self.moved.add(where)
        numel = sum(g.numel() for g in grads)
        relative = norm_rounding(numel, len(grads) * self.world_size, norm.dtype)
        moved = norm.double() * (1 + self._signs(norm.shape) * relative)
        return moved.to(norm.dtype)


def norm_rounding(numel: int, pieces: int, dtype: torch.dtype) -> float:
    """How far apart two evaluations of a clip's total norm over `numel` gradient elements held
    in `pieces` pieces may round, relative to the norm (module docstring): (log2 N + P + 5) u,
    u of the norm's `dtype`; each evaluation is within half that (and u) of the exact norm."""
    return (math.ceil(math.log2(max(numel, 2))) + pieces + 5) * unit_roundoff(dtype)
