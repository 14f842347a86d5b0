"""Probe: the hooks the sharded loop calls on every rank, in the same order (so a hook may run
collectives). Records go into the trace, which only rank 0 keeps (`self.trace` is None elsewhere)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from fsdp_verify.case import Case
from fsdp_verify.engines.view import EngineView
from fsdp_verify.trace import Trace


def eager_hook(case: Case, hook):
    """A probe's module hook, run eagerly under torch.compile (verify/training/compile.py): a
    compiled unit calls its hooks from its compiled `__call__`, and Dynamo would compile a hook
    that is not disabled as a frame of its own (an observer's introspection: graph breaks and a
    recompilation per call). Unchanged without compile."""
    if case.compile is None:
        return hook
    import torch._dynamo

    return torch._dynamo.disable(hook, recursive=True)


class Probe:
    def __init__(self, case: Case, rank: int, world_size: int, trace: Trace | None):
        self.case, self.rank, self.world_size, self.trace = case, rank, world_size, trace

    def add(self, step: int, phase: str, name: str, value: torch.Tensor) -> None:
        if self.trace is not None:
            self.trace.add(step, phase, name, value)

    def meta(self, key: str, value: Any) -> None:
        if self.trace is not None:
            self.trace.meta[key] = value

    def after_build(self, model: nn.Module) -> None:
        """The model as built, before the engine sees it."""

    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        """The engine's module and view, before the first step."""

    def after_optimizer(self, optimizer: torch.optim.Optimizer, view: EngineView) -> None:
        """The optimizer the loop built from `view.parameters()`, before the first step."""

    def before_forward(self, step: int, microbatch: int) -> None: ...

    def after_forward(self, step: int, microbatch: int, output: torch.Tensor) -> None: ...

    def after_backward(self, step: int, microbatch: int) -> None: ...

    def after_step(self, step: int) -> None:
        """After the optimizer step (params and state already recorded)."""

    def finish(self) -> None: ...

    def to_gather(self) -> Any:
        """What this rank contributes to the one object gather at the end of the case (every
        rank's, in rank order, comes back to `gathered`); None: nothing. Each collective costs a
        round trip between rank processes, so probes gather here once rather than step by step."""
        return None

    def gathered(self, per_rank: list[Any]) -> None:
        """Every rank's `to_gather()`, in rank order; called on rank 0 only (the gather goes there
        with the records, verify/sharded/collect.py), so only for what goes into the trace."""
