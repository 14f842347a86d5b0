"""Steps that kill rank 1 part-way through the user's own code: the failure must be named with
that part of the step, not with the toolkit's record phase before it. Only a rank process dies
(RANK is set there, as torchrun sets it); the reference, in the test's process, runs on."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _die_on_rank_1(ctx) -> None:
    if ctx.rank == 1 and os.environ.get("RANK") == "1":
        os._exit(7)


def rank1_dies_in_its_backward(model, optimizer, batch, ctx):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    _die_on_rank_1(ctx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def rank1_dies_in_its_optimizer_step(model, optimizer, batch, ctx):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    _die_on_rank_1(ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()
