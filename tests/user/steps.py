"""A user's own training steps, written outside the package: what `--step tests.user.steps:NAME`
brings under test. `train_step` is correct; the others carry the loop bugs the issue names."""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _logits(output) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.logits


def _forward(model, inputs):
    return model(**inputs) if isinstance(inputs, dict) else model(inputs)


def _token_loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def _accumulate(model, batch, ctx, scale: float | None) -> torch.Tensor:
    """Forward and backward over ctx.microbatches, each micro-batch's token loss sum times
    `scale` (None: its own mean over tokens, / microbatches); returns the summed loss."""
    total = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for m, (inputs, targets) in enumerate(ctx.split(batch)):
        with ctx.microbatch(m):
            logits = _logits(_forward(model, inputs))
            if scale is None:
                flat = logits.float().flatten(0, -2)
                loss = F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE_INDEX) / ctx.microbatches
            else:
                loss = _token_loss_sum(logits, targets) * scale
            loss.backward()
        total += loss.detach()
    return total


def train_step(model, optimizer, batch, ctx, max_norm: float | None = 1.0):
    """Gradient accumulation over ctx.microbatches, the loss normalised by the global token count
    (each rank scales by world_size / global tokens, as data-parallel averaging divides by the
    world size again), the clip's norm over all ranks, then the optimizer."""
    total = _accumulate(model, batch, ctx, ctx.world_size / ctx.global_items)
    if max_norm is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def train_step_microbatch_mean(model, optimizer, batch, ctx):
    """Bug: each micro-batch's loss is its own mean over tokens, averaged over micro-batches. With
    variable lengths a token's weight depends on how full its micro-batch (and rank) is."""
    total = _accumulate(model, batch, ctx, None)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def train_step_local_clip(model, optimizer, batch, ctx, max_norm: float = 1e-3):
    """Bug: the clip's norm from this rank's shards only (`to_local()`), as if the gradients were
    whole on every rank: each rank clips by its own, smaller norm."""
    total = _accumulate(model, batch, ctx, ctx.world_size / ctx.global_items)
    params = [p for p in model.parameters() if p.grad is not None]
    local = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad for p in params]
    norm = torch.nn.utils.get_total_norm(local)
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total


def train_step_tight_clip(model, optimizer, batch, ctx):
    """`train_step` with a clip that always bites (the local-norm bug's correct twin)."""
    return train_step(model, optimizer, batch, ctx, max_norm=1e-3)


def train_step_forgets_world_size(model, optimizer, batch, ctx):
    """Bug: the loss scaled by 1 / global tokens on every rank; data-parallel averaging then
    divides by the world size once more."""
    total = _accumulate(model, batch, ctx, 1 / ctx.global_items)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total
