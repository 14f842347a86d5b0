"""Perturbation mode: the reference script run a second time, every gradient moved before the
optimizer steps, so `compare --calibration` can measure how far a rounding-sized difference at
one step carries through the user's own loop (Adam's normalisation, the next forward passes).

The idea of `reference/perturbation.py`, without its emulation: a user's loop cannot be replayed
op by op, so the move is derived from the gradient itself. A sharded run computes each gradient
element as the same sum as the reference in another order (per-rank partial sums over its samples,
then the data-parallel average), and two orders of one sum differ by about 2u times its magnitude
(u: the unit roundoff of the gradient's dtype) times the magnitude of its terms, not of its result:
an element whose terms cancel can come out with the other sign, and Adam's first update,
g / (sqrt(g^2) + eps), turns that sign into a whole learning-rate step (measured on the example:
parameters after step 1 off by 9e-6 where a move of 2u|g| per element, which never flips a sign,
moved them by 8e-9). The terms are not recorded; the gradient's largest element stands for their
magnitude (the scale every normwise deviation is measured against). So every element moves by
MOVE_ULPS * u * max|g| with a random sign (seeded: a calibration run is reproducible), and
`compare` takes a multiple of the deviation this run produces, never less than the step-1 bound.
Elements that are exactly zero stay zero: they had no terms (the embedding rows of tokens not in
the batch), every order of an empty sum is zero, and moving them would let Adam turn nothing into
an update of ~lr/10 (u max|g| against eps), a noise no correct run has.
"""

from __future__ import annotations

import os

import torch

from fsdp_verify.compare.tolerance import unit_roundoff

ENV = "FSDP_VERIFY_PERTURB"
MOVE_ULPS = 2.0


def seed_from_env() -> int | None:
    value = os.environ.get(ENV)
    if value in (None, ""):
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"{ENV}: expected an integer seed, got {value!r}") from None


class GradientPerturbation:
    def __init__(self, seed: int, rounded_to: torch.dtype | None = None):
        """rounded_to: the dtype the gradients were computed in before the reduce (a mixed
        precision policy's param_dtype), whose roundoff sets the move; None: the gradient's own."""
        self.seed = seed
        self.rounded_to = rounded_to
        self.generator = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def move(self, grad: torch.Tensor) -> None:
        """In place: grad += sign * MOVE_ULPS * u * max|grad| where grad != 0, a random sign per element."""
        if grad.numel() == 0:
            return
        signs = torch.randint(0, 2, grad.shape, generator=self.generator).to(grad.device, grad.dtype) * 2 - 1
        u = max(unit_roundoff(grad.dtype), unit_roundoff(self.rounded_to) if self.rounded_to else 0.0)
        move = signs * (grad.abs().max() * MOVE_ULPS * u)
        grad.add_(torch.where(grad != 0, move, torch.zeros_like(move)))
