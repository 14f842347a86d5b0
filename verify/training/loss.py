"""The loss both sides compute, the same way."""

from __future__ import annotations

import torch

from fsdp_verify.models import ModelSpec


def loss_fn(spec: ModelSpec, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the samples given, computed in fp32 whatever the output dtype."""
    if spec.kind == "mlp":
        return torch.nn.functional.mse_loss(output.float(), target.float())
    return torch.nn.functional.cross_entropy(output.float().flatten(0, 1), target.flatten())
