"""Layers shared by the built-in models."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Linear):
    """nn.Linear whose input follows the weight's dtype at call time. Under FSDP2 mixed precision
    the weight a unit computes with is the unsharded `param_dtype` copy, while its input may come
    from a unit with another `output_dtype`, or not be cast at all (`cast_forward_inputs=False`);
    reading the dtype anywhere but inside the layer's own forward would see the fp32 shard."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)
