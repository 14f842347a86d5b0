"""A training step of your own under `fsdp-verify check --step examples/step/steps.py:train_step`:
it runs unchanged on the reference (one device, the global batch) and on every rank (its block of
the batch, under the engine). docs/user-step.md shows it and runs it."""

import torch
import torch.nn.functional as F


def train_step(model, optimizer, batch, ctx):
    scale = ctx.world_size / ctx.global_items  # the global token mean (seed 000)
    total = 0.0
    for m, (inputs, targets) in enumerate(ctx.split(batch)):
        with ctx.microbatch(m):  # no_sync() but on the last, if the case says so
            out = model(**inputs) if isinstance(inputs, dict) else model(inputs)  # --padded: a dict
            logits = out if isinstance(out, torch.Tensor) else out.logits  # HF: a ModelOutput
            loss = (
                F.cross_entropy(logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum")
                * scale
            )
            loss.backward()
        total += loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad()
    return total  # this rank's share: the mean over ranks is the loss
