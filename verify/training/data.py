"""Deterministic global batches: every rank and the reference regenerate the same global batch
from (data_seed, step) and take their slice, so no data ever crosses a process boundary.

Inputs are a tensor (the model's one argument) or a dict of keyword arguments, batch first
(`input_ids` and `attention_mask` for a custom model whose forward takes a mask). Targets that
are `IGNORE_INDEX` are padding: the loss neither counts nor normalises by them."""

from __future__ import annotations

from typing import Any

import torch

from fsdp_verify.case import Case
from fsdp_verify.imports import load_object

IGNORE_INDEX = -100
Inputs = torch.Tensor | dict[str, torch.Tensor]


def global_batch(case: Case, step: int) -> tuple[Inputs, torch.Tensor]:
    """Inputs and targets of `step` (1-based) for the whole world, in global sample order."""
    g = torch.Generator().manual_seed(case.data_seed * 1_000_003 + step)
    spec, b = case.model, case.data.batch_size
    if case.data.fn is not None:
        return load_object(case.data.fn, "data.fn")(case, step, g)
    if spec.kind != "mlp":
        return _tokens(case, g)
    d_in, d_out = spec.widths[0], spec.widths[-1]
    x = torch.randn(b, d_in, generator=g) * case.data.scale
    y = torch.randn(b, d_out, generator=g)
    if case.data.kind == "cancellation":
        # Sample i of the second half mirrors sample i of the first half, with tiny noise: the
        # halves land on different ranks, so per-rank gradients are large and nearly cancel
        # (seed 000: in bf16, 1e7 + 1 - 1e7 + 1 == 0). Large inputs make the cancelled part big.
        half = b // 2
        x = x * 1e3
        x[half : 2 * half] = -x[:half] + 1e-2 * torch.randn(half, d_in, generator=g)
        y[half : 2 * half] = -y[:half]
    return x, y


def _tokens(case: Case, g: torch.Generator) -> tuple[Inputs, torch.Tensor]:
    """Token ids in [0, vocab); targets are the next token. Padded: sequence i keeps its first
    `length_i` tokens (1..seq_len, drawn), the rest are token 0 with target IGNORE_INDEX (right
    padding, so a causal model's real positions never see a pad)."""
    spec, b = case.model, case.data.batch_size
    vocab, takes_mask, first = spec.vocab_size, False, "tokens"
    if spec.is_custom:
        from fsdp_verify.models.custom import info

        model = info(spec)
        vocab, takes_mask, first = model.vocab_size, model.takes_attention_mask, model.first_input
    tokens = torch.randint(0, vocab, (b, spec.seq_len + 1), generator=g)
    inputs, targets = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    mask = torch.ones_like(inputs)
    if case.data.padded:
        lengths = torch.randint(1, spec.seq_len + 1, (b,), generator=g)
        pad = torch.arange(spec.seq_len)[None, :] >= lengths[:, None]
        inputs, targets = inputs.masked_fill(pad, 0), targets.masked_fill(pad, IGNORE_INDEX)
        mask = (~pad).long()
    if takes_mask:
        return {first: inputs, "attention_mask": mask}, targets
    return inputs, targets


def take(inputs: Inputs, index: Any, device: torch.device | str | None = None) -> Inputs:
    """Rows `index` of the inputs (on `device`)."""
    if isinstance(inputs, dict):
        return {k: v[index] if device is None else v[index].to(device) for k, v in inputs.items()}
    return inputs[index] if device is None else inputs[index].to(device)


def as_call(inputs: Inputs) -> tuple[tuple, dict]:
    """(args, kwargs) for the model's forward."""
    return ((), dict(inputs)) if isinstance(inputs, dict) else ((inputs,), {})


def item_count(case: Case, targets: torch.Tensor) -> int:
    """What the loss is a mean over: real target tokens (not IGNORE_INDEX) of a token model or a
    user loss; an MLP's samples."""
    if case.model.kind == "mlp" and case.loss is None:
        return targets.shape[0]
    return int((targets != IGNORE_INDEX).sum())


def rank_slice(case: Case, rank: int) -> slice:
    """Samples of data-parallel rank `rank`: a contiguous block of the global batch."""
    n = case.local_batch
    return slice(rank * n, (rank + 1) * n)


def microbatch_slices(case: Case, rank: int) -> list[slice]:
    """The per-micro-batch sample slices (into the global batch) that `rank` runs, in order."""
    base, n = rank_slice(case, rank).start, case.local_batch // case.microbatches
    return [slice(base + m * n, base + (m + 1) * n) for m in range(case.microbatches)]
