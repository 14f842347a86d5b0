"""Grouped routed experts: the MoE layer that expert parallelism shards (docs/expert-parallel.md).

torchtitan's and DeepSeek's layout: one router (`gate`), every expert's weights in one
(experts, dim, dim) parameter (`GroupedExperts`), each sample sent to its `top_k` experts by the
router's scores, the assignments sorted by expert and run as one call of the grouped experts,
whose outputs are weighted by the router's probabilities and added back onto the samples (a
residual, as the per-expert loop in `mlp.py` does). Optional, as a MoE trainer has them:

- capacity: each expert takes at most ceil(capacity_factor * tokens * top_k / experts) of a
  rank's assignments, the first in token order; the rest are dropped (the sample keeps its
  residual). Decided on the rank that routes, before any dispatch: every rank drops alike.
- a load-balancing auxiliary loss (Switch/GShard's `experts * sum_e f_e * P_e`), with `f_e` the
  fraction of the *global* micro-batch's assignments routed to expert e (the counts summed over
  the data-parallel ranks, `global_counts`) and `P_e` this rank's mean router probability; its
  gradient, `aux_loss` times that, is added in backward as DeepSeek's `AddAuxiliaryLoss` does
  (whatever the main loss is scaled by), so the ranks' average is the global batch's.
- aux-loss-free balancing (DeepSeek-V3): a router bias added to the scores for the choice only,
  moved after every optimizer step by `router_bias * sign(mean count - count)` over the step's
  assignments summed over the ranks (`update_router_bias`).

The experts compute each (expert, source) chunk of their input as its own `F.linear`
(`GroupedLinear`): without expert parallelism there is one source, the rank itself; with it
(verify/engines/expert_parallel.py) the chunks are the tokens each rank of the ep group sent,
in rank order, so every token meets the same kernel on the same rows as on one device, and an
expert's weight gradient is the sum of the chunks' in source order, which the reference adds the
same way (reference/expert_parallel.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from fsdp_verify.models.layers import Linear


def _own(t: torch.Tensor) -> torch.Tensor:
    """`t` in a buffer of its own. A CPU matmul's (and a sum's) rounding depends on where its
    operands start in memory (measured on torch 2.13: the same chunk at another offset of its
    tensor gave logits 6e-8 apart at dim 33), and a chunk sits at one offset on the rank that
    routed it and at another on the ep rank that computes it: copied, it starts alike on both."""
    return t.clone(memory_format=torch.contiguous_format)


class GroupedLinear(torch.autograd.Function):
    """`F.linear` of each chunk with its expert's weight and bias, each operand in a buffer of its
    own (`_own`). `counts[e][s]`: rows of expert e from source s, laid out expert by expert,
    sources in order within each. Backward: each chunk's input gradient as F.linear's; an
    expert's weight and bias gradients the chunks' in source order (first chunk, then `+` each
    next), in the parameters' dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias, counts: list[list[int]]):
        ctx.save_for_backward(x, weight)
        ctx.counts = counts
        out = x.new_empty((x.shape[0], weight.shape[1]))
        start = 0
        for e, per_source in enumerate(counts):
            w, b = _own(weight[e]), _own(bias[e])
            for n in per_source:
                out[start : start + n] = F.linear(_own(x[start : start + n]), w, b)
                start += n
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        grad_x = torch.empty_like(x) if need_x else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros((weight.shape[0], weight.shape[1]), dtype=weight.dtype) if need_b else None
        start = 0
        for e, per_source in enumerate(ctx.counts):
            w = _own(weight[e])
            for s, n in enumerate(per_source):
                dy, xs = _own(grad_out[start : start + n]), _own(x[start : start + n])
                if grad_x is not None:
                    grad_x[start : start + n] = dy @ w
                if grad_w is not None:
                    chunk = dy.t() @ xs
                    grad_w[e] = chunk if s == 0 else grad_w[e] + chunk
                if grad_b is not None:
                    chunk = dy.sum(0)
                    grad_b[e] = chunk if s == 0 else grad_b[e] + chunk
                start += n
        return grad_x, grad_w, grad_b, None


class GroupedExperts(nn.Module):
    """`n` experts, a Linear(dim, dim) each, as one (n, dim, dim) weight and one (n, dim) bias.
    `forward(x, counts)`: `counts` (experts held, sources), x's rows laid out as `GroupedLinear`
    takes them. Under expert parallelism the parameters are DTensors sharded over the ep mesh
    (Shard(0)): each rank computes with its own experts (`to_local`)."""

    def __init__(self, n: int, dim: int):
        super().__init__()
        self.n = n
        self.weight = nn.Parameter(torch.empty(n, dim, dim))
        self.bias = nn.Parameter(torch.empty(n, dim))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        weight, bias = self.weight, self.bias
        if isinstance(weight, DTensor):
            weight, bias = weight.to_local(), bias.to_local()
        return GroupedLinear.apply(x.to(weight.dtype), weight, bias, counts.tolist())


class AddAuxiliaryLoss(torch.autograd.Function):
    """Identity on `x` (a copy: an input returned as is would be a view, which FSDP2 warns of as
    a unit's output); in backward, the auxiliary loss gets gradient `scale` (DeepSeek's)."""

    @staticmethod
    def forward(ctx, x, loss, scale: float):
        ctx.shape, ctx.dtype, ctx.scale = loss.shape, loss.dtype, scale
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full(ctx.shape, ctx.scale, dtype=ctx.dtype), None


class GroupedMoE(nn.Module):
    def __init__(
        self,
        dim: int,
        n: int,
        top_k: int,
        capacity_factor: float | None = None,
        aux_loss: float = 0.0,
        router_bias: float = 0.0,
    ):
        super().__init__()
        self.n, self.top_k, self.capacity_factor = n, top_k, capacity_factor
        self.aux_loss, self.router_bias = aux_loss, router_bias
        self.gate = Linear(dim, n)
        self.experts = GroupedExperts(n, dim)
        if router_bias:
            self.register_buffer("expert_bias", torch.zeros(n))
            # assignments routed to each expert since the last update (floats: exact integers)
            self.register_buffer("tokens_per_expert", torch.zeros(n))
        # The data-parallel ranks the aux loss and the bias count over (the training loop sets
        # it, as a trainer builds its MoE with its data-parallel group); None: this process only.
        self.count_group: dist.ProcessGroup | None = None

    def global_counts(self, counts: torch.Tensor) -> torch.Tensor:
        """`counts` summed over the data-parallel ranks (`count_group`)."""
        if self.count_group is None or dist.get_world_size(self.count_group) == 1:
            return counts
        total = counts.clone()
        dist.all_reduce(total, group=self.count_group)
        return total

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities (T, n) fp32, chosen experts (T, k), assignments per expert (n,))."""
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        scores = probs + self.expert_bias if self.router_bias else probs
        chosen = torch.topk(scores.detach(), self.top_k, dim=-1).indices
        counts = torch.bincount(chosen.reshape(-1), minlength=self.n)
        return probs, chosen, counts

    def capacity(self, tokens: int) -> int | None:
        if self.capacity_factor is None:
            return None
        return math.ceil(self.capacity_factor * tokens * self.top_k / self.n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs, chosen, counts = self.route(x)
        if self.router_bias:
            with torch.no_grad():
                self.tokens_per_expert += counts.float()
        # Assignments (token t, slot j) -> t * k + j, grouped by expert, in token order.
        flat = chosen.reshape(-1)
        order = torch.argsort(flat, stable=True)
        kept = counts
        limit = self.capacity(x.shape[0])
        if limit is not None:
            order = self.keep(order, flat, counts, limit, probs)
            kept = counts.clamp(max=limit)
        tokens = order // self.top_k
        weights = probs[tokens, flat[order]].unsqueeze(1)
        routed = self.experts(x[tokens], kept.view(-1, 1))
        out = x.index_add(0, tokens, (routed * weights.to(routed.dtype)).to(x.dtype))
        if self.aux_loss:
            out = AddAuxiliaryLoss.apply(out, self.balance_loss(probs, counts), self.aux_loss)
        return out

    def keep(
        self, order: torch.Tensor, flat: torch.Tensor, counts: torch.Tensor, limit: int, probs: torch.Tensor
    ) -> torch.Tensor:
        """The assignments the experts take under capacity (`order`: all of them, by expert, in
        token order): each expert's first `limit`."""
        starts = torch.cumsum(counts, 0) - counts
        position = torch.arange(flat.numel()) - starts[flat[order]]
        return order[position < limit]

    def balance_loss(self, probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """experts * sum_e f_e * P_e: f_e from the global counts (no gradient), P_e this rank's
        mean probability."""
        total = self.global_counts(counts).float()
        fraction = total / total.sum()
        return self.n * (fraction * probs.mean(0)).sum()

    @torch.no_grad()
    def update_router_bias(self) -> None:
        """After an optimizer step: the bias moved towards balance by the step's assignments over
        every data-parallel rank, and the counts begun again."""
        if not self.router_bias:
            return
        counts = self.global_counts(self.tokens_per_expert)
        self.expert_bias += self.router_bias * torch.sign(counts.mean() - counts)
        self.tokens_per_expert.zero_()

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        for linear in (self.gate,):
            bound = 1.0 / math.sqrt(linear.in_features)
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        bound = 1.0 / math.sqrt(self.experts.weight.shape[-1])
        self.experts.weight.uniform_(-bound, bound, generator=generator)
        self.experts.bias.uniform_(-bound, bound, generator=generator)
        if self.router_bias:
            self.expert_bias.zero_()
            self.tokens_per_expert.zero_()


def experts_held(module: nn.Module) -> int | None:
    """How many experts `module` holds if it is grouped experts, else None: the built-in
    `GroupedExperts`, or any module with an int `num_experts` whose own parameters each lead with
    that many rows, one an expert (torchtitan's `GroupedExperts`, a user's alike). Expert
    parallelism shards such a module's parameters Shard(0) over the ep mesh."""
    if isinstance(module, GroupedExperts):
        return module.n
    n = getattr(module, "num_experts", None)
    own = list(module.parameters(recurse=False))
    if isinstance(n, int) and n > 0 and own and all(p.dim() >= 1 and p.shape[0] == n for p in own):
        return n
    return None


def grouped_experts_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The grouped experts modules of `model` (`experts_held`), by module name."""
    return [(name, m) for name, m in model.named_modules() if experts_held(m) is not None]


def moe_layers(model: nn.Module) -> list[GroupedMoE]:
    return [m for m in model.modules() if isinstance(m, GroupedMoE)]
