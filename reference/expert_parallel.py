"""The reference's expert parallelism and grouped-experts routing: what `ep` and the routing's
global counts change in the arithmetic, kept out of the FSDP emulation (reference/trainer.py
calls in here at three points; docs/expert-parallel.md).

The reference computes every expert on one device, each emulated rank's pass on its own samples
with the same routing and the same dropped tokens as that rank (`GroupedMoE` decides both on the
rank that routes). What expert parallelism changes is where an expert's gradient is added up:

- On an ep rank, an expert's weight and bias gradients are the sum of the ep group's chunks, in
  source-rank order (`GroupedLinear`'s backward; each chunk the same F.linear backward on the same
  rows as the source rank's own pass here): `ep_sums` adds each rank's gradient of each expert in
  that order, in the parameters' dtype, and hands every rank the sums of the experts it holds.
- The experts' unit is reduced by FSDP2 over the ranks the ep dim leaves, (replicate, efsdp),
  with the sum forced and one division by the data-parallel world size
  (verify/engines/expert_parallel.py): `average` runs FSDP2's own emulation (trainer's
  `hsdp_average`) over that smaller mesh, one ep index at a time, and puts the experts back in
  order; the dense parameters take the plain path.

With the routing's load-balancing loss the counts are the global micro-batch's (`GroupedMoE.
global_counts`): `global_routing` routes every emulated rank's samples first (a forward without
gradient, each rank's dropout generator left as it was), and the micro-batch's passes read the sum.
"""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch
from torch.func import functional_call

from fsdp_verify.engines.expert_parallel import experts_of
from fsdp_verify.models.custom import logits_of
from fsdp_verify.models.moe import GroupedMoE, moe_layers
from fsdp_verify.training.data import as_call, take


def expert_names(case, names) -> list[str]:
    """The grouped experts' parameters among `names` (the built-in MLP's `moe.experts`, or a
    model's own grouped experts modules: verify/engines/expert_parallel.py `experts_of`)."""
    modules = tuple(f"{fqn}." for fqn in experts_of(case.model))
    return [n for n in names if n.startswith(modules)] if modules else []


def _experts(case, name: str) -> int:
    """How many experts parameter `name` holds (its module's count)."""
    return next(n for fqn, n in experts_of(case.model).items() if name.startswith(f"{fqn}."))


def ep_groups(case) -> list[list[int]]:
    """Each ep group's global ranks, in ep-index order."""
    replicas, shards, ep, groups = _layout(case)
    return [[_rank(r, g, j, shards, ep) for j in range(ep)] for r in range(replicas) for g in range(groups)]


def _layout(case) -> tuple[int, int, int, int]:
    """(replicas R, shard group S, ep E, S / E) of the case's mesh."""
    replicas, shards = case.mesh if len(case.mesh) == 2 else (1, case.mesh[0])
    return replicas, shards, case.ep, shards // case.ep


def _rank(replica: int, group: int, j: int, shards: int, ep: int) -> int:
    """Global rank of ep index j in ep group `group` of replica `replica`."""
    return replica * shards + group * ep + j


def ep_sums(
    case, rank_grads: list[dict[str, torch.Tensor]], held: set[str] = frozenset()
) -> list[dict[str, torch.Tensor]]:
    """Each rank's expert gradients as its ep rank holds them after backward: for the experts it
    holds, the sum of its ep group's gradients in source-rank order (the first, then `+` each
    next, in their dtype); zeros for the others (another ep rank holds them). `held`: parameters
    already laid out so (a grouped GEMM's: reference/grouped_gemm.py)."""
    names = [n for n in expert_names(case, rank_grads[0]) if n not in held]
    if case.ep == 1 or not names:
        return rank_grads
    ep = case.ep
    out = [dict(g) for g in rank_grads]
    for members in ep_groups(case):
        for n in names:
            local = _experts(case, n) // ep
            for j, holder in enumerate(members):
                block = torch.zeros_like(rank_grads[holder][n])
                for e in range(j * local, (j + 1) * local):
                    total = rank_grads[members[0]][n][e]
                    for source in members[1:]:
                        total = total + rank_grads[source][n][e]
                    block[e] = total
                out[holder][n] = block
    return out


def ep_average(
    rank_grads: list[dict[str, torch.Tensor]],
    case,
    reduce_dtype: torch.dtype,
    divide: tuple[float, float],
    hsdp_average,
    partial: dict | None = None,
    all_reduce: bool = True,
) -> dict[str, torch.Tensor]:
    """FSDP2's reduction of every parameter under expert parallelism: the dense ones over the
    whole data-parallel mesh (`hsdp_average`, reference/reduction.py, as without ep), the
    experts (each rank's `ep_sums`) over (replicate, efsdp) for each ep index, summed in both
    collectives and divided once by the `divide` factors of the whole data-parallel world
    (verify/engines/expert_parallel.py), where the dense units average in each collective."""
    names = expert_names(case, rank_grads[0])
    dense = [{n: g for n, g in grads.items() if n not in names} for grads in rank_grads]
    out = hsdp_average(dense, case, reduce_dtype, divide, partial, all_reduce) if dense[0] else {}
    if not names:
        return out
    replicas, shards, ep, groups = _layout(case)
    if groups == 1 and divide[0] == 1 and divide[1] != 1:
        # A reduce-scatter group of one: no collective to force a sum for; FSDP2 divides the
        # copy by the factor at once, then sums over the replicas (verify/engines/expert_parallel.py).
        divide = (divide[1], 1.0)
    # Each grouped experts module's parameters reduced together (its own unit, or, with torchtitan's
    # per-parameter meshes, its block's collective over the experts' mesh).
    smaller = SimpleNamespace(
        mesh=(replicas, groups),
        world_size=replicas * groups,
        wrap_plan=(*experts_of(case.model), ""),
        shard_placement="dim0",
    )
    local = {n: _experts(case, n) // ep for n in names}
    pieces: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    for j in range(ep):
        held = [
            {n: rank_grads[_rank(r, i, j, shards, ep)][n][j * local[n] : (j + 1) * local[n]] for n in names}
            for r in range(replicas)
            for i in range(groups)
        ]
        kept = None if partial is None else partial.setdefault(f"ep{j}", {})
        reduced = hsdp_average(held, smaller, reduce_dtype, divide, kept, all_reduce, staged=False)
        for n in reduced:
            pieces[n].append(reduced[n])
    out.update({n: torch.cat(p) for n, p in pieces.items() if p})
    return out


def ep_norm(case, named: list[tuple[str, torch.Tensor]], dense_norm) -> torch.Tensor:
    """A clip's norm as the ranks clip under expert parallelism (`EngineView.clip_grad_norm_`,
    torchtitan's `_clip_grad_norm_with_ep`): the experts' gradients and the dense ones live on
    two meshes, so each group's total norm is taken whole, and the total is the root of their
    squares' sum; the dense group's is FSDP2's over the shards (`dense_norm` of those (name,
    gradient) pairs). An expert gradient is `Shard(0)` over "ep" (block j of the experts on ep
    rank j) and, inside its block, over "efsdp" (FSDP2's chunk g). On each rank the norms of its
    local pieces, stacked, are made whole by DTensor one mesh dim after the other, "efsdp" first,
    then "ep" (measured on torch 2.13 with `_NormPartial` on a (2, 2) mesh: 300 of 300 values, a
    flat sum over the four ranks 235), each as a vector all-reduce of the squares and the roots
    (`squared_norms_reduced`); the experts' total is the norm of the result. Bit-exact at ep 2 and
    4, on 1-D meshes and HSDP, fp32 and bf16 (tests/test_expert_parallel.py)."""
    from fsdp_verify.engines.arithmetic import squared_norms_reduced

    _, _, ep, groups = _layout(case)
    experts = set(expert_names(case, [n for n, _ in named]))
    mine = [g for n, g in named if n in experts]
    zero = torch.zeros((), dtype=torch.float32)
    experts_total = zero
    if mine:
        per_ep = []
        for j in range(ep):
            local = []  # each efsdp rank's norms of its pieces of ep block j
            for k in range(groups):
                norms = []
                for g in mine:
                    chunks = g.chunk(ep, dim=0)[j].chunk(groups, dim=0)
                    norms.append(chunks[k].contiguous().norm() if k < len(chunks) else zero.to(g.dtype))
                local.append(torch.stack(norms))
            per_ep.append(squared_norms_reduced(local).sqrt())  # over "efsdp"
        experts_total = torch.linalg.vector_norm(squared_norms_reduced(per_ep).sqrt())  # then over "ep"
    dense = [(n, g) for n, g in named if n not in experts]
    dense_total = dense_norm(dense).float() if dense else zero
    return (experts_total**2 + dense_total**2) ** (1.0 / 2)


@contextlib.contextmanager
def global_routing(run, state, group: list):
    """Around one micro-batch's passes: each aux-loss MoE layer's counts summed over every
    emulated rank's samples, as the ranks all-reduce them in their forward (exact: integers).
    Routed here first by a forward without gradient per rank, from that rank's dropout state (not
    kept: its pass starts from it again), the layers' assignment counts put back after."""
    layers = [m for m in moe_layers(run.model) if m.aux_loss]
    if not layers:
        yield
        return
    totals = {id(m): torch.zeros(m.n, dtype=torch.long) for m in layers}
    counted = {id(m): m.tokens_per_expert.clone() for m in layers if m.router_bias}

    def capture(module: GroupedMoE, args):
        totals[id(module)] += module.route(args[0])[2]

    hooks = [m.register_forward_pre_hook(capture) for m in layers]
    try:
        for r, index in enumerate(group):
            torch.set_rng_state(run.rng_states[r])
            args, kwargs = as_call(take(state.inputs, index))
            with torch.no_grad():
                logits_of(run.case.model, functional_call(run.model, state.compute, args, kwargs))
    finally:
        for h in hooks:
            h.remove()
        for m in layers:
            if m.router_bias:
                m.tokens_per_expert.copy_(counted[id(m)])
    for m in layers:
        m.global_counts = _fixed(totals[id(m)])
    try:
        yield
    finally:
        for m in layers:
            del m.global_counts


def _fixed(total: torch.Tensor):
    """A layer's `global_counts` for one micro-batch: the sum over every emulated rank."""
    return lambda _counts: total


def update_router_biases(model) -> None:
    """After the optimizer step, as the loop does: each layer's bias moved by the step's counts,
    which the reference's one model counted over every emulated rank's samples."""
    for m in moe_layers(model):
        m.update_router_bias()
