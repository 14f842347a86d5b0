"""Float8 bugs of real classes, each the built-in FSDP2 engine with one thing about torchao's
float8 changed (its own code called, nothing of it copied): registered with the zoo beside their
definitions (verify/zoo/registry.py). `--engine fsdp_verify.dims.float8.mutants:NAME`."""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.dims.float8 import Float8Spec
from fsdp_verify.dims.float8.runtime import config, converted_names
from fsdp_verify.engines.capabilities import FSDP2
from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

_ALL_GATHER = {**CHEAP, "dims.float8": Float8Spec("tensorwise", all_gather=True)}
_SOURCE = "issue 51: torchao float8 with FSDP2's float8 all-gather"


def _converted(model: nn.Module, spec: ShardSpec, float8_config) -> nn.Module:
    """`model` converted as the case says, with `float8_config` for torchao's config."""
    from torchao.float8 import convert_to_float8_training

    chosen = set(converted_names(model, spec.case.dims.float8))
    return convert_to_float8_training(model, config=float8_config, module_filter_fn=lambda _m, fqn: fqn in chosen)


# Two mutants patch torchao's pre-all-gather, once in a process, acting only on the weights of
# the models they converted: their LinearMMConfig objects, which every view and shard of the
# weight carries by identity (a correct engine's later case in the same process makes its own).
_LOCAL_AMAX: list = []  # configs whose casts take the shard's own amax
_CACHED: list = []  # configs whose first scale is kept for every later gather


def _armed(config, configs: list) -> bool:
    return any(config is c for c in configs)


def _arm(model: nn.Module, configs: list) -> None:
    configs.extend(
        m.weight._linear_mm_config for m in model.modules() if hasattr(getattr(m, "weight", None), "_linear_mm_config")
    )


def _with_patched_gather(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec, configs: list) -> nn.Module:
    """The built-in engine on `model` converted here, its weights' configs armed in `configs`."""
    _install_pre_all_gather()
    _converted(model, spec, config(spec.case.dims.float8))
    _arm(model, configs)
    return fully_shard_engine(model, mesh, spec)


def _install_pre_all_gather() -> None:
    from torchao.float8.float8_training_tensor import GemmInputRole
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor, hp_tensor_to_float8_dynamic

    correct = WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather
    if getattr(correct, "mutant", False):
        return

    def pre_all_gather(self, mesh):
        config = self._linear_mm_config
        if _armed(config, _LOCAL_AMAX) and self._precomputed_scale is None:
            cast = hp_tensor_to_float8_dynamic(
                self._tensor,
                self._dtype,
                config,
                reduce_amax=False,  # the bug: the shard's own amax, never all-reduced
                gemm_input_role=GemmInputRole.WEIGHT,
            )
            return (cast._data,), (cast._scale,)
        out = correct(self, mesh)
        if _armed(config, _CACHED) and self._precomputed_scale is None:
            self._precomputed_scale = out[1][0]  # the bug: this scale, for every later gather
        return out

    pre_all_gather.mutant = True
    WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather = pre_all_gather


@bug(
    "the float8 all-gather's scale from each rank's shard alone: its amax never all-reduced",
    _SOURCE + " (a pre-all-gather cast whose amax is local)",
    ("logits",),
    pins={**_ALL_GATHER, "dims.float8": Float8Spec("tensorwise", all_gather=True, precompute=False)},
)
def float8_amax_of_local_shard(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each rank casts its shard of a float8 weight to float8 with a scale from its own shard's
    amax (torchao's `tensor_to_amax(reduce_amax=False)`): the gathered weight is a patchwork of
    scales, the one scale it carries is the rank's own."""
    return _with_patched_gather(model, mesh, spec, _LOCAL_AMAX)


@bug(
    "the float8 all-gather's first scale cached and reused by every later gather of the weight",
    _SOURCE + " (a scale cached on the shard and never invalidated)",
    ("comm", "logits"),
    pins={**_ALL_GATHER, "steps": 2, "dims.float8": Float8Spec("tensorwise", all_gather=True, precompute=False)},
)
def float8_gather_scale_cached(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Each weight's first all-gather computes its scale as torchao does (the shards' amaxes
    all-reduced) and keeps it: every later gather, the backward's and the next steps', casts the
    updated weight with it, and all-reduces no amax."""
    return _with_patched_gather(model, mesh, spec, _CACHED)


@bug(
    "the float8 all-gather's scales precomputed once, at setup, never after an optimizer step",
    _SOURCE + " (precompute_float8_dynamic_scale_for_fsdp called before training only)",
    ("comm", "logits"),
    pins={**_ALL_GATHER, "steps": 2, "dims.float8": Float8Spec("tensorwise", all_gather=True, precompute=False)},
)
def float8_scales_never_recomputed(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The scales for the float8 all-gather computed from the initial weights and kept: every
    later step casts the updated weights with the first step's scale (a loop that calls
    `precompute_float8_dynamic_scale_for_fsdp` once, before training, and never after the
    optimizer's step)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    sharded = fully_shard_engine(model, mesh, spec)
    precompute_float8_dynamic_scale_for_fsdp(sharded)
    return sharded


@bug(
    "the backward's output-gradient cast in e4m3 where the recipe says e5m2",
    _SOURCE + " (a Float8LinearConfig whose cast_config_grad_output is float8_e4m3fn)",
    ("grads",),
    pins={**CHEAP, "dims.float8.recipe": "tensorwise"},
)
def float8_grad_output_in_e4m3(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """The output gradients cast to float8_e4m3fn (3 mantissa bits, max 448) where tensorwise
    training casts them to e5m2 (2 bits, max 57344): every weight and input gradient of a
    converted layer rounded otherwise."""
    from torchao.float8.config import CastConfig

    good = config(spec.case.dims.float8)
    e4m3 = CastConfig(target_dtype=torch.float8_e4m3fn)
    wrong = replace(good, cast_config_grad_output=e4m3, cast_config_grad_output_for_grad_weight=e4m3)
    _converted(model, spec, wrong)
    return fully_shard_engine(model, mesh, spec)


for _engine in (
    float8_amax_of_local_shard,
    float8_gather_scale_cached,
    float8_scales_never_recomputed,
    float8_grad_output_in_e4m3,
):
    _engine.capabilities = FSDP2
