"""The built-in models split into pipeline stages (docs/pipeline-parallel.md): how a model is cut
is the model's business, as its definition is; how the stages are sharded and scheduled lives in
verify/engines/pipeline_parallel.py.

A stage is a *view* of the whole model: a shallow copy of the model's own module that shares its
blocks (the same objects, so whatever shards them shards the model's), with the blocks of other
stages replaced by `Skipped` (which passes its input on) and the parts before or after it (the
Transformer's embedding, its norm and head; the MLP's routed experts after block 0) set to None.
Its forward is the model's own, and its parameters keep the model's names. The blocks are split
evenly (the first stages take one more where they do not divide); the embedding goes with the
first stage, the norm and the head with the last.
"""

from __future__ import annotations

import copy

from torch import nn

from fsdp_verify.models.spec import ModelSpec


class Skipped(nn.Module):
    """A block another stage runs: its input passes through."""

    def forward(self, x, *args, **kwargs):
        return x


def block_ranges(n_blocks: int, n_stages: int) -> list[range]:
    """The blocks of each stage: contiguous, as even as they go, the first stages one more."""
    base, extra = divmod(n_blocks, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


def module_view(model: nn.Module) -> nn.Module:
    """A shallow copy of `model` with tables of its own (modules, parameters, buffers, hooks):
    the same class, forward and submodules; setting a child on it leaves the model alone."""
    view = copy.copy(model)
    for name, value in vars(model).items():
        if isinstance(value, dict):
            setattr(view, name, copy.copy(value))
    return view


def stage_views(model: nn.Module, spec: ModelSpec, n_stages: int) -> list[nn.Module]:
    """The built-in model's stages, each a view sharing the model's blocks (see the module
    docstring)."""
    ranges = block_ranges(spec.n_blocks, n_stages)
    stages = []
    for s, blocks in enumerate(ranges):
        view = module_view(model)
        view.layers = nn.ModuleList(model.layers[i] if i in blocks else Skipped() for i in range(len(model.layers)))
        if spec.kind == "mlp" and getattr(model, "moe", None) is not None and 0 not in blocks:
            view.moe = None  # after block 0: with it
        if spec.kind == "transformer":
            if s > 0:
                view.tok_embeddings = None
            if s < n_stages - 1:
                view.norm = None
                view.output = None
        stages.append(view)
    return stages
