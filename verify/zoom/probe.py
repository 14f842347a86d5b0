"""The zoom's probe on each rank (verify/zoom/watch.py): hooks on the model as built, before the
engine wraps it, so the names are the reference's and an engine's own hooks (FSDP2's
pre-forward is prepended, its post-forward appended) run outside each module's window."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify.probes.base import Probe
from fsdp_verify.zoom.watch import ModuleWatch


class ZoomProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch: ModuleWatch | None = None

    def after_build(self, model: nn.Module) -> None:
        if self.case.zoom is not None and self.case.step is None:
            self.watch = ModuleWatch(model, self.case.zoom)

    def after_shard(self, model: nn.Module, view) -> None:
        if self.watch is None:
            return
        if self.case.ep > 1:  # the experts each rank holds, the ranks whose rows they compute
            self.watch.experts_as_sharded(model)
        if self.case.tp > 1 or self.case.ep > 1:  # after the plan's (the combine's) output hooks, as the reference's
            self.watch.forward_hooks_last()

    def before_forward(self, step: int, microbatch: int) -> None:
        if self.watch is not None and self.watch.watching(step):
            self.watch.begin(microbatch, self.rank)

    def after_forward(self, step: int, microbatch: int, output: torch.Tensor) -> None:
        if self.watch is not None:
            self.watch.forward_done()

    def after_backward(self, step: int, microbatch: int) -> None:
        if self.watch is not None:
            self.watch.end()

    def to_gather(self):
        return self.watch.to_gather() if self.watch is not None else None

    def gathered(self, per_rank) -> None:
        if self.watch is None or self.trace is None:
            return
        for mine in per_rank:
            self.watch.records.update(mine["records"])
            self.watch.order.update(mine["order"])
        self.watch.into(self.trace)
