"""The reference, split over the ranks of a run in place that share a host (under torchrun).

In place, rank 0 ran the whole reference while the other ranks waited: on bench/overhead.py's
medium Transformer its per-rank forward and backward passes are most of the verification's cost
over bare training. Here process p runs the emulated ranks r with r % P == p; after each
micro-batch the processes exchange what their ranks' passes gave (gradients, logits, loss, RNG
fingerprints) through their arenas on the shared host (verify/sharded/arena.py), and every
process then averages, clips and steps alike, in the reference's own order, so rank 0's trace is
the one a single process records, bit for bit (tests/test_shared_reference.py): each pass is
the same arithmetic on the same inputs in a process of the same thread count.

One thing a split cannot reproduce: buffers a forward changes (a running mean). A single process
runs every rank's forward on one model, so each forward sees the others' updates; split, each
process sees only its own. A process whose buffers moved says so in the exchange, and every
process raises `SplitUnsafe`; the caller then runs the reference whole. So does a process that
could not write its passes (a full memory directory).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from fsdp_verify.reference.records import RankPass
from fsdp_verify.sharded.arena import Fill, arena


class SplitUnsafe(RuntimeError):
    """A forward changed the model's buffers, or a process could not write its passes: the
    reference must run whole, in one process."""


class SharedReference:
    """This process's part of a split reference run: a `RankShare` (reference/records.py)."""

    def __init__(self, rank: int, world_size: int, directory: str, group: dist.ProcessGroup | None = None):
        """`rank` and `world_size` within `group`: the processes on one host (default: all)."""
        self.rank, self.world_size, self.directory, self.group = rank, world_size, directory, group
        self._buffers: list[torch.Tensor] | None = None  # the model's buffers as built

    def mine(self, r: int) -> bool:
        return r % self.world_size == self.rank

    def begin(self, model: nn.Module) -> None:
        self._buffers = [b.detach().clone() for b in model.buffers()]  # as built, before any forward

    def exchange(self, passes: dict[int, RankPass], model: nn.Module) -> dict[int, RankPass]:
        """Every emulated rank's pass (a collective of all processes): this process's through
        its arena, the others' read from theirs."""
        assert self._buffers is not None, "begin(model) first"
        moved = any(not torch.equal(a, b.detach()) for a, b in zip(self._buffers, model.buffers()))
        mine = arena(self.directory, f"reference-{self.rank}").begin()
        written = True
        try:
            for r, done in passes.items():
                for name, g in done.grads.items():
                    mine.add((r, "grads", name), g)
                mine.add((r, "logits", "logits"), done.logits)
                mine.add((r, "loss", "loss"), done.loss)
                mine.add(
                    (r, "rng", "rng"),
                    torch.tensor([done.rng_before, done.rng_after, done.rng_after_backward], dtype=torch.int64),
                )
        except OSError:  # a full memory directory: said in the exchange, never a rank stuck in it
            written = False
        header = mine.header("reference", {"ranks": sorted(passes), "moved": moved, "written": written})
        headers: list = [None] * self.world_size
        dist.all_gather_object(headers, header, group=self.group)  # also: every arena is written
        if any(h["meta"]["moved"] for h in headers):
            raise SplitUnsafe("a forward changed the model's buffers")
        if not all(h["meta"]["written"] for h in headers):
            raise SplitUnsafe("a rank could not write its passes to the memory directory")
        every = dict(passes)
        for p, theirs in enumerate(headers):
            if p == self.rank:
                continue
            fill = Fill(theirs)
            try:
                for r in theirs["meta"]["ranks"]:
                    grads = {key[2]: fill.read(key) for key in fill.entries if key[:2] == (r, "grads")}
                    rng = fill.read((r, "rng", "rng")).tolist()
                    every[r] = RankPass(grads, fill.read((r, "logits", "logits")), fill.read((r, "loss", "loss")), *rng)
            finally:
                fill.close()
        dist.barrier(group=self.group)  # every process has read every arena: the next exchange may rewrite them
        return every
