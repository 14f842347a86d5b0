"""A user's split of their own model into pipeline stages (`--pp-split tests/user/pp_splits.py:NAME`):
`fn(model, n_stages) -> the stage modules`, each sharing the model's own modules, each taking the
previous stage's output."""

from __future__ import annotations

from torch import nn


class _Stage(nn.Module):
    def __init__(self, embed: nn.Module | None, blocks: list[nn.Module], head: nn.Module | None):
        super().__init__()
        self.embed, self.blocks, self.head = embed, nn.ModuleList(blocks), head

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def user_lm_stages(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """UserLM (tests/user/models.py): the embedding with the first stage, the head with the last,
    the blocks as even as they go."""
    blocks = list(model.blocks)
    per, extra = divmod(len(blocks), n_stages)
    stages, start = [], 0
    for s in range(n_stages):
        size = per + (1 if s < extra else 0)
        first, last = s == 0, s == n_stages - 1
        stages.append(
            _Stage(model.embed if first else None, blocks[start : start + size], model.head if last else None)
        )
        start += size
    return stages


def copies_the_blocks(model: nn.Module, n_stages: int) -> list[nn.Module]:
    """A split whose stages hold copies of the model's modules, not the modules themselves."""
    import copy

    return [copy.deepcopy(stage) for stage in user_lm_stages(model, n_stages)]
