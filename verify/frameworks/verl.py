"""verl's own FSDP2 code under test: `verl.utils.fsdp_utils.apply_fsdp2`, its
`fsdp2_load_full_state_dict` and `fsdp2_clip_grad_norm_` (verl 0.9.1), unchanged, called as
verl's FSDP engine calls them (verl/workers/engine/fsdp/transformer_impl.py, strategy "fsdp2"):
`full_state = module.state_dict()`, `apply_fsdp2(module, fsdp_kwargs, engine_config)`,
`fsdp2_load_full_state_dict(module, full_state, fsdp_mesh, offload_policy)`, and its clip. The
toolkit runs that as a user's engine (`fsdp-verify check --framework verl`:
verify/frameworks/__init__.py; docs/frameworks/verl.md).

verl is not a dependency of the toolkit (`pip install --no-deps verl==0.9.1`), and its package
imports Ray, omegaconf, tensordict and more at import. Only `verl.utils.fsdp_utils` is imported,
with stubs for what it does not use on this path (`import_fsdp_utils`):

- `verl` and `verl.utils`: their package `__init__`s are skipped (`verl/__init__.py` imports
  `verl.protocol`, which imports Ray; `verl/utils/__init__.py` imports its config and tokenizer
  helpers); the modules under them load from verl's own files as they are.
- `verl.utils.model`: imports tensordict and transformers' auto classes; fsdp_utils takes
  `check_exclude_modules` and `check_target_modules` from it, for its LoRA wrap policy only.
- `peft.utils.save_and_load.get_peft_model_state_dict`, where peft is not installed: LoRA only.

What differs from verl on a GPU, and why:

- the device: verl resolves its platform once (`verl.plugin.platform.get_platform`) and, with no
  accelerator, falls back to "nvidia", whose `current_device()` is `torch.cuda.current_device()`:
  `fsdp2_load_full_state_dict` moves the model to `get_device_id()` and `fsdp2_clip_grad_norm_`
  the norm, so both stop there ("Torch not compiled with CUDA enabled"). A CPU platform is given
  to verl through its own extension point (`PlatformRegistry.register(platform="cpu")` and
  `set_platform`, as an out-of-tree platform plugin registers itself), its device "cpu" and its
  `current_device()` "cpu" (a string: `tensor.to(0)` is cuda:0). verl's code is unchanged.
- the weights: verl builds the model on rank 0 and, under `init_empty_weights`, on the meta
  device elsewhere (`get_init_weight_context_manager`, untied models); the toolkit builds it on
  every rank, so the engine moves every other rank's parameters to the meta device first: what
  they train from is what verl's load broadcast (DCP's `set_model_state_dict(...,
  broadcast_from_rank0=True)`, then each buffer).

verl's units: each module of the wrap classes (`_no_split_modules` by default), each
`nn.Embedding` and each module named `embed_tokens` or `lm_head` (neither when tied), then the
root; every unit with the case's `reshard_after_forward` and MixedPrecisionPolicy (verl's has
`cast_forward_inputs=True` and no output_dtype: the preset's precision says so).
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.validation import CaseError

VERSION = "0.9.1"
DEFAULT_MODEL = "fsdp_verify.models.hf:tiny_llama"
# What `import_fsdp_utils` put in place of what verl.utils.fsdp_utils does not use here.
STUBBED: list[str] = []


def import_fsdp_utils():
    """`verl.utils.fsdp_utils`, imported alone (see the module docstring), and verl's platform set
    to the CPU one. Raises ImportError naming the install when verl is not there."""
    if "verl.utils.fsdp_utils" in sys.modules:
        return sys.modules["verl.utils.fsdp_utils"]
    STUBBED.clear()  # what this import takes (a second import, fsdp_utils dropped, takes it again)
    spec = importlib.util.find_spec("verl")
    if spec is None or spec.origin is None:
        raise ImportError(f"verl is not installed: pip install --no-deps verl=={VERSION} (docs/frameworks/verl.md)")
    root = os.path.dirname(spec.origin)
    _package("verl", root, "its __init__ imports verl.protocol, which imports ray")
    _package("verl.utils", os.path.join(root, "utils"), "its __init__ imports verl's config and tokenizer helpers")
    model = _stub("verl.utils.model", "imports tensordict; fsdp_utils takes two LoRA helpers from it")
    model.check_exclude_modules = model.check_target_modules = _unused("verl.utils.model")
    peft_stubs = ()
    if importlib.util.find_spec("peft") is None:
        peft_stubs = ("peft", "peft.utils", "peft.utils.save_and_load")
        for name in peft_stubs[:-1]:
            _stub(name, "")
        peft = _stub(peft_stubs[-1], "peft is not installed; fsdp_utils uses it for LoRA only")
        peft.get_peft_model_state_dict = _unused("peft")
    _cpu_platform()
    try:
        import verl.utils.fsdp_utils as fsdp_utils
    finally:
        # fsdp_utils holds the name it took; peft stays absent for everything else in the process
        # (transformers asks whether peft is installed, and a stub would answer yes)
        for name in peft_stubs:
            sys.modules.pop(name, None)
    return fsdp_utils


def _package(name: str, path: str, why: str) -> None:
    module = types.ModuleType(name)
    module.__path__ = [path]
    # a spec as the real package's (its origin and folder): find_spec("verl") after this reads
    # the same root, so a second import (fsdp_utils dropped from sys.modules) finds verl again
    spec = importlib.machinery.ModuleSpec(name, None, origin=os.path.join(path, "__init__.py"), is_package=True)
    spec.submodule_search_locations = [path]
    module.__spec__ = spec
    sys.modules[name] = module
    STUBBED.append(f"{name} (package __init__ skipped: {why})")


def _stub(name: str, why: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)  # importlib.util.find_spec reads it
    sys.modules[name] = module
    if why:
        STUBBED.append(f"{name} ({why})")
    return module


def _unused(where: str):
    def unused(*args, **kwargs):
        raise RuntimeError(f"{where} is stubbed by fsdp_verify.frameworks.verl: not on apply_fsdp2's path")

    return unused


def _cpu_platform() -> None:
    """verl's platform for this machine: registered and set through verl's own hooks."""
    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry, set_platform

    @PlatformRegistry.register(platform="cpu")
    class PlatformCPU(PlatformBase):
        """The CPU as a verl platform: what fsdp_utils asks of one (its device and current device)."""

        device_name = "cpu"
        vendor_name = "cpu"
        device_module = torch.cpu
        is_available = staticmethod(lambda: True)
        current_device = staticmethod(lambda: "cpu")  # `.to(get_device_id())`: the CPU, not cuda:0
        device_count = staticmethod(lambda: 1)
        set_device = staticmethod(lambda index: None)
        synchronize = staticmethod(lambda index=None: None)
        manual_seed = staticmethod(torch.manual_seed)
        manual_seed_all = staticmethod(torch.manual_seed)
        set_allocator_settings = staticmethod(lambda settings: None)
        empty_cache = staticmethod(lambda: None)
        get_device_capability = staticmethod(lambda index=0: (None, None))
        communication_backend_name = staticmethod(lambda: "gloo")
        visible_devices_envvar = staticmethod(lambda: "CUDA_VISIBLE_DEVICES")
        nvtx_range = staticmethod(lambda msg: contextlib.nullcontext())
        profiler_start = staticmethod(lambda: None)
        profiler_stop = staticmethod(lambda: None)
        ray_resource_name = staticmethod(lambda: "CPU")
        ray_noset_envvars = staticmethod(lambda: [])
        is_ipc_supported = staticmethod(lambda: False)
        cudart = staticmethod(lambda: None)

    set_platform(PlatformCPU())
    STUBBED.append("verl's platform: PlatformCPU, registered as 'cpu' and set (verl.plugin.platform)")


def apply(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """verl's FSDP2 path on this rank's model (see the module docstring)."""
    fsdp_utils = import_fsdp_utils()
    case = spec.case
    if len(mesh.shape) != 1:  # Capabilities(mesh_dims=(1,)) refuses this before any rank starts
        raise CaseError("mesh_shape", "a 1-D mesh: what this verl engine takes", tuple(mesh.shape))
    tied = _tied(model)
    if torch.distributed.get_rank() != 0 and not tied:  # verl: init_empty_weights off rank 0, untied only
        _params_on_meta(model)
    fsdp_kwargs = {
        "mesh": mesh,
        "mp_policy": spec.mp_policy,
        "offload_policy": None,
        "reshard_after_forward": spec.reshard_after_forward,
    }
    config = {"wrap_policy": {"transformer_layer_cls_to_wrap": wrap_classes(case)}, "forward_prefetch": False}
    full_state = model.state_dict()
    fsdp_utils.apply_fsdp2(model, fsdp_kwargs, config)
    fsdp_utils.fsdp2_load_full_state_dict(model, full_state, mesh, None)
    model.verify_view = lambda: VerlView(model)
    return model


def _tied(model: nn.Module) -> bool:
    return bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))


def _params_on_meta(model: nn.Module) -> None:
    """What accelerate's `init_empty_weights` builds: the parameters on the meta device, the
    buffers real."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None:
                module._parameters[name] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)


class VerlView(EngineView):
    """FSDP2's view, with verl's clip: `fsdp2_clip_grad_norm_(module.parameters(), max_norm)`, as
    verl's FSDP engine calls it; the total norm it returns, whole."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        fsdp_utils = import_fsdp_utils()
        norm = fsdp_utils.fsdp2_clip_grad_norm_(self.module.parameters(), max_norm=max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


apply.capabilities = Capabilities(mesh_dims=(1,))


def wrap_classes(case) -> list[str]:
    """The `transformer_layer_cls_to_wrap` of verl's engine config, read from the case's plan:
    the classes of its units other than the embeddings, the head and the root."""
    from fsdp_verify.models.custom import info

    classes = info(case.model).classes
    return sorted({classes[u] for u in case.wrap_plan if u and u.rsplit(".", 1)[-1] not in ("embed_tokens", "lm_head")})


def plan_of(model_spec) -> tuple[str, ...]:
    """The units `apply_fsdp2` makes (verl 0.9.1) for a transformers model, in its order: each
    module of `_no_split_modules`, each nn.Embedding and each module named embed_tokens or
    lm_head (neither when the embeddings are tied), then the root."""
    from fsdp_verify.models.custom import construct

    with torch.device("meta"):
        model = construct(model_spec)
    wanted = set(getattr(model, "_no_split_modules", None) or [])
    if not wanted:
        raise CaseError(
            "model", "a transformers model with _no_split_modules (verl's wrap classes)", model_spec.factory
        )
    tied = _tied(model)
    units = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        by_name = not tied and leaf in ("embed_tokens", "lm_head") and hasattr(module, "weight")
        if name and (type(module).__name__ in wanted or (isinstance(module, nn.Embedding) and not tied) or by_name):
            units.append(name)
    return (*units, "")


def preset(model: str, kwargs: dict[str, Any], seq_len: int | None = None) -> dict[str, Any]:
    """The case fields of a verl run of `model` (a transformers factory; default the tiny Llama):
    its factory, verl's units, this engine, verl's MixedPrecisionPolicy's `cast_forward_inputs`
    and its absent output_dtype."""
    from fsdp_verify.models import ModelSpec

    spec = ModelSpec(kind="custom", factory=model, kwargs=dict(kwargs), **_seq(seq_len))
    return {
        "model": spec,
        "wrap": plan_of(spec),
        "engine": "fsdp_verify.frameworks.verl:apply",
        "precision.cast_forward_inputs": True,
        "precision.output_dtype": None,
    }


def _seq(seq_len: int | None) -> dict[str, int]:
    return {} if seq_len is None else {"seq_len": seq_len}
