"""Steps that kill rank 1, or raise on it, part-way through the user's own code: the failure must
be named with that part of the step, not with the toolkit's record phase before or after it. Only
a rank process fails (RANK is set there, as torchrun sets it); the reference, in the test's
process, runs on."""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F


def _die_on_rank_1(ctx) -> None:
    if ctx.rank == 1 and os.environ.get("RANK") == "1":
        os._exit(7)


def _fails_before_its_backward(model, optimizer, batch, ctx, fail):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    fail(ctx)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def rank1_dies_in_its_backward(model, optimizer, batch, ctx):
    return _fails_before_its_backward(model, optimizer, batch, ctx, _die_on_rank_1)


def rank1_dies_in_its_optimizer_step(model, optimizer, batch, ctx):
    inputs, targets = batch
    loss = F.mse_loss(model(inputs), targets)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    _die_on_rank_1(ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def _raise_on_rank_1(ctx) -> None:
    if ctx.rank == 1 and os.environ.get("RANK") == "1":
        raise RuntimeError("the user's step failed on rank 1")


def rank1_raises_before_its_forward(model, optimizer, batch, ctx):
    _raise_on_rank_1(ctx)
    return rank1_dies_in_its_backward(model, optimizer, batch, ctx)


def rank1_raises_in_its_backward(model, optimizer, batch, ctx):
    return _fails_before_its_backward(model, optimizer, batch, ctx, _raise_on_rank_1)
