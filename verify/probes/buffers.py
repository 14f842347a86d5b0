"""Buffers probe: every buffer of the sharded module (RoPE frequencies, norm statistics) at step 0
and after each step. Rank 0's copy goes into the trace (phase "buffers", compared exactly with the
reference's); every rank's hash of each buffer goes into trace.meta["buffer_hashes"], so the
check can name a rank whose copy differs (buffers are replicated, never synchronised by FSDP)."""

from __future__ import annotations

import hashlib

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_verify import module_names
from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe
from fsdp_verify.sharded.gather import full_quietly


def tensor_hash(t: torch.Tensor) -> str:
    data = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(data.numpy().tobytes()).hexdigest()[:16]


def _whole(t: torch.Tensor) -> torch.Tensor:
    """A DTensor buffer whole, on every rank (torchtitan's tp keeps RoPE's cache as one,
    replicated over the tp ranks: its local tensor, no collective)."""
    return full_quietly(t) if isinstance(t, DTensor) else t


class BuffersProbe(Probe):
    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        self.module = model
        self.hashes: dict[str, dict[str, str]] = {}  # this rank's, by step; gathered at the end
        self._record(0)

    def after_step(self, step: int) -> None:
        self._record(step)

    def _record(self, step: int) -> None:
        buffers = {name: _whole(b) for name, b in module_names.named_buffers(self.module)}
        for name, b in buffers.items():
            self.add(step, "buffers", name, b)
        self.hashes[str(step)] = {name: tensor_hash(b) for name, b in buffers.items()}

    def to_gather(self):
        return getattr(self, "hashes", {})

    def gathered(self, per_rank):
        mine = per_rank[self.rank]
        self.meta(
            "buffer_hashes",
            {
                step: {name: [h.get(step, {}).get(name, "") for h in per_rank] for name in names}
                for step, names in mine.items()
            },
        )
