"""A zoom's records of a grouped experts module (verify/models/moe.py), expert by expert, so that a
parting names the expert (docs/zoom.md).

Under expert parallelism the module a rank runs is not the reference's: its inputs, after the
all-to-all, are the rows every rank of its ep group routed to the experts it holds (expert by
expert, sources in rank order: `counts` is (experts held, ep)), and its output, after the
combine, is the rank's own rows back in the order they came. The reference computes every expert
on each emulated rank's own rows (`counts` (experts, 1)). Each value is cut into the chunks both
sides have: an input (and its gradient) into one chunk per (expert, source rank), recorded under
the source rank's pass, whichever rank computed it; an output (and its gradient) into one chunk
per expert of the rank's own rows, by the counts it routed (taken before the dispatch, by a
pre-hook the probe registers ahead of the engine's). Without ep the same cuts hold with one
source, so the records are named alike on both sides."""

from __future__ import annotations

import torch
from torch import nn


class ExpertRows:
    """Where a grouped experts module's rows lie: its first expert and the global ranks whose rows
    it receives (None: the pass's own rank only)."""

    def __init__(self, first: int = 0, sources: list[int] | None = None):
        self.first, self.sources = first, sources
        self.own: dict[int, list[int]] = {}  # call -> rows per expert of the rank's own, as routed
        self.received: dict[int, list[list[int]]] = {}  # call -> rows per (expert held, source)

    @classmethod
    def of(cls, module: nn.Module) -> ExpertRows:
        """As the engine left `module`: under ep its parameters are DTensors on the ep mesh, the
        ep rank holding experts `index * held ...`, its group's ranks the sources."""
        from torch.distributed.tensor import DTensor

        weight = module.weight
        if not isinstance(weight, DTensor):
            return cls()
        import torch.distributed as dist

        from fsdp_verify.engines.expert_parallel import EP

        mesh = weight.device_mesh  # (efsdp, ep) or (replicate, efsdp, ep) once FSDP2 shards it
        if EP not in (mesh.mesh_dim_names or ()):
            return cls()
        ep = mesh[EP]
        return cls(ep.get_local_rank() * (module.n // ep.size()), dist.get_process_group_ranks(ep.get_group()))

    def routed(self, call: int, counts: torch.Tensor) -> None:
        """The counts the module is called with, before any dispatch: the rank's own rows per expert."""
        self.own[call] = counts.reshape(-1).tolist()

    def dispatched(self, call: int, counts: torch.Tensor) -> None:
        """The counts the module computes with (after the dispatch under ep)."""
        self.received[call] = [list(row) for row in counts.tolist()]

    def inputs(self, call: int, rows: torch.Tensor, own_rank: int) -> list[tuple[int, int, torch.Tensor]]:
        """(source rank, expert, chunk) of the rows the module computed, or of their gradient."""
        out, start = [], 0
        for e, per_source in enumerate(self.received.get(call, [])):
            for s, n in enumerate(per_source):
                source = self.sources[s] if self.sources is not None else own_rank
                if n:
                    out.append((source, self.first + e, rows[start : start + n]))
                start += n
        return out

    def outputs(self, call: int, rows: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(expert, chunk) of the rank's own rows, as the module hands them on, or their gradient."""
        out, start = [], 0
        for e, n in enumerate(self.own.get(call, [])):
            if n:
                out.append((e, rows[start : start + n]))
            start += n
        return out


def grouped_experts(model: nn.Module) -> dict[str, nn.Module]:
    from fsdp_verify.models.moe import GroupedExperts

    return {fqn: m for fqn, m in model.named_modules() if isinstance(m, GroupedExperts)}
