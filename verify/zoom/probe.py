"""The zoom's probe on each rank (verify/zoom/watch.py): hooks on the model as built, before the
engine wraps it, so the names are the reference's and an engine's own hooks (FSDP2's
pre-forward is prepended, its post-forward appended) run outside each module's window.

Under pipeline parallelism the loop runs a whole schedule step in one call, so it cannot say
where a micro-batch's pass begins: each stage's `forward_one_chunk` and `backward_one_chunk`
(torch.distributed.pipelining, one micro-batch each) open and close the pass of that micro-batch
and the rank's data-parallel index, which the reference's pass of that rank and micro-batch
pairs with. The ranks of a pipeline record the modules of their stages under the same pass.
Interleaved1F1B's two stages a rank each call these per micro-batch too."""

from __future__ import annotations

import functools

import torch
from torch import nn

from fsdp_verify.probes.base import Probe
from fsdp_verify.zoom.watch import ModuleWatch


class ZoomProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.watch: ModuleWatch | None = None
        self._staged = False  # in a pipeline step at the zoom step: the stages open the passes

    def after_build(self, model: nn.Module) -> None:
        if self.case.zoom is not None and self.case.step is None:
            # a pipeline's root is no stage's (the reference's probe skips it too)
            self.watch = ModuleWatch(model, self.case.zoom, skip=("",) if self.case.pp > 1 else ())

    def after_shard(self, model: nn.Module, view) -> None:
        if self.watch is None:
            return
        if self.case.ep > 1:  # the experts each rank holds, the ranks whose rows they compute
            self.watch.experts_as_sharded(model)
        if self.case.tp > 1 or self.case.ep > 1:  # after the plan's (the combine's) output hooks, as the reference's
            self.watch.forward_hooks_last()
        if self.case.pp > 1:
            for stage in model.pipeline.stages:
                self._chunks(stage)

    def _chunks(self, stage) -> None:
        """A stage's forward and backward of one micro-batch, each its pass's (see the module
        docstring): private to torch's schedules, feature-tested (Case refuses a zoom beside a
        pipeline where they are missing: `stage_chunks`, verify/engines/pipeline_parallel.py)."""
        dp_rank = self.case.parallel.dp_rank(self.rank)
        for name, forwarding in (("forward_one_chunk", True), ("backward_one_chunk", False)):
            chunk = getattr(stage, name)

            @functools.wraps(chunk)
            def run(index, *args, _chunk=chunk, _forwarding=forwarding, **kwargs):
                if not self._staged:
                    return _chunk(index, *args, **kwargs)
                self.watch.open(index, dp_rank, forwarding=_forwarding)
                try:
                    return _chunk(index, *args, **kwargs)
                finally:
                    self.watch.end()

            setattr(stage, name, run)

    def before_forward(self, step: int, microbatch: int) -> None:
        if self.watch is not None and self.watch.watching(step):
            if self.case.pp > 1:
                self._staged = True
            else:
                self.watch.begin(microbatch, self.rank)

    def after_forward(self, step: int, microbatch: int, output: torch.Tensor) -> None:
        if self.watch is not None:
            self.watch.forward_done()

    def after_backward(self, step: int, microbatch: int) -> None:
        if self.watch is not None:
            self._staged = False
            self.watch.end()

    def to_gather(self):
        return self.watch.to_gather() if self.watch is not None else None

    def gathered(self, per_rank) -> None:
        if self.watch is None or self.trace is None:
            return
        for mine in per_rank:
            self.watch.records.update(mine["records"])
            # the reference's order is the one the zoom reads (verify/zoom/locate.py); a pipeline's
            # ranks each hold part of a pass's (their stages' calls)
            for pid, events in mine["order"].items():
                self.watch.order.setdefault(pid, []).extend(e for e in events if e not in self.watch.order[pid])
        self.watch.into(self.trace)
