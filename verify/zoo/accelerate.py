"""Bugs planted around Accelerate's own FSDP2 preparation (verify/frameworks/accelerate.py): each
mutant calls Accelerate's `fsdp2_prepare_model` unchanged and changes one thing before it or in
what reaches it, as the zoo's FSDP2 mutants change one thing around `fully_shard`. No Accelerate
source is copied. Registered here, beside their definitions; the catalog adds them
(verify/zoo/catalog.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.frameworks import accelerate as accel
from fsdp_verify.zoo.pins import CHEAP
from fsdp_verify.zoo.registry import registrar

bug = registrar(__name__)

# The tiny Llama, every unit kept unsharded after forward as Accelerate keeps its [norm, head]
# (docs/frameworks/accelerate.md).
_ACCEL = ("accelerate", "fsdp_verify.models.hf:tiny_llama", ())
_ACCEL_PINS = {**CHEAP, "reshard_after_forward": False}


@bug(
    "Accelerate's FSDP2 with RoPE's inv_freq left at transformers' zero placeholder on the ranks other than 0",
    "cpu_ram_efficient_loading: the non-persistent buffers are not in the state dict Accelerate broadcasts"
    " (fsdp2_prepare_model keeps each rank's own), and a model's _init_weights that does not recompute them",
    ("buffers",),
    world_sizes=(2, 3),
    pins=dict(_ACCEL_PINS),
    framework=_ACCEL,
)
def accel_rope_buffer_left_zero(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accelerate's preparation of a model whose non-persistent buffers (RoPE's `inv_freq`) the
    ranks other than 0 hold as transformers' zero placeholders: under `cpu_ram_efficient_loading`
    `from_pretrained` gives them `torch.zeros_like` there and counts on the model's
    `_init_weights` to compute them again, which a model class that does not recompute them
    skips. Accelerate's broadcast carries the state dict only, so they stay zero: those ranks'
    attention runs without rotation."""

    def zero_buffers(accelerator, module: nn.Module) -> None:
        from accelerate.utils.modeling import get_non_persistent_buffers

        if accelerator.is_main_process:
            return
        computed = get_non_persistent_buffers(module, recurse=True, fqns=True)
        with torch.no_grad():
            for name, buffer in module.named_buffers():
                if name in computed:
                    buffer.zero_()

    return accel._prepare(model, mesh, spec, before=zero_buffers)


@bug(
    "Accelerate's fsdp2_load_full_state_dict broadcasting a stale copy of rank 0's weights",
    "a full state dict copied before the checkpoint (or initialisation) replaced the factory's weights",
    ("init",),
    world_sizes=(2, 3),
    precisions=("fp32",),
    pins=dict(_ACCEL_PINS),
    framework=_ACCEL,
)
def accel_full_state_dict_stale(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accelerate's preparation with rank 0's full state dict, the one `fsdp2_load_full_state_dict`
    broadcasts, a stale copy: the weights the model factory built before the run's own (a
    checkpoint loaded, an initialisation run) replaced them, as a copy of the state dict taken too
    early is. Every rank trains from the stale weights."""
    from fsdp_verify.models import build_model

    case = spec.case
    stale = build_model(case.model, case.seed + 1).state_dict()  # the factory's weights from another draw
    with _full_state_dict(lambda full_sd: {name: stale[name] for name in full_sd}):
        return accel.prepare(model, mesh, spec)


@bug(
    "Accelerate's FSDP2 plugin reaching fsdp2_prepare_model without its mixed precision: fp32 throughout",
    "an FSDP2 plugin forced past Accelerate's device check without the branch's set_mixed_precision",
    ("precision", "logits", "loss"),
    world_sizes=(2, 3),
    precisions=("bf16",),
    pins=dict(_ACCEL_PINS),
    framework=_ACCEL,
)
def accel_mixed_precision_dropped(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accelerate's preparation with the plugin's mixed precision gone by the time
    `fsdp2_prepare_model` reads it (a plugin past the device check whose policy never reached
    it: the skipped branch's `set_mixed_precision` is what gives it one): `fully_shard` gets
    `MixedPrecisionPolicy()`, and the model trains in fp32 where the case says bf16."""

    def drop(accelerator, module: nn.Module) -> None:
        accelerator.state.fsdp_plugin.mixed_precision_policy = None

    return accel._prepare(model, mesh, spec, before=drop)


@contextlib.contextmanager
def _full_state_dict(replace) -> Iterator[None]:
    """While Accelerate prepares, the full state dict its `fsdp2_load_full_state_dict` gets on
    the main process is `replace(full_sd)` (the other ranks' is not read)."""
    from accelerate.utils import fsdp_utils

    original = fsdp_utils.fsdp2_load_full_state_dict

    def load(accelerator, model, full_sd, *args, **kwargs):
        if accelerator.is_main_process:
            full_sd = replace(full_sd)
        return original(accelerator, model, full_sd, *args, **kwargs)

    with mock.patch.object(fsdp_utils, "fsdp2_load_full_state_dict", load):
        yield


for _mutant in (accel_rope_buffer_left_zero, accel_full_state_dict_stale, accel_mixed_precision_dropped):
    _mutant.capabilities = accel.prepare.capabilities
