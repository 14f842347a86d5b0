"""The optimizer a Case names, built the same way on both sides, and its state by param name."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping

import torch

from fsdp_verify.case_specs import OptimSpec


def make_optimizer(spec: OptimSpec, params: Iterable[torch.nn.Parameter]) -> torch.optim.Optimizer:
    params = list(params)
    foreach = foreach_is_exact(params)
    if spec.name == "sgd":
        return torch.optim.SGD(
            params, lr=spec.lr, momentum=spec.momentum, weight_decay=spec.weight_decay, foreach=foreach
        )
    if spec.name == "adam":
        return torch.optim.Adam(
            params, lr=spec.lr, betas=spec.betas, eps=spec.eps, amsgrad=spec.amsgrad, foreach=foreach
        )
    if spec.name == "adagrad":  # state: `sum` and a scalar `step`
        return torch.optim.Adagrad(params, lr=spec.lr, eps=spec.eps, weight_decay=spec.weight_decay, foreach=foreach)
    if spec.name == "rmsprop":  # state: `square_avg`, a scalar `step`, `momentum_buffer` with momentum
        return torch.optim.RMSprop(
            params, lr=spec.lr, eps=spec.eps, weight_decay=spec.weight_decay, momentum=spec.momentum, foreach=foreach
        )
    return torch.optim.AdamW(
        params,
        lr=spec.lr,
        betas=spec.betas,
        eps=spec.eps,
        weight_decay=spec.weight_decay,
        amsgrad=spec.amsgrad,
        foreach=foreach,
    )


def run_model_hook_before_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """A model's own `before_optimizer_step()`, where it has one, run before each of the
    optimizer's steps on the ranks and in the reference alike, as a framework's trainer registers
    it on its optimizers (torchtitan's MoE load balancing: verify/frameworks/torchtitan.py)."""
    hook = getattr(model, "before_optimizer_step", None)
    if callable(hook):
        optimizer.register_step_pre_hook(lambda *_args: hook())


def make_scheduler(
    spec: OptimSpec, optimizer: torch.optim.Optimizer, steps: int
) -> torch.optim.lr_scheduler.LRScheduler | None:
    """The learning-rate schedule `spec.schedule` names, stepped once after each optimizer step
    (a step the loss scaler skips included, as a loop calling `scheduler.step()` after
    `scaler.step(optimizer)` does). The rate is a Python float computed the same way on both
    sides, so every rank and the reference step with the same bits. None: a constant rate."""
    if spec.schedule is None:
        return None
    if spec.schedule == "exponential":
        return torch.optim.lr_scheduler.ExponentialLR(optimizer, gamma=spec.schedule_factor)
    return torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=spec.schedule_factor, end_factor=1.0, total_iters=steps
    )


def step_scheduler(scheduler: torch.optim.lr_scheduler.LRScheduler | None) -> None:
    """`scheduler.step()`, without the warning torch gives when the loss scaler skipped the first
    optimizer step (the order is right: the skip is the scaler's decision)."""
    if scheduler is None:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        scheduler.step()


def schedule_state(scheduler) -> dict[str, torch.Tensor]:
    """The schedule's position as the checkpoint holds it and the "resumed" record shows it."""
    return {
        "schedule.last_epoch": torch.tensor([scheduler.last_epoch], dtype=torch.int64),
        "schedule.step_count": torch.tensor([scheduler._step_count], dtype=torch.int64),
    }


# The param groups' hyperparameters a resume must carry (docs/resume.md): the constructor
# arguments of the optimizers that change the arithmetic, and the `initial_lr` a schedule adds.
# Not the implementation switches (`foreach`, `fused`, `capturable`, `differentiable`): each
# side may choose its own (`foreach_is_exact`) and none moves a number.
HYPERPARAMETERS = (
    "lr",
    "initial_lr",
    "weight_decay",
    "betas",
    "eps",
    "momentum",
    "dampening",
    "nesterov",
    "amsgrad",
    "maximize",
    "alpha",
    "centered",
    "lr_decay",
    "initial_accumulator_value",
    "decoupled_weight_decay",
)


def param_groups_state(optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """`param_groups.<key>`: each hyperparameter the first group holds, over the groups (float64,
    a row per group; `betas` two columns; a flag 0 or 1; NaN where a group lacks it or holds None),
    compared exactly right after a resume's load as the optimizer state is."""
    groups = optimizer.param_groups
    out: dict[str, torch.Tensor] = {}
    for key in HYPERPARAMETERS:
        if key not in groups[0]:
            continue
        rows = [g.get(key) for g in groups]
        width = max((len(v) for v in rows if isinstance(v, (tuple, list))), default=0)
        values = [
            [float("nan") if x is None else float(x) for x in (v if isinstance(v, (tuple, list)) else [v])]
            for v in rows
        ]
        if width:
            values = [v + [float("nan")] * (width - len(v)) for v in values]
        out[f"param_groups.{key}"] = torch.tensor(values, dtype=torch.float64).reshape(
            len(groups), *([width] if width else [])
        )
    return out


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
