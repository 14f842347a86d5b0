"""The optimizer a Case names, built the same way on both sides, and its state by param name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fsdp_verify.case import OptimSpec


def make_optimizer(spec: OptimSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    # foreach=False: the same single-tensor kernels on plain and DTensor parameters, so a correct
    # engine's update is elementwise identical to the reference's given identical gradients.
    params = list(params)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay, foreach=False
        )
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, foreach=False)
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=False
    )


def optimizer_state(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"<param>.<state key>": tensor} for every parameter that has state. DTensor states are
    returned as they are; the caller gathers them."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
    return out
