"""Optimizers, schedules and what is trained (docs/optimizers-and-schedules.md): each shows only
with its knob on (a schedule, an optimizer with state beyond Adam's, an unfreeze step)."""

from __future__ import annotations

import weakref

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.zoo.mutants._shared import _over_engine_view
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


class _SchedulerTwiceView(EngineView):
    def make_scheduler(self, optimizer, spec, steps):
        scheduler = super().make_scheduler(optimizer, spec, steps)
        if scheduler is not None:
            once = scheduler.step

            def twice(*args, **kwargs):
                once(*args, **kwargs)
                once(*args, **kwargs)

            scheduler.step = twice
        return scheduler


@bug(
    "the learning-rate schedule stepped twice per optimizer step: it runs twice as fast",
    "`scheduler.step()` inside the accumulation loop and again after `optimizer.step()`",
    ("params",),
    world_sizes=(1, 2, 3, 4),
    # The rate of step 1 is the initial one: a second step is the first the schedule moves.
    pins={"steps": st.integers(2, 3), "optim.schedule": st.sampled_from(("exponential", "linear_warmup"))},
)
def lr_scheduler_stepped_twice(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`scheduler.step()` called twice per optimizer step (once inside the accumulation loop's
    last micro-batch, once after `optimizer.step()`): the schedule runs twice as fast; a
    constant rate hides it."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _SchedulerTwiceView(model)
    return model


# The state an optimizer-state round trip written for SGD and Adam knows.
_KNOWN_STATE = ("step", "momentum_buffer", "exp_avg", "exp_avg_sq")


def _reset_unknown_state(optimizer, _args, _kwargs) -> None:
    with torch.no_grad():
        for state in optimizer.state.values():
            for key, value in state.items():
                if key not in _KNOWN_STATE and isinstance(value, torch.Tensor):
                    value.zero_()


class _AdamStateOnlyView(EngineView):
    def make_optimizer(self, spec, params):
        optimizer = super().make_optimizer(spec, params)
        optimizer.register_step_post_hook(_reset_unknown_state)
        return optimizer


@bug(
    "optimizer state beyond SGD's and Adam's (Adagrad's sum, RMSprop's square average,"
    " AMSGrad's running max) reset to zero after every step",
    "an optimizer-state offload or resharding written for Adam (issue 28: state not shaped like Adam's)",
    ("optim_state", "params"),
    world_sizes=(1, 2, 3, 4),
    pins={
        **CHEAP,
        "optim.name": st.sampled_from(("adagrad", "rmsprop", "adam", "adamw")),
        "optim.amsgrad": True,
    },
)
def optimizer_state_known_keys_only(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The optimizer state re-created after every step by code that knows SGD's and Adam's
    entries (`step`, `momentum_buffer`, `exp_avg`, `exp_avg_sq`), as a state offload or
    resharding written for Adam does: every other entry starts over at zero, so Adagrad's `sum`,
    RMSprop's `square_avg` and AMSGrad's `max_exp_avg_sq` are lost each step; SGD and Adam
    cannot show it."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _AdamStateOnlyView(model)
    return model


class _StaleUnfreezeView(EngineView):
    def __init__(self, module: nn.Module, before: dict[str, weakref.ref]):
        super().__init__(module)
        self.before = before

    def unfreeze(self, names: list[str]) -> None:
        for n in names:
            stale = self.before[n]()
            if stale is not None:
                stale.requires_grad_(True)


@bug(
    "parameters unfrozen through references taken before sharding: the sharded ones stay frozen, never train",
    "a fine-tuning callback that collected `model.named_parameters()` before `fully_shard` replaced them",
    ("grads",),
    world_sizes=(1, 2, 3, 4),
    pins={"steps": st.integers(2, 3), "model.frozen": ("layers.0.linear.weight",), "unfreeze_step": 2},
)
def unfreeze_misses_sharded_params(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Unfreezes the parameters it collected before sharding (a fine-tuning callback that took
    `model.named_parameters()` before `fully_shard` replaced them with DTensors): the sharded
    parameters the model computes with stay frozen, get no gradient and never train. Held by weak
    reference here, so that only the unfreezing shows (strong ones would also keep the
    unsharded weights alive, which the memory contract catches on its own, as for
    `retains_full_params`)."""
    before = {n: weakref.ref(p) for n, p in model.named_parameters()}
    fully_shard_engine(model, mesh, spec)
    _over_engine_view(model, _StaleUnfreezeView, before)
    return model
