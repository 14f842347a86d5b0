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
    """Under pipeline parallelism a rank may hold only its stages' buffers (torchtitan's split
    deletes the other stages' modules): each rank then sends its buffers with their hashes, and
    rank 0 records those it lacks from the first rank that holds them; a rank that holds none
    of a buffer is left out of its comparison (hash "")."""

    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        self.module = model
        self.hashes: dict[str, dict[str, str]] = {}  # this rank's, by step; gathered at the end
        self.kept: dict[str, dict[str, torch.Tensor]] = {}  # under pp: this rank's buffers, by step
        self._record(0)

    def after_step(self, step: int) -> None:
        self._record(step)

    def _record(self, step: int) -> None:
        buffers = {name: _whole(b) for name, b in module_names.named_buffers(self.module)}
        for name, b in buffers.items():
            self.add(step, "buffers", name, b)
        self.hashes[str(step)] = {name: tensor_hash(b) for name, b in buffers.items()}
        if self.case.pp > 1 and self.rank != 0:
            self.kept[str(step)] = {name: b.detach().cpu().clone() for name, b in buffers.items()}

    def to_gather(self):
        return getattr(self, "hashes", {}), getattr(self, "kept", {})

    def gathered(self, per_rank):
        hashes = [h for h, _ in per_rank]
        steps = {step: sorted({n for h in hashes for n in h.get(step, {})}) for step in hashes[self.rank]}
        for step, names in steps.items():
            for name in names:
                if name not in hashes[self.rank][step]:  # another stage's: from the first rank holding it
                    holder = next(kept for h, kept in per_rank if name in h.get(step, {}))
                    self.add(int(step), "buffers", name, holder[step][name])
        self.meta(
            "buffer_hashes",
            {
                step: {name: [h.get(step, {}).get(name, "") for h in hashes] for name in names}
                for step, names in steps.items()
            },
        )
