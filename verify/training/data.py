"""Deterministic global batches: every rank and the reference regenerate the same global batch
from (data_seed, step) and take their slice, so no data ever crosses a process boundary."""

from __future__ import annotations

import torch

from fsdp_verify.case import Case


def global_batch(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets of `step` (1-based) for the whole world, in global sample order."""
    g = torch.Generator().manual_seed(case.data_seed * 1_000_003 + step)
    spec, b = case.model, case.data.batch_size
    if spec.kind == "transformer":
        tokens = torch.randint(0, spec.vocab_size, (b, spec.seq_len + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
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


def rank_slice(case: Case, rank: int) -> slice:
    """Samples of data-parallel rank `rank`: a contiguous block of the global batch."""
    n = case.local_batch
    return slice(rank * n, (rank + 1) * n)


def microbatch_slices(case: Case, rank: int) -> list[slice]:
    """The per-micro-batch sample slices (into the global batch) that `rank` runs, in order."""
    base, n = rank_slice(case, rank).start, case.local_batch // case.microbatches
    return [slice(base + m * n, base + (m + 1) * n) for m in range(case.microbatches)]
