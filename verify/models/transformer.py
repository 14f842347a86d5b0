"""A small decoder-only LM like seed 004's: token embedding, pre-norm blocks (RMSNorm, causal
self-attention with RoPE, SwiGLU), final norm, LM head, optional weight tying and dropout."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fsdp_verify.models.layers import Linear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32, return in the weight's dtype (the compute dtype under FSDP2 mixed
        # precision), so the next Linear sees matching dtypes whatever the input dtype was.
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * self.weight.float()).to(self.weight.dtype)


def rope_frequencies(head_dim: int, seq_len: int, theta: float = 10000.0) -> torch.Tensor:
    """(seq_len, head_dim // 2, 2) cos/sin table; a non-persistent buffer, rebuilt by init_weights."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float32), inv)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """x: (batch, heads, seq, head_dim)."""
    seq = x.shape[-2]
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    cos, sin = freqs[:seq, :, 0], freqs[:seq, :, 1]
    real = pairs[..., 0] * cos - pairs[..., 1] * sin
    imag = pairs[..., 0] * sin + pairs[..., 1] * cos
    return torch.stack((real, imag), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, dropout: float):
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = dim // n_heads
        self.wq = Linear(dim, dim, bias=False)
        self.wk = Linear(dim, dim, bias=False)
        self.wv = Linear(dim, dim, bias=False)
        self.wo = Linear(dim, dim, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # Heads by their width, not their count: under tensor parallelism wq's output holds this
        # rank's heads only (as torchtitan's attention reads them).
        q, k, v = (w(x).view(b, s, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, freqs), apply_rope(k, freqs)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.wo(out.transpose(1, 2).reshape(b, s, -1)))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int, dropout: float):
        super().__init__()
        self.w1 = Linear(dim, hidden, bias=False)
        self.w2 = Linear(hidden, dim, bias=False)
        self.w3 = Linear(dim, hidden, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(F.silu(self.w1(x)) * self.w3(x)))


class Block(nn.Module):
    def __init__(self, dim: int, n_heads: int, ffn_hidden: int, dropout: float):
        super().__init__()
        self.attention_norm = RMSNorm(dim)
        self.attention = Attention(dim, n_heads, dropout)
        self.ffn_norm = RMSNorm(dim)
        self.feed_forward = FeedForward(dim, ffn_hidden, dropout)

    def forward(self, x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), freqs)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        dim: int,
        n_layers: int,
        n_heads: int,
        ffn_hidden: int,
        seq_len: int,
        tie_embeddings: bool = False,
        dropout: float = 0.0,
    ):
        super().__init__()
        self.head_dim = dim // n_heads
        self.seq_len = seq_len
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(Block(dim, n_heads, ffn_hidden, dropout) for _ in range(n_layers))
        self.norm = RMSNorm(dim)
        self.output = Linear(dim, vocab_size, bias=False)
        self.tie_embeddings = tie_embeddings
        self.tie_weights()
        self.register_buffer("freqs", rope_frequencies(self.head_dim, seq_len), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        # A pipeline stage (verify/models/stages.py) lacks the parts of the others: the embedding
        # before the first stage, the norm and the head after the last are None there.
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers:
            x = layer(x, self.freqs)
        x = self.norm(x) if self.norm is not None else x
        return self.output(x) if self.output is not None else x

    def tie_weights(self) -> None:
        if self.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Every weight drawn in module order from one CPU generator; norms to one."""
        self.tie_weights()  # materialising from the meta device (`to_empty`) unties them
        self.freqs.copy_(rope_frequencies(self.head_dim, self.seq_len))
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=generator)
