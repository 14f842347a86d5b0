"""The loss both sides compute, the same way, and how it is normalised.

A token model's loss is the true mean over the step's real tokens (targets that are not
IGNORE_INDEX): each micro-batch contributes `loss_sum * scale` with `scale = dp_size /
global_tokens` (seed 000's `loss * dp_size / global_batch_size`; each rank sums its own tokens and
ReduceOp.AVG divides by dp_size again). Normalising per micro-batch or per rank instead gives the
same number only when every micro-batch holds as many real tokens; padded batches tell them apart.
`scale` is a Python float from integers, so formulas that agree in exact arithmetic agree bit for
bit (W / (W*M*n) and 1 / (M*n) round to the same double)."""

from __future__ import annotations

import torch

from fsdp_verify.case import Case
from fsdp_verify.imports import load_object
from fsdp_verify.models import ModelSpec
from fsdp_verify.training.data import IGNORE_INDEX


def loss_fn(spec: ModelSpec, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean loss over the samples given, computed in fp32 whatever the output dtype."""
    if spec.kind == "mlp":
        return torch.nn.functional.mse_loss(output.float(), target.float())
    return torch.nn.functional.cross_entropy(output.float().flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX)


def loss_sum(case: Case, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Sum over the real items: the user's loss, or next-token cross-entropy, in fp32."""
    if case.loss is not None:
        return load_object(case.loss, "loss")(logits, target).float()
    return torch.nn.functional.cross_entropy(
        logits.float().flatten(0, -2), target.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )


def global_mean_scale(dp_size: int, global_items: int) -> float:
    """The factor on each micro-batch's loss sum that makes the reduced gradient the gradient of
    the global mean (ReduceOp.AVG divides by dp_size once more)."""
    return dp_size / max(global_items, 1)


def microbatch_loss(case: Case, logits: torch.Tensor, target: torch.Tensor, scale: float) -> torch.Tensor:
    """What one micro-batch backpropagates. An MLP keeps its per-sample mean over micro-batches
    (every micro-batch holds as many samples)."""
    if case.model.kind == "mlp" and case.loss is None:
        return loss_fn(case.model, logits, target) / case.microbatches
    return loss_sum(case, logits, target) * scale
