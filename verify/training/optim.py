"""The optimizer a Case names, built the same way on both sides, and its state by param name."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from fsdp_verify.case import OptimSpec


def make_optimizer(spec: OptimSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    foreach = foreach_is_exact(params)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay, foreach=foreach
        )
    if spec.name == "adam":
        return torch.optim.Adam(params, lr=spec.lr, betas=spec.betas, eps=spec.eps, foreach=foreach)
    return torch.optim.AdamW(
        params, lr=spec.lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay, foreach=foreach
    )


def foreach_is_exact(params: list[torch.Tensor]) -> bool:
    """Whether the multi-tensor ("foreach") update may run instead of the single-tensor one.

    On fp32 and fp64 parameters the two give the same bits (SGD, Adam, AdamW; plain tensors and
    DTensor shards alike; tests/test_optim.py), so the choice never moves a number: a correct
    engine's update stays elementwise identical to the reference's. On DTensors foreach is much
    cheaper, one DTensor dispatch an op for all parameters instead of one a parameter: 6 of a
    tiny case's 48 ms of CPU a rank (FSDP2's default on GPU too). In bf16 and fp16 the two differ
    (SGD's and AdamW's weight decay round otherwise), and one foreach op cannot mix DTensors with
    plain tensors or DTensors of two meshes: those keep the single-tensor update."""
    meshes = {getattr(p, "device_mesh", None) for p in params}  # None: a plain tensor
    return len(meshes) <= 1 and all(p.dtype in (torch.float32, torch.float64) for p in params)


def optimizer_state(optimizer: torch.optim.Optimizer, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{"<param>.<state key>": tensor} for every parameter that has state. DTensor states are
    returned as they are; the caller gathers them."""
    out: dict[str, torch.Tensor] = {}
    for name, p in params.items():
        for key, value in optimizer.state.get(p, {}).items():
            if isinstance(value, torch.Tensor):
                out[f"{name}.{key}"] = value
    return out
