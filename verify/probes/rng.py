"""RNG probe: a fingerprint of each rank's global (CPU) generator before and after every
micro-batch's forward, and after its backward, gathered once at the end into records (step, "rng",
"before_forward.<m>") holding one int64 per rank. The reference replays each rank's stream and
records the same points, so a rank that draws a different stream (a shared dropout mask, a reseed,
an extra draw) shows at the first forward where it happens, and a backward that draws (activation
checkpointing that recomputes dropout without restoring the generator) at that backward, bit for
bit, even in a one-step case. With a user's step the toolkit sees one backward a step, not one a
micro-batch, so there the points are the forwards' only. Also notes the device type the engine's
parameters live on: the reference draws initial values on the CPU, and CPU and CUDA generators
differ for one seed."""

from __future__ import annotations

import torch
from torch import nn

from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe
from fsdp_verify.training.rng import rng_fingerprint


class RngProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.points: list[tuple[int, str, int]] = []

    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        devices = sorted({p.device.type for p in view.parameters().values()})
        self.meta("param_device_types", devices)

    def before_forward(self, step: int, microbatch: int) -> None:
        if self.case.pp > 1:  # a pipeline's stage ranks: no per-rank stream the reference has (no dropout there)
            return
        self.points.append((step, f"before_forward.{microbatch}", rng_fingerprint(torch.get_rng_state())))

    def after_forward(self, step: int, microbatch: int, output: torch.Tensor) -> None:
        if self.case.pp > 1:
            return
        self.points.append((step, f"after_forward.{microbatch}", rng_fingerprint(torch.get_rng_state())))

    def after_backward(self, step: int, microbatch: int) -> None:
        if self.case.step is None and self.case.pp == 1:  # the toolkit's own loop: one backward a micro-batch
            self.points.append((step, f"after_backward.{microbatch}", rng_fingerprint(torch.get_rng_state())))

    def to_gather(self):
        return self.points

    def gathered(self, per_rank) -> None:
        for i, (step, name, _) in enumerate(per_rank[0]):
            self.add(step, "rng", name, torch.tensor([points[i][2] for points in per_rank], dtype=torch.int64))
