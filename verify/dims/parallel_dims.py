"""One owner of the degrees and the mesh, after torchtitan's `ParallelDims`.

A case's ranks are one world mesh, outermost first: the pipeline's stages ("pp"), the
data-parallel mesh ((shard,) or (replicate, shard)), then tensor parallelism ("tp"); expert
parallelism unflattens the shard dim into ("efsdp", "ep") (verify/engines/expert_parallel.py).
Everything that needs a degree, the data-parallel size, a rank's coordinates or the mesh asks
this object, so that the arithmetic (which dim is outer, which rank is whose replica) is written
once and is the mesh `init_device_mesh` builds: a rank's coordinates are its index in
`arange(world).view(shape)`, row-major.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

PP, TP, REPLICATE, SHARD = "pp", "tp", "replicate", "shard"


@dataclass(frozen=True)
class Coords:
    """Where a rank sits: its stage, its data-parallel rank (its index in the data-parallel mesh,
    replicate-major) and its tp rank."""

    stage: int
    dp_rank: int
    tp_rank: int


@dataclass(frozen=True)
class ParallelDims:
    """The degrees of a world of `world_size` ranks: `dp` the data-parallel mesh, (shard,) or
    (replicate, shard); `pp` stages, `tp` ranks of a tensor-parallel group; `ep` ranks of an
    expert group, inside the shard dim. Build with `of(case)`, `over(...)` or directly; frozen and
    hashable, so that it keys the meshes a worker keeps (verify/sharded/worker.py)."""

    world_size: int
    dp: tuple[int, ...]
    pp: int = 1
    tp: int = 1
    ep: int = 1

    @classmethod
    def of(cls, case) -> ParallelDims:
        """The case's degrees; the data-parallel mesh is `mesh_shape`, or else one dim of every
        rank the stages and tp leave."""
        pp, tp, ep = (_degree(getattr(case, n, 1)) for n in (PP, TP, "ep"))
        return cls(case.world_size, tuple(case.mesh), pp, tp, ep)

    @classmethod
    def over(cls, dp: tuple[int, ...], pp=1, tp=1, ep=1) -> ParallelDims:
        """The world these degrees make: the data-parallel mesh `dp` times the stages and tp (a
        degree that is not a positive int counts as 1, for the Case's validation to name)."""
        pp, tp, ep = _degree(pp), _degree(tp), _degree(ep)
        return cls(math.prod(dp) * pp * tp, tuple(dp), pp, tp, ep)

    # ---- sizes ----------------------------------------------------------------------------
    @property
    def dp_size(self) -> int:
        """The data-parallel ranks: the ranks of one stage's tp-rank-0 slice, each taking its own
        part of the batch (the stages of one data-parallel rank and the ranks of a tp group share it)."""
        return math.prod(self.dp)

    @property
    def shape(self) -> tuple[int, ...]:
        """The world mesh's shape, outermost first: (pp?, *dp, tp?), a dim of 1 left out for pp and tp."""
        return ((self.pp,) if self.pp > 1 else ()) + self.dp + ((self.tp,) if self.tp > 1 else ())

    @property
    def names(self) -> tuple[str, ...]:
        dp = (SHARD,) if len(self.dp) == 1 else (REPLICATE, SHARD)
        return ((PP,) if self.pp > 1 else ()) + dp + ((TP,) if self.tp > 1 else ())

    @property
    def dividing(self) -> tuple[tuple[str, int], ...]:
        """The degrees that divide the world into data-parallel ranks, outermost first, those above 1."""
        return tuple((n, d) for n, d in ((PP, self.pp), (TP, self.tp)) if d > 1)

    # ---- a rank's place -------------------------------------------------------------------
    def coords(self, rank: int) -> Coords:
        """`rank`'s stage, data-parallel rank and tp rank: its index in the world mesh, row-major."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a world of {self.world_size}")
        tp_rank, rest = rank % self.tp, rank // self.tp
        return Coords(stage=rest // self.dp_size, dp_rank=rest % self.dp_size, tp_rank=tp_rank)

    def dp_rank(self, rank: int) -> int:
        return self.coords(rank).dp_rank

    def rank_of(self, stage: int = 0, dp_rank: int = 0, tp_rank: int = 0) -> int:
        """The rank at those coordinates (`coords`' inverse)."""
        return (stage * self.dp_size + dp_rank) * self.tp + tp_rank

    def describe(self) -> str:
        """ "pp 2 x data-parallel 2 x tp 2": how the world is made up, outermost first."""
        parts = [f"pp {self.pp}"] if self.pp > 1 else []
        parts += [f"data-parallel {self.dp_size}"] + ([f"tp {self.tp}"] if self.tp > 1 else [])
        return " x ".join(parts) + (f"; ep {self.ep}" if self.ep > 1 else "")

    # ---- the mesh -------------------------------------------------------------------------
    def build(self, device_type: str, plain: DeviceMesh | None = None) -> DeviceMesh:
        """The world mesh, named `names`; under ep the shard dim of `plain` (this mesh without ep,
        which the caller keeps so that its groups are made once) unflattened into ("efsdp", "ep")."""
        if self.ep > 1:
            from fsdp_verify.engines.expert_parallel import expert_mesh

            return expert_mesh(plain if plain is not None else replace(self, ep=1).build(device_type), self.ep)
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, self.shape, mesh_dim_names=self.names)


def _degree(value) -> int:
    """A degree as a positive int; anything else counts as 1 here (the Case's validation names it)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 1 else 1
