"""Routed experts, their routing and expert parallelism (issue 40, docs/expert-parallel.md): an
idle expert's accumulated gradient dropped, tokens combined out of order, expert gradients
averaged over ep, a clip over one mesh, balancing and capacity decided per rank, a resume that
loads another ep rank's experts."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from fsdp_verify.engines.expert_parallel import ExpertParallel, apply_expert_parallel
from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.models.moe import moe_layers
from fsdp_verify.training.resume import Checkpointer
from fsdp_verify.zoo.mutants._shared import _local, _resuming
from fsdp_verify.zoo.pins import CHEAP, MICROBATCHES
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

# The grouped experts' routing and expert parallelism: four experts, one or two chosen a token.
_GROUPED = {**CHEAP, "model.experts": 4, "model.top_k": st.sampled_from((1, 2))}


@bug(
    "a routed expert no sample of a micro-batch reached drops the gradient earlier micro-batches accumulated",
    "issue 28: parameters that only some micro-batches use (MoE experts freeing idle gradients)",
    # The memory contract may see it first: after a drop the rank held more gradient bytes than
    # its shards allow (measured 64 B against 32 B at world size 2; FSDP2 allocates a new one).
    ("grads", "memory"),
    world_sizes=(1, 2, 3, 4),
    pins={**CHEAP, "model.experts": st.sampled_from((2, 3)), "microbatches": MICROBATCHES},
)
def idle_expert_grads_dropped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """A routed expert that no sample of a micro-batch reached on this rank has its gradient set
    to None after that forward (an "idle experts free their gradients" optimisation): what earlier
    micro-batches accumulated into its sharded gradient is dropped."""
    moe = getattr(model, "moe", None)
    fully_shard_engine(model, mesh, spec)
    if moe is None:
        return model
    sharded = [list(expert.parameters()) for expert in moe.experts]  # the DTensors the optimizer steps
    ran: set[int] = set()
    for e, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda _m, _a, _o, e=e: ran.add(e))

    def drop_idle(_module, _args, _out) -> None:
        for e, params in enumerate(sharded):
            if e not in ran:
                for p in params:
                    p.grad = None
        ran.clear()

    moe.register_forward_hook(drop_idle)
    return model


def _with_expert_parallel(style: type):
    """The built-in engine with another token dispatch than torchtitan's."""

    def engine(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
        if spec.case.ep > 1:
            mesh = apply_expert_parallel(model, mesh, style)
        kwargs = spec.fully_shard_kwargs(model, mesh)
        for fqn in spec.wrap:
            unit = spec.unit_modules(model, fqn)
            fully_shard(unit, **spec.unit_kwargs(unit, kwargs))
        spec.after_sharding(model)
        return model

    engine.__doc__ = style.__doc__
    return engine


class _CombinedOutOfOrder(ExpertParallel):
    """Sends the experts' outputs back in the order the ep rank computed them (expert by expert),
    not the order the rows came in: the regrouping after dispatch is never undone, so each rank
    adds other rows' outputs onto its samples (a token combine that forgets the unpermute)."""

    def combine(self, _module, out, mesh):
        from fsdp_verify.engines.expert_parallel import _AllToAll

        return _AllToAll.apply(out, self.in_splits, self.out_splits, mesh.get_group())


ep_tokens_combined_out_of_order = bug(
    "the experts' outputs sent back in the ep rank's order (expert by expert), not the order the tokens came in",
    "a token combine that forgets the unpermute after the all-to-all (issue 40)",
    ("logits",),
    world_sizes=(2, 4),
    pins={**_GROUPED, "ep": 2},
    name="ep_tokens_combined_out_of_order",
)(_with_expert_parallel(_CombinedOutOfOrder))


@bug(
    "the experts' gradients averaged over the ep group as if the experts were replicated there",
    "a DDP-style all-reduce over every rank holding 'the experts' beside expert parallelism (issue 40)",
    ("grads",),
    world_sizes=(2, 4),
    pins={**_GROUPED, "ep": 2},
)
def ep_expert_grads_averaged_over_ep(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Averages the experts' reduced gradients over the ep group too, as if the experts were
    replicated there like the dense parameters (a DDP-style all-reduce over every rank that holds
    "the experts"): each ep rank holds other experts, so their gradients are mixed and divided."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.ep == 1:
        return model
    from fsdp_verify.engines.expert_parallel import EP, grouped_experts

    group, ep = mesh[EP].get_group(), mesh[EP].size()

    def average(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)
        t.div_(ep)

    for _, experts in grouped_experts(model):
        experts.set_all_reduce_hook(average)
    return model


@bug(
    "every gradient clipped by the dense parameters' norm, the experts' (on their own mesh) left out",
    "a clip that keeps one mesh's parameters to get past DTensor's 'different meshes' error (issue 50)",
    ("grad_norm",),
    world_sizes=(2, 4),
    pins={**_GROUPED, "ep": 2, "clip_norm": 0.05},
)
def clip_norm_of_one_mesh(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips every gradient by the norm of the first mesh's gradients alone (the dense ones beside
    ep, the tp mesh's beside a plan that leaves parameters off it): the other mesh's left out of
    it (a clip that keeps the parameters of one mesh to get past DTensor's "different meshes"
    error, and scales the rest by that norm)."""
    fully_shard_engine(model, mesh, spec)
    if spec.case.ep == 1 and spec.case.tp == 1:
        return model
    from fsdp_verify.engines.view import EngineView, by_mesh

    class DenseNormClip(EngineView):
        def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
            groups = by_mesh([p for p in self.parameters().values() if p.grad is not None])
            norm = torch.nn.utils.get_total_norm([p.grad for p in groups[0]]).full_tensor()
            for params in groups:
                torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
            return norm

    model.verify_view = lambda: DenseNormClip(model)
    return model


@bug(
    "the load-balancing loss from each rank's own assignment counts, not the global micro-batch's",
    "a per-rank mean of the auxiliary loss where the recipe balances the global batch (issue 40)",
    ("grads", "comm"),  # the counts' all-reduce it leaves out, where the contract holds
    pins={**_GROUPED, "model.aux_loss": st.sampled_from((0.1, 0.5)), "grad_reduction": "avg"},
)
def aux_loss_per_rank(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The load-balancing loss from each rank's own assignment counts, not the global
    micro-batch's: every rank balances its own samples (a per-rank mean of the aux loss)."""
    for moe in moe_layers(model):
        moe.global_counts = lambda counts: counts
    return fully_shard_engine(model, mesh, spec)


@bug(
    "only rank 0 moves the router bias after a step; the other ranks keep theirs",
    "aux-loss-free balancing updated under `if rank == 0` without a broadcast (issue 40)",
    ("buffers",),
    pins={**_GROUPED, "model.router_bias": st.sampled_from((0.01, 0.05)), "activation_checkpointing": False},
)
def router_bias_updated_on_rank0_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Only rank 0 moves the router bias after a step (an update guarded by `if rank == 0`, the
    broadcast forgotten); the others count, all-reduce and reset like it, and keep their bias."""
    if dist.get_rank() != 0:
        for moe in moe_layers(model):
            moe.update_router_bias = functools.partial(_count_and_reset, moe)
    return fully_shard_engine(model, mesh, spec)


@torch.no_grad()
def _count_and_reset(moe) -> None:
    if not moe.router_bias:
        return
    moe.global_counts(moe.tokens_per_expert)  # the same collective as the others issue
    moe.tokens_per_expert.zero_()


@bug(
    "rank 1 keeps each expert's highest-scoring assignments under capacity, the others their first",
    "capacity dropping decided by different rules on different ranks (issue 40)",
    ("logits", "grads"),
    pins={**_GROUPED, "model.capacity_factor": 0.5},
)
def capacity_drops_differ_on_rank1(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Rank 1 keeps each expert's highest-scoring assignments under capacity, the others its
    first in token order (a priority-dropping code path switched on one rank only): the ranks
    drop by different rules."""
    if dist.get_rank() == 1:
        for moe in moe_layers(model):
            moe.keep = functools.partial(_keep_by_score, moe)
    return fully_shard_engine(model, mesh, spec)


def _keep_by_score(moe, order, flat, counts, limit, probs):
    score = probs[order // moe.top_k, flat[order]]
    kept, start = [], 0
    for count in counts.tolist():
        block, scores = order[start : start + count], score[start : start + count]
        kept.append(block[torch.argsort(scores, descending=True, stable=True)[:limit]].sort().values)
        start += count
    return torch.cat(kept)


class _ExpertsInAnotherEpRanksSlots(Checkpointer):
    """Loads everything, then each ep rank's experts (their weights and optimizer state) are the
    ones the next ep rank holds: a loop that saved each rank's local experts under their local
    index (expert 0 of every ep rank one key, no global offset) and reads them back on another
    layout. Same shapes, so nothing complains; every rank computes with another rank's experts."""

    def after_load(self, optimizer, trainer):
        from fsdp_verify.engines.expert_parallel import EP, grouped_experts

        for _, experts in grouped_experts(self.module):
            for p in experts.parameters():
                if not isinstance(p, DTensor) or EP not in (p.device_mesh.mesh_dim_names or ()):
                    continue  # ep 1: every rank holds every expert, no other ep rank's slots
                group = p.device_mesh.get_group(EP)
                for t in [p, *(v for v in optimizer.state.get(p, {}).values() if isinstance(v, DTensor))]:
                    _rotate(_local(t), group)
        return trainer


@torch.no_grad()
def _rotate(local: torch.Tensor, group) -> None:
    """`local` replaced by the next rank's of `group` (a collective)."""
    pieces = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, local.contiguous(), group=group)
    local.copy_(pieces[(dist.get_rank(group) + 1) % len(pieces)])


ep_experts_loaded_into_another_ep_rank = bug(
    "after a resume each ep rank holds the experts (and their optimizer state) of the next ep rank",
    "local experts saved under their local index and read back on another ep layout (issue 40)",
    ("resumed",),
    world_sizes=(2, 4),
    pins={**_GROUPED, "resume": True, "ep": 2, "resume_ep": st.sampled_from((2, 4))},
    name="ep_experts_loaded_into_another_ep_rank",
)(_resuming(_ExpertsInAnotherEpRanksSlots))
