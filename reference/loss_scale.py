"""fp16 dynamic loss scaling for the reference (seed 002), written out rather than borrowed from
`GradScaler`, so the two sides share no scaler code: multiply the loss by the scale, find infs
and NaNs in the (full, reduced) gradients, divide them by the scale, skip the step on overflow,
back the scale off then or grow it after `growth_interval` good steps in a row.

One process sees the whole gradient, so "any rank saw an inf" is "the gradient holds one": the
all-reduced found-inf flag of the sharded side, decided once for every rank.
"""

from __future__ import annotations

import torch

from fsdp_verify.case_specs import LossScaleSpec


class DynamicLossScale:
    def __init__(self, spec: LossScaleSpec):
        self.spec = spec
        # GradScaler keeps its scale in an fp32 tensor; every update below rounds to it.
        self.scale = torch.tensor(spec.init_scale, dtype=torch.float32)
        self.good_steps = 0

    def scaled(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale` (an fp32 product, as `GradScaler.scale`)."""
        return loss * self.scale

    def unscale_(self, grads: list[torch.Tensor]) -> bool:
        """Divide the gradients by the scale in place; True when any holds an inf or NaN. The
        division is a multiplication by the reciprocal computed in fp64 and rounded to fp32, as
        `GradScaler.unscale_` does (exact for the power-of-two scales drawn)."""
        inverse = self.scale.double().reciprocal().float()
        found = any(not torch.isfinite(g).all() for g in grads)
        for g in grads:
            g.mul_(inverse)
        return found

    def update(self, found_inf: bool) -> None:
        """The scale for the next step. On CPU `ShardedGradScaler._amp_update_scale_cpu_` multiplies
        the fp32 scale tensor in place by the Python factor (no finiteness check, unlike CUDA's
        `_amp_update_scale_` kernel: the two part only when a grown scale overflows fp32)."""
        if found_inf:
            self.scale = self.scale * self.spec.backoff_factor
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps == self.spec.growth_interval:
            self.scale = self.scale * self.spec.growth_factor
            self.good_steps = 0
