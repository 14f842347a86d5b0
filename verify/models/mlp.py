"""A stack of Linear layers with free widths (uneven, prime and one-element shards welcome)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_verify.models.layers import Linear
from fsdp_verify.models.moe import GroupedMoE


class MLPBlock(nn.Module):
    def __init__(self, d_in: int, d_out: int, activation: bool, dropout: float):
        super().__init__()
        self.linear = Linear(d_in, d_out)
        self.activation = activation
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        if self.activation:
            x = self.dropout(torch.tanh(x))
        return x


class RoutedExperts(nn.Module):
    """Top-1 routing of each sample to one of `n` experts (a residual Linear each, scaled by its
    gate probability, so the gate trains too). An expert no sample of a micro-batch reaches on a
    rank is skipped, as Mixtral's loop does (`if top_x.shape[0] == 0: continue`): it takes no
    part in that backward and gets no gradient there."""

    def __init__(self, dim: int, n: int):
        super().__init__()
        self.gate = Linear(dim, n)
        self.experts = nn.ModuleList(Linear(dim, dim) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.gate(x).float(), dim=-1)
        choice = probs.argmax(dim=-1)
        out = x
        for e, expert in enumerate(self.experts):
            rows = (choice == e).nonzero(as_tuple=True)[0]
            if rows.numel() == 0:
                continue
            out = out.index_add(0, rows, expert(x[rows]) * probs[rows, e : e + 1].to(x.dtype))
        return out


class MLP(nn.Module):
    def __init__(self, widths: tuple[int, ...], dropout: float = 0.0, experts: int = 0, moe: dict | None = None):
        super().__init__()
        n = len(widths) - 1
        self.layers = nn.ModuleList(
            MLPBlock(widths[i], widths[i + 1], activation=i < n - 1, dropout=dropout) for i in range(n)
        )
        # After the first block (docs/optimizers-and-schedules.md); none by default. `moe`: the
        # grouped experts' routing (top_k, capacity_factor, aux_loss, router_bias; models/moe.py)
        # instead of the per-expert loop.
        self.moe: nn.Module | None = None
        if experts and moe:
            self.moe = GroupedMoE(widths[1], experts, **moe)
        elif experts:
            self.moe = RoutedExperts(widths[1], experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i == 0 and self.moe is not None:
                x = self.moe(x)
        return x

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        linears = [layer.linear for layer in self.layers]
        if isinstance(self.moe, RoutedExperts):  # after the blocks: a model without experts draws what it drew
            linears += [self.moe.gate, *self.moe.experts]
        for linear in linears:
            bound = 1.0 / math.sqrt(linear.in_features)
            linear.weight.uniform_(-bound, bound, generator=generator)
            linear.bias.uniform_(-bound, bound, generator=generator)
        if isinstance(self.moe, GroupedMoE):
            self.moe.init_weights(generator)
