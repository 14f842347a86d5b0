"""Precision probe: the dtypes a sharded run actually uses at each stage, recorded on rank 0 into
`trace.meta["precision"]` for verify/checks/precision.py to hold against the declared policy
(seed 000's contract: sharded params fp32, unsharded params in `param_dtype` in forward and
backward, reduction in `reduce_dtype`, sharded grads and optimizer state fp32, unit outputs in
`output_dtype`). Numbers that agree do not prove the contract: a bf16 run that silently computes
in fp32 can pass every tolerance.

What is observed, and where:
* `sharded`: the dtypes of the parameters the optimizer steps, after sharding (step 0).
* `forward_params` / `forward_inputs`: in a forward pre-hook on every wrapped module, registered
  after the engine's own (FSDP2 prepends its unshard hook), so the module holds the unsharded
  parameters the forward computes with, and the inputs are already cast.
* `backward_params` / `backward_grads`: a post-accumulate-grad hook on each unsharded parameter
  seen in forward fires when backward has produced its gradient: the parameter's dtype then is
  the one backward computed with, the gradient's the one it computed in.
* `reduce`: the input dtype of every reduce-scatter issued during forward and backward (wrapped
  `torch.distributed` functions; world size 1 issues none).
* `grads`: the dtypes of the sharded gradients after each backward (after reduction).
* `outputs`: floating outputs of every wrapped module, after the engine's post-forward hook.
* `optim_state`: the optimizer's tensor states after every step.

Each entry maps a name to the sorted dtypes seen in that step: `{step: {stage: {name: [dtype]}}}`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from fsdp_verify import module_names
from fsdp_verify.dtypes import name_of
from fsdp_verify.engines.view import EngineView
from fsdp_verify.probes.base import Probe, eager_hook
from fsdp_verify.units import modules_here, owner_of_param

# The reduce-scatter functions an engine may call; wrapped once per process, recording only while
# a PrecisionProbe on this rank has a window open.
_REDUCE_SCATTERS = ("reduce_scatter_single", "reduce_scatter_tensor")


def _install_collective_wrappers() -> None:
    for name in _REDUCE_SCATTERS:
        original = getattr(dist, name, None)
        if original is None or getattr(original, "_verify_precision", False):
            continue

        def wrapped(*args: Any, _original=original, **kwargs: Any) -> Any:
            source = kwargs.get("input", args[1] if len(args) > 1 else None)
            if _recorder is not None and isinstance(source, torch.Tensor):
                _recorder.seen("reduce", "reduce_scatter", source.dtype)
            return _original(*args, **kwargs)

        wrapped._verify_precision = True  # type: ignore[attr-defined]
        setattr(dist, name, wrapped)


def _floats(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        if torch.is_floating_point(obj):
            yield obj
    elif isinstance(obj, (tuple, list)):
        for o in obj:
            yield from _floats(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _floats(o)


def _dtype_name(dtype: torch.dtype) -> str:
    return name_of(dtype)


class DtypeLog:
    """The dtypes seen, by step, stage and name. Tensor hooks hold this log and nothing else: a
    hook on a parameter that autograd's C++ side keeps alive must not reach back to the model, or
    the cycle outlives the case, and with it the FSDP state and its process groups' threads."""

    def __init__(self) -> None:
        self.step = 0
        self.steps: dict[int, dict[str, dict[str, set[str]]]] = {}

    def seen(self, stage: str, name: str, dtype: torch.dtype) -> None:
        stages = self.steps.setdefault(self.step, {})
        stages.setdefault(stage, {}).setdefault(name, set()).add(_dtype_name(dtype))


_recorder: DtypeLog | None = None


class PrecisionProbe(Probe):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        global _recorder
        _recorder = None  # a previous case that crashed may have left its log behind
        self.log = DtypeLog()
        self.seen = self.log.seen
        self.optimizer: torch.optim.Optimizer | None = None
        self.view: EngineView | None = None
        self.hooked: set[int] = set()
        if self.trace is not None:
            _install_collective_wrappers()

    # ---- hooks of the loop ----------------------------------------------------------------------
    def after_shard(self, model: nn.Module, view: EngineView) -> None:
        if self.trace is None:
            return
        self.view = view
        for name, p in view.parameters().items():
            self.seen("sharded", name, p.dtype)
        plan = self.case.wrap_plan
        owned: dict[str, list[str]] = {unit: [] for unit in plan}
        for name, _ in module_names.named_parameters(model):
            owned[owner_of_param(plan, name)].append(name)
        for unit in plan:
            for module in modules_here(
                model, unit
            ):  # each member of a unit over several modules casts (under pp: this rank's)
                # FSDP1 unshards and casts inside its forward, not in hooks: observe the module it wraps.
                module = getattr(module, "_fsdp_wrapped_module", module)
                pre = eager_hook(self.case, self._pre_forward(model, unit, owned[unit]))
                module.register_forward_pre_hook(pre, with_kwargs=True)
                module.register_forward_hook(eager_hook(self.case, self._post_forward(unit)))

    def after_optimizer(self, optimizer: torch.optim.Optimizer, view: EngineView) -> None:
        self.optimizer = optimizer

    def before_forward(self, step: int, microbatch: int) -> None:
        global _recorder
        self.log.step = step
        _recorder = self.log if self.trace is not None else None

    def after_backward(self, step: int, microbatch: int) -> None:
        global _recorder
        _recorder = None
        # Only a synced backward reduces; under no-sync FSDP1 leaves the unreduced local grads
        # (in param_dtype) on the parameters, which are not the "reduced gradient" recorded here.
        synced = self.case.sync_every_microbatch or microbatch == self.case.microbatches - 1
        if self.view is not None and synced:
            for name, p in self.view.parameters().items():
                if p.grad is not None:
                    self.seen("grads", name, p.grad.dtype)

    def after_step(self, step: int) -> None:
        if self.trace is None or self.optimizer is None or self.view is None:
            return
        for name, p in self.view.parameters().items():
            for key, value in self.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0:  # not the scalar step count
                    self.seen("optim_state", f"{name}.{key}", value.dtype)

    def finish(self) -> None:
        global _recorder
        _recorder = None
        steps = {
            str(step): {stage: {n: sorted(d) for n, d in sorted(names.items())} for stage, names in stages.items()}
            for step, stages in sorted(self.log.steps.items())
        }
        self.meta("precision", {"steps": steps})

    # ---- module hooks (rank 0 only) ----------------------------------------------------
    def _pre_forward(self, model: nn.Module, unit: str, names: list[str]):
        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            for name in names:
                owner, _, attr = name.rpartition(".")
                p = getattr(model.get_submodule(owner), attr)  # a plain tensor in flat-buffer engines
                self.seen("forward_params", name, p.dtype)
                if p.requires_grad and not p.is_leaf:  # a fresh view of a flat buffer every forward
                    p.register_hook(_after_view_grad(self.log, name, p.dtype))
                elif p.requires_grad and id(p) not in self.hooked:
                    self.hooked.add(id(p))
                    p.register_post_accumulate_grad_hook(_after_grad(self.log, name))
            for t in _floats((args, kwargs)):
                self.seen("forward_inputs", unit or "<root>", t.dtype)

        return hook

    def _post_forward(self, unit: str):
        def hook(_module: nn.Module, _args: tuple, output: Any) -> None:
            for t in _floats(output):
                self.seen("outputs", unit or "<root>", t.dtype)

        return hook


# ---- tensor hooks (rank 0 only): they hold the log, never the probe (see DtypeLog) ---------------
def _after_view_grad(log: DtypeLog, name: str, dtype: torch.dtype):
    def hook(grad: torch.Tensor) -> None:
        log.seen("backward_params", name, dtype)
        log.seen("backward_grads", name, grad.dtype)

    return hook


def _after_grad(log: DtypeLog, name: str):
    def hook(p: torch.Tensor) -> None:
        log.seen("backward_params", name, p.dtype)
        if p.grad is not None:
            log.seen("backward_grads", name, p.grad.dtype)

    return hook
