"""Bugs planted around verl's own FSDP2 code (verify/frameworks/verl.py): each mutant runs verl's
`apply_fsdp2` and `fsdp2_load_full_state_dict` unchanged and changes one thing around them, as
the zoo's FSDP2 mutants change one thing around `fully_shard`. No verl source is copied.
Registered here, beside their definitions; the catalog adds them (verify/zoo/catalog.py)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.frameworks import verl
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)


@bug(
    "verl's FSDP2 with each rank's gradients clipped by its local shards' norm, not the DTensor's",
    "a clip handed grad.to_local() (unwrapped before the norm): verl's fsdp2_clip_grad_norm_ reads the DTensors",
    ("grad_norm",),
    world_sizes=(2, 3),
    precisions=("fp32",),
    pins={**CHEAP, "clip_norm": st.sampled_from((1e-3, 1e-2))},
    framework=("verl", "fsdp_verify.models.hf:tiny_llama", ()),
)
def verl_clip_by_local_norm(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """verl's FSDP2 with a clip that takes the norm of each rank's local shards: verl's
    `fsdp2_clip_grad_norm_` reads DTensor gradients, whose norm DTensor reduces over the mesh;
    a clip handed `grad.to_local()` (as code that unwraps DTensors before a norm is) clips each
    rank by its own shard's norm, and the ranks' parameters part."""
    model = verl.apply(model, mesh, spec)
    model.verify_view = lambda: _LocalNormView(model)
    return model


class _LocalNormView(verl.VerlView):
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        from torch.nn.utils.clip_grad import _clip_grads_with_norm_, _get_total_norm

        params = [p for p in self.module.parameters() if p.grad is not None]
        local = _get_total_norm([p.grad.to_local() for p in params], 2.0)
        _clip_grads_with_norm_(params, max_norm, local)
        return local


verl_clip_by_local_norm.capabilities = verl.apply.capabilities
