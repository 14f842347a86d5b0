"""Mixed precision and fp16 loss scaling: a policy's dtype dropped or bypassed, master weights
cast, a scaler whose found-inf flag skips DTensor's all-reduce, a clip before the unscale."""

from __future__ import annotations

from dataclasses import replace

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy

from fsdp_verify.engines.fsdp2 import fully_shard_engine
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


def _with_policy(spec: ShardSpec, **changes) -> ShardSpec:
    policy = spec.mp_policy
    fields = {f: getattr(policy, f) for f in ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")}
    return replace(spec, mp_policy=MixedPrecisionPolicy(**{**fields, **changes}))


@bug(
    "reduce_dtype dropped: gradients reduce-scattered in bf16 although the policy says fp32",
    "seed 000: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32); bf16 reductions lose"
    " the small contributions (1e7 + 1 - 1e7 + 1)",
    ("precision", "grads"),
    precisions=("bf16",),
    pins={**CHEAP, "precision.reduce_dtype": "float32", "data.kind": "cancellation"},
)
def reduce_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Drops `reduce_dtype` when building the policy, so gradients are reduce-scattered in
    `param_dtype` (bf16) although the case asks for fp32 (seed 000: bf16 reductions lose the small
    contributions that survive cancellation)."""
    return fully_shard_engine(model, mesh, _with_policy(spec, reduce_dtype=None))


@bug(
    "param_dtype dropped: forward and backward run in fp32 although the policy says bf16",
    "seed 000: unsharded params in param_dtype; a policy that never reaches fully_shard",
    ("precision", "logits", "loss"),
    world_sizes=(1, 2, 3, 4),
    precisions=("bf16",),
    pins=dict(CHEAP),
)
def param_dtype_ignored(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Drops `param_dtype`: forward and backward run in fp32 although the case asks for bf16 (the
    numbers can be close enough to pass; the precision contract is not)."""
    return fully_shard_engine(model, mesh, _with_policy(spec, param_dtype=None))


@bug(
    "the model cast to bf16 before sharding: master weights, gradients and optimizer state in bf16",
    "seed 000/001: sharded master weights stay fp32; `model.to(torch.bfloat16)` before fully_shard",
    ("precision",),
    world_sizes=(1, 2, 3, 4),
    pins=dict(CHEAP),
)
def master_weights_in_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """`model.to(torch.bfloat16)` before sharding: the sharded master weights, their gradients and
    the optimizer state all become bf16 (seed 000/001: master weights must stay fp32)."""
    return fully_shard_engine(model.to(torch.bfloat16), mesh, spec)


@bug(
    "floating inputs rounded through bf16 although the policy is full precision",
    "seed 000: autocast-style casts outside the policy",
    ("logits",),
    world_sizes=(1, 2, 3, 4),
    precisions=("fp32",),
    pins=dict(CHEAP),
)
def inputs_cast_to_bf16(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Casts floating inputs to bf16 (and back) although the policy is full precision."""

    def cast(_module, args):
        return tuple(a.to(torch.bfloat16).to(a.dtype) if torch.is_floating_point(a) else a for a in args)

    model.register_forward_pre_hook(cast)
    return fully_shard_engine(model, mesh, spec)


# ---- fp16 dynamic loss scaling (seed 002; tests/test_loss_scaling.py) ----
class _LocalInfCheckScaler(torch.amp.GradScaler):
    """Unscales each rank's local shards directly (`to_local()`), as a scaler written for plain
    tensors does: DTensor's dispatch, which all-reduces the found-inf flag, never runs."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        with torch.no_grad():
            for group in optimizer.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        local = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                        by_dtype.setdefault(local.dtype, []).append(local)
            for grads in by_dtype.values():
                torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, inv_scale)
        return {found_inf.device: found_inf}


class _LocalInfCheckView(EngineView):
    def grad_scaler(self, spec, device):
        return _LocalInfCheckScaler(device.type, **spec.scaler_kwargs())


@bug(
    "fp16 loss scaling whose found-inf flag is not all-reduced: the rank holding an overflowing"
    " shard skips the step, another steps",
    "seed 002: every rank skips a step when any saw an inf/NaN; a scaler that unscales the local"
    " shards (`to_local()`) bypasses DTensor's all-reduce of the found-inf flag",
    ("loss_scale",),
    precisions=("fp16",),
    # The ranks can only disagree when the overflow is confined to some ranks' shards (an inf
    # in a rank's local gradient reaches every shard through the reduction when it is in the
    # logits' gradient). Inputs 100x the activations make the first layer's gradient the
    # largest by far, so a growing scale overflows it (its live rows, a subset of the shards)
    # before anything else: 9 of 40 drawn cases against 3 of 40 over all data scales.
    pins={**CHEAP, "data.scale": 100.0},
)
def inf_check_not_all_reduced(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """fp16 loss scaling whose found-inf flag is never all-reduced: each rank checks only its own
    shards, so the rank holding an overflow skips the step while a rank whose shards are finite
    steps (and their scales part)."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _LocalInfCheckView(model)
    return model


class _UnscaleInStepView(EngineView):
    def unscale_(self, scaler, optimizer) -> None:
        pass  # `scaler.step` unscales, after the clip has seen the scaled gradients


@bug(
    "fp16 loss scaling that clips the scaled gradients and unscales afterwards: clipped by a"
    " norm `scale` times too large",
    "seed 002 / the AMP docs: unscale_ before clip_grad_norm_",
    ("grad_norm",),
    world_sizes=(1, 2, 3, 4),
    precisions=("fp16",),
    pins={**CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
)
def unscale_after_clipping(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Clips before unscaling (no `scaler.unscale_(optimizer)` before `clip_grad_norm_`, the
    documented AMP pitfall): the clip measures the norm of the scaled gradients, `scale` times
    the true one, and clips them by it; `scaler.step` unscales afterwards."""
    fully_shard_engine(model, mesh, spec)
    model.verify_view = lambda: _UnscaleInStepView(model)
    return model
