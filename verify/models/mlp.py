"""A stack of Linear layers with free widths (uneven, prime and one-element shards welcome)."""

from __future__ import annotations

import math

import torch
from torch import nn

from fsdp_verify.models.layers import Linear


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


class MLP(nn.Module):
    def __init__(self, widths: tuple[int, ...], dropout: float = 0.0):
        super().__init__()
        n = len(widths) - 1
        self.layers = nn.ModuleList(
            MLPBlock(widths[i], widths[i + 1], activation=i < n - 1, dropout=dropout) for i in range(n)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        for layer in self.layers:
            bound = 1.0 / math.sqrt(layer.linear.in_features)
            layer.linear.weight.uniform_(-bound, bound, generator=generator)
            layer.linear.bias.uniform_(-bound, bound, generator=generator)
