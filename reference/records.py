"""What the reference records, and what one emulated rank's pass hands back (`RankPass`; `RankShare`:
the ranks' passes split over processes): the logits in rank order, the parameters and buffers, a
resume's loaded state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn

from fsdp_verify.trace import Trace
from fsdp_verify.training.optim import (
    optimizer_state,
    param_groups_state,
)
from fsdp_verify.training.rng import rng_fingerprint


@dataclass
class RankPass:
    """What one emulated rank's forward and backward of a micro-batch give."""

    grads: dict[str, torch.Tensor]  # in `trainable` order
    logits: torch.Tensor
    loss: torch.Tensor  # float32
    rng_before: int  # its dropout generator's fingerprint before and after the forward,
    rng_after: int
    rng_after_backward: int  # and after the backward
    # A grouped GEMM's rows under expert parallelism, by parameter (reference/grouped_gemm.py).
    rows: dict = field(default_factory=dict)


class RankShare(Protocol):
    """Emulated ranks split over processes: `mine(r)` says whether this process runs rank r;
    `exchange` gives every rank's pass, this process's and the others' (a collective); `begin`
    sees the model as built."""

    def begin(self, model: nn.Module) -> None: ...

    def mine(self, r: int) -> bool: ...

    def exchange(self, passes: dict[int, RankPass], model: nn.Module) -> dict[int, RankPass]: ...


def store_logits(logits: dict[int, torch.Tensor], index, out: torch.Tensor) -> None:
    rows = range(index.start, index.stop) if isinstance(index, slice) else index.tolist()
    for i, row in zip(rows, out):
        logits[i] = row.unsqueeze(0)


def record_resumed(
    trace: Trace,
    step: int,
    params: dict[str, nn.Parameter],
    optimizer: torch.optim.Optimizer,
    rng_states: list[torch.Tensor],
) -> None:
    """What every loop's load gives (phase "resumed", at the step saved after): parameters,
    optimizer state, the param groups' hyperparameters, every rank's generator (in rank
    order: `rank_streams`) and the data
    position (a global batch per step)."""
    for n, p in params.items():
        trace.add(step, "resumed", f"params.{n}", p)
    for key, value in optimizer_state(optimizer, params).items():
        trace.add(step, "resumed", f"optim.{key}", value)
    for key, value in param_groups_state(optimizer).items():
        trace.add(step, "resumed", key, value)
    prints = [rng_fingerprint(s) for s in rng_states]
    trace.add(step, "resumed", "rng", torch.tensor(prints, dtype=torch.int64))
    trace.add(step, "resumed", "data_position", torch.tensor([step], dtype=torch.int64))


def carried_over(old: nn.Module, new: nn.Module) -> None:
    """`old`'s parameters and buffers copied into `new` (a resume in memory: exact)."""
    with torch.no_grad():
        for (_, to), (_, of) in zip(new.named_parameters(), old.named_parameters()):
            to.copy_(of)
        for (_, to), (_, of) in zip(new.named_buffers(), old.named_buffers()):
            to.copy_(of)


def record_params(trace: Trace, step: int, params: dict[str, nn.Parameter], initial: bool = False) -> None:
    total = torch.zeros((), dtype=torch.float64)
    for n, p in params.items():
        if initial:
            trace.add(0, "init", n, p)
        else:
            trace.add(step, "params", n, p)
        s = p.detach().double().sum()
        trace.add(step, "param_sums", n, s)
        total += s
    trace.add(step, "param_sums", "__total__", total)


def record_buffers(trace: Trace, step: int, model: nn.Module) -> None:
    for n, b in model.named_buffers():
        trace.add(step, "buffers", n, b)
