"""A user's own models, written outside the package: what `--model tests/user/models.py:NAME`
or `--model tests.user.models:NAME` brings under test."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class UserBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class UserLM(nn.Module):
    """Embedding, residual MLP blocks, a head: a token model of the user's own making (no
    attention, so positions never mix and right padding cannot leak into real tokens)."""

    def __init__(self, vocab: int = 37, dim: int = 12, n_layers: int = 2, hidden: int = 20):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(UserBlock(dim, hidden) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def user_lm(**kwargs) -> nn.Module:
    return UserLM(**kwargs)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def reseeds_by_rank(**kwargs) -> nn.Module:
    """A factory that seeds itself from the rank (as `torch.manual_seed(base + rank)` in a
    launcher script does): every rank builds other values."""
    torch.manual_seed(1000 + _rank())
    return UserLM(**kwargs)


def reseeds_by_env_rank(**kwargs) -> nn.Module:
    """The same, reading the launcher's RANK variable as a torchrun script does (0 when unset)."""
    torch.manual_seed(1000 + int(os.environ.get("RANK", "0")))
    return UserLM(**kwargs)


def reseeds_by_env_rank_strict(**kwargs) -> nn.Module:
    """The same as a torchrun script writes it, `os.environ["RANK"]` with no default (in the
    reference's process too, as a one-process torchrun run sets RANK=0)."""
    torch.manual_seed(1000 + int(os.environ["RANK"]))
    return UserLM(**kwargs)


class RaisingBlock(UserBlock):
    """A block whose forward raises on rank 1 only (RANK as torchrun and the pool's workers set it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if os.environ.get("RANK") == "1":
            raise RuntimeError("the user's block failed on rank 1")
        return super().forward(x)


def raises_in_forward_on_rank_1(**kwargs) -> nn.Module:
    """A model whose second block raises inside its forward on rank 1: the failure must be named
    with the forward, not with the toolkit's phase after it."""
    model = UserLM(**kwargs)
    model.blocks[1] = RaisingBlock(model.embed.embedding_dim, model.blocks[1].up.out_features)
    return model


def width_by_rank(**kwargs) -> nn.Module:
    """A factory whose hidden width depends on the rank."""
    return UserLM(**{**kwargs, "hidden": 20 + _rank()})


def raises(**kwargs) -> nn.Module:
    raise RuntimeError("config file not found: tiny.yaml")


def normal_init(model: nn.Module, generator: torch.Generator) -> None:
    """An init_fn: every parameter from the toolkit's generator, in registration order."""
    for p in model.parameters():
        p.normal_(0.0, 0.05, generator=generator)


class DictLM(UserLM):
    """Forward takes keyword inputs and returns a dict: the logits need an output_fn."""

    def forward(self, tokens: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
        logits = super().forward(tokens)
        return {"scores": logits, "mask_seen": attention_mask}


def dict_lm(**kwargs) -> nn.Module:
    return DictLM(**kwargs)


def scores(output: dict) -> torch.Tensor:
    return output["scores"]


def reversal_data(case, step: int, generator: torch.Generator):
    """A user's data: learn to reverse a sequence; the first position's target is ignored."""
    b, n = case.data.batch_size, case.model.seq_len
    tokens = torch.randint(1, 37, (b, n), generator=generator)
    targets = tokens.flip(1).clone()
    targets[:, 0] = -100
    return {"tokens": tokens, "attention_mask": torch.ones_like(tokens)}, targets


def smoothed_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss: a sum over the real items (the toolkit divides by their global count)."""
    return F.cross_entropy(
        logits.float().flatten(0, -2), targets.flatten(), ignore_index=-100, reduction="sum", label_smoothing=0.1
    )


class ConstantScaledLM(UserLM):
    """Keeps a constant as a plain tensor attribute (not a buffer), as many users' models do: the
    memory contract must count it as the model's own, not as something the engine kept."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.scale = torch.linspace(0.5, 1.5, self.head.out_features)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens) * self.scale


def constant_scaled_lm(**kwargs) -> nn.Module:
    return ConstantScaledLM(**kwargs)


class BatchNormLM(UserLM):
    """A running mean and variance after the embedding: buffers every training forward changes."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.bn = nn.BatchNorm1d(self.head.in_features)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.bn(self.embed(tokens).transpose(1, 2)).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def batchnorm_lm(**kwargs) -> nn.Module:
    return BatchNormLM(**kwargs)


# ---- bugs planted in a user's model, for the zoom (tests/test_zoom.py) ---------------------------
class ScaledBlock(UserBlock):
    """A block that multiplies its output by a per-channel buffer (a rotary or scale cache)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__(dim, hidden)
        self.register_buffer("gain", torch.linspace(0.9, 1.1, dim) + 1e-3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * self.gain


def buffer_cast_to_bf16(**kwargs) -> nn.Module:
    """The second block's buffer cast to bf16 in the distributed run only (a launcher's
    `buffers.to(bfloat16)` to save memory): its forward rounds the gain; the reference's does not."""
    model = UserLM(**kwargs)
    model.blocks[1] = ScaledBlock(model.head.in_features, model.blocks[1].up.out_features)
    if dist.is_initialized():
        model.blocks[1].gain = model.blocks[1].gain.to(torch.bfloat16)
    return model


class RankShift(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1e-3 * _rank()


def forward_reads_rank(**kwargs) -> nn.Module:
    """Block 0's down projection followed by a module whose forward reads the rank."""
    model = UserLM(**kwargs)
    model.blocks[0].down = nn.Sequential(model.blocks[0].down, RankShift())
    return model


def hook_on_one_rank(**kwargs) -> nn.Module:
    """A gradient hook on block 1's up projection, registered on rank 1 only (a debugging hook
    left behind under `if rank == 1`): it scales the gradient with respect to its input."""
    model = UserLM(**kwargs)
    if _rank() == 1:
        model.blocks[1].up.register_full_backward_hook(lambda _m, gin, _gout: (gin[0] * 1.001,))
    return model


class ReversedLinear(nn.Linear):
    """The same map as nn.Linear, its dot products summed in the reverse order (the input
    features flipped on both sides): equal in exact arithmetic, a rounding apart in floating point."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.flip(-1), self.weight.flip(-1), self.bias)


def reassociated_on_rank1(**kwargs) -> nn.Module:
    """Not a bug: rank 1's up projections sum their dot products in another order (as a kernel
    that picks its blocking by shape or device would). A zoom must name nothing."""
    model = UserLM(**kwargs)
    if _rank() == 1:
        for block in model.blocks:
            old = block.up
            block.up = ReversedLinear(old.in_features, old.out_features)
            block.up.load_state_dict(old.state_dict())
    return model
