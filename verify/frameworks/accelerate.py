"""Accelerate's own FSDP2 preparation under test: `accelerate.utils.fsdp_utils.fsdp2_prepare_model`
(accelerate 1.15.0), unchanged, on the rank's model, with a real `FullyShardedDataParallelPlugin(
fsdp_version=2)` built from the case and a real `Accelerator`; so Accelerate's transformer-based
auto-wrap policy, its `[final norm, output head]` and input-embedding units, its mixed precision,
and `fsdp2_load_full_state_dict` (rank 0's full state dict broadcast into the sharded model, the
`cpu_ram_efficient_loading` path) all run as Accelerate runs them. The toolkit runs that as a
user's engine (`fsdp-verify check --framework accelerate`: verify/frameworks/__init__.py), against
its one-device reference, with every record and contract (docs/frameworks/accelerate.md).

What differs from `accelerator.prepare(model, optimizer)` on a GPU, and why:

- the device check. `AcceleratorState.__init__` turns an `fsdp_plugin` into
  `DistributedType.FSDP` only when the process's distributed type is one of its accelerators'
  (`MULTI_GPU`, `MULTI_NPU`, `MULTI_XPU`, ...: accelerate/state.py); on a CPU-only machine
  `Accelerator(cpu=True, fsdp_plugin=...)` is `MULTI_CPU` and the plugin is ignored (the
  DistributedDataParallel fallback docs/accelerate.md records). The engine builds that real
  `Accelerator(cpu=True, ...)` and then does what the skipped branch does, nothing more:
  `state.distributed_type = DistributedType.FSDP`, `state.fsdp_plugin = plugin`, and the plugin's
  `set_mixed_precision(state.mixed_precision)` where that is not "no" (a no-op beside an explicit
  policy, which this engine always gives).
- the mesh. Accelerate shards over `accelerator.torch_device_mesh[parallelism_config.
  fsdp_dim_names]`; the engine hands it the toolkit's own mesh, its process groups unchanged,
  with Accelerate's dim name (`DeviceMesh.from_group(..., mesh_dim_names=("dp_shard_cp",))`) as
  `ParallelismConfig.device_mesh`, which `Accelerator` then takes instead of building one.
- the weights. Under `cpu_ram_efficient_loading` transformers' `from_pretrained` (5.24) loads the
  checkpoint on rank 0 alone and leaves the other ranks' parameters on the meta device
  (`_move_missing_keys_from_meta_to_device`), their non-persistent buffers computed. The
  toolkit builds the same model on every rank; the engine moves every other rank's parameters
  and persistent buffers to the meta device first, so that every value they train from came
  through Accelerate's broadcast.
- the optimizer. `Accelerator._prepare_fsdp2` also swaps the optimizer's parameters for the
  sharded ones; the toolkit builds its optimizer after the engine, from the sharded module, so
  there is nothing to swap. Activation checkpointing and compile are the loop's (not Accelerate's).

Accelerate's units: each module of the wrap classes (the plan's blocks), then the input
embeddings (unless tied to the head), then one unit over `[final norm, output head]`
(`[final norm, embeddings, head]` when tied) with `reshard_after_forward=False`, then the root
with FSDP2's default (False for a root); `plan_of` names them. The gradients are FSDP2's
average (Accelerate leaves the divide factor alone) and the clip is Accelerate's
(`accelerator.clip_grad_norm_`, its `_clip_grad_norm_dtensor_aware`).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.engines.capabilities import Capabilities
from fsdp_verify.engines.spec import ShardSpec
from fsdp_verify.engines.view import EngineView
from fsdp_verify.integrations import require
from fsdp_verify.validation import CaseError

# `--framework accelerate` without `--model`: the tiny transformers Llama (verify/models/hf.py).
DEFAULT_MODEL = "fsdp_verify.models.hf:tiny_llama"


def prepare(model: nn.Module, mesh: DeviceMesh, spec: ShardSpec) -> nn.Module:
    """Accelerate's `fsdp2_prepare_model(accelerator, model)` on this rank's model, its
    accelerator and plugin built from `spec` (see the module docstring), after the model is laid
    out as `from_pretrained` lays it out under `cpu_ram_efficient_loading`."""
    return _prepare(model, mesh, spec)


def _prepare(
    model: nn.Module,
    mesh: DeviceMesh,
    spec: ShardSpec,
    before: Callable[[Any, nn.Module], None] | None = None,
    **plugin_options: Any,
) -> nn.Module:
    """`prepare`, with `plugin_options` over the plugin's fields and `before(accelerator, model)`
    run just before `fsdp2_prepare_model` (the zoo's mutants change one thing: verify/zoo/accelerate.py)."""
    require("accelerate", "accelerate")
    from accelerate.utils.fsdp_utils import fsdp2_prepare_model

    accelerator = accelerator_for(mesh, spec, **plugin_options)
    if accelerator.state.fsdp_plugin.cpu_ram_efficient_loading and not accelerator.is_main_process:
        on_meta_but_computed_buffers(model)
    if before is not None:
        before(accelerator, model)
    model = fsdp2_prepare_model(accelerator, model)
    accelerator._models.append(model)  # as `_prepare_fsdp2` does: its clip looks the model up there
    model.verify_view = lambda: AccelerateView(model, accelerator)
    return model


def accelerator_for(mesh: DeviceMesh, spec: ShardSpec, **plugin_options: Any):
    """A real `Accelerator(cpu=True, mixed_precision=..., fsdp_plugin=..., parallelism_config=...)`
    on the toolkit's mesh, past the device check (see the module docstring). Accelerate's state is
    a per-process singleton (`AcceleratorState`, `PartialState`, `GradientState`): it is reset
    first, as Accelerate's own tests reset it between cases, since a rank runs many cases."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState
    from accelerate.utils import DistributedType, ParallelismConfig

    case = spec.case
    if len(mesh.shape) != 1:  # Capabilities(mesh_dims=(1,)) refuses this before any rank starts
        raise CaseError("mesh_shape", "a 1-D mesh: what this Accelerate engine takes", tuple(mesh.shape))
    plugin = plugin_for(spec, **plugin_options)
    config = ParallelismConfig(dp_shard_size=mesh.size())
    config.device_mesh = DeviceMesh.from_group(
        mesh.get_group(0), mesh.device_type, mesh.mesh, mesh_dim_names=tuple(config.fsdp_dim_names)
    )
    # Accelerator's own mixed_precision as a bf16 run sets it; the policy itself is the case's, on
    # the plugin. Not "fp16": that brings Accelerate's GradScaler, which its clip would unscale by
    # beside the toolkit's loss scaling; an fp16 policy runs under "no", as Accelerate allows.
    mixed = "bf16" if case is not None and case.precision.param_dtype == "bf16" else "no"
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    with _process_untouched():
        accelerator = Accelerator(cpu=True, mixed_precision=mixed, fsdp_plugin=plugin)
    # The branch of AcceleratorState.__init__ that the device check skips on a CPU (state.py):
    state = accelerator.state
    state.distributed_type = DistributedType.FSDP
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    # Then what Accelerator.__init__ does with a parallelism_config, now that the state is FSDP2's
    # (given to the constructor, `_validate_accelerator` refuses MULTI_CPU: a second device check).
    state.parallelism_config = config
    state.device_mesh = config.get_device_mesh(mesh.device_type)
    config._validate_accelerator(accelerator)
    if not accelerator.is_fsdp2:
        raise RuntimeError(f"Accelerate did not take FSDP2 past its device check ({state.distributed_type})")
    return accelerator


def plugin_for(spec: ShardSpec, **options: Any):
    """`FullyShardedDataParallelPlugin(fsdp_version=2, ...)` for the case: transformer-based
    auto-wrap by the class names of the plan's blocks, the case's MixedPrecisionPolicy, its
    (bool) `reshard_after_forward`, and `cpu_ram_efficient_loading=True` (rank 0's full state
    dict broadcast into the sharded model). `options` replace fields."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    rsf = spec.reshard_after_forward
    if not isinstance(rsf, bool):  # Capabilities(reshard_ints=False) refuses it in the parent
        raise CaseError("reshard_after_forward", "true or false: Accelerate's FSDP2 plugin takes a bool", rsf)
    fields = {
        "fsdp_version": 2,
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": wrap_classes(spec),
        "reshard_after_forward": rsf,
        "mixed_precision_policy": spec.mp_policy,
        "cpu_ram_efficient_loading": True,
        **options,
    }
    with _process_untouched():  # the plugin writes FSDP_CPU_RAM_EFFICIENT_LOADING into os.environ
        return FullyShardedDataParallelPlugin(**fields)


def wrap_classes(spec: ShardSpec) -> list[str]:
    """The plugin's `transformer_cls_names_to_wrap`, read from the case's plan: the classes of its
    units of one module other than the input embeddings and the root (`plan_of` writes the plan
    so). Accelerate's policy then wraps every module of those classes: a plan that names some of
    a class's modules but not all is caught by the ownership check, as it should be."""
    from fsdp_verify.units import is_group

    case = spec.case
    if case is None:
        raise CaseError("engine", "a ShardSpec with its case (the Accelerate engine reads the model's classes)", None)
    classes = _layout(case.model)["classes"]
    embed = _input_embeddings(case.model)
    return sorted({classes[u] for u in spec.wrap if u and not is_group(u) and u != embed})


def on_meta_but_computed_buffers(model: nn.Module) -> None:
    """What transformers' `from_pretrained` leaves on a rank other than 0 under
    `cpu_ram_efficient_loading`: parameters and persistent buffers on the meta device (the
    checkpoint is read on rank 0 only), non-persistent buffers (RoPE's inverse frequencies)
    computed. Tied weights tied again (`tie_weights`), as Accelerate does after its own move."""
    from accelerate.utils.modeling import get_non_persistent_buffers

    names = get_non_persistent_buffers(model, recurse=True, fqns=True)
    computed = {n: b for n, b in model.named_buffers() if n in names}
    model.to(torch.device("meta"))
    for name, buffer in computed.items():
        parent, _, local = name.rpartition(".")
        model.get_submodule(parent).register_buffer(local, buffer, persistent=False)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


@contextlib.contextmanager
def _process_untouched() -> Iterator[None]:
    """What building an Accelerator or a plugin changes in the process beyond Accelerate's own
    state, put back: `os.environ` (ACCELERATE_USE_FSDP, FSDP_CPU_RAM_EFFICIENT_LOADING, a default
    MASTER_PORT) and torch's thread count (on `MULTI_CPU` without OMP_NUM_THREADS it sets the
    physical cores over the local ranks, with a warning; a rank runs on one thread)."""
    environ, threads = dict(os.environ), torch.get_num_threads()
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    try:
        yield
    finally:
        for name in set(os.environ) - set(environ):
            del os.environ[name]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        torch.set_num_threads(threads)


class AccelerateView(EngineView):
    """FSDP2's view, with Accelerate's clip: `accelerator.clip_grad_norm_(model.parameters(),
    max_norm)`, as an Accelerate loop calls it (its FSDP2 branch: `_clip_grad_norm_dtensor_aware`);
    the total norm it returns, whole."""

    def __init__(self, module: nn.Module, accelerator):
        super().__init__(module)
        self.accelerator = accelerator

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        norm = self.accelerator.clip_grad_norm_(self.module.parameters(), max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm


# Accelerate shards [norm, head] as one unit (a list given to fully_shard); its plugin takes a bool
# reshard_after_forward only; its mesh here is the toolkit's 1-D mesh (HSDP: docs/frameworks/accelerate.md).
# reshard_per_unit: Accelerate decides its tail's itself ("Tail gets False": [norm, lm_head] stays
# unsharded from forward to backward whatever the plugin says), so the contracts take each unit's
# reshard as fsdp2_prepare_model built it.
prepare.capabilities = Capabilities(mesh_dims=(1,), takes=("groups",), reshard_ints=False, reshard_per_unit=True)


def _input_embeddings(model_spec) -> str | None:
    return _layout(model_spec)["embed"]


@functools.lru_cache(maxsize=16)
def _layout(model_spec) -> dict[str, Any]:
    """The module names Accelerate's code picks, read from a meta-device build: the input and
    output embeddings (`get_input_embeddings`, `get_output_embeddings`), whether they are tied,
    the final norm (the last direct child of the base model whose class name has "Norm"), the
    model's `_no_split_modules`, and every module's class."""
    from fsdp_verify.models.custom import construct

    with torch.device("meta"):
        model = construct(model_spec)
    names = {id(m): n for n, m in model.named_modules()}
    inputs = getattr(model, "get_input_embeddings", lambda: None)()
    outputs = getattr(model, "get_output_embeddings", lambda: None)()
    tied = inputs is not None and outputs is not None and inputs.weight is outputs.weight
    prefix = getattr(model, "base_model_prefix", "")
    base = getattr(model, prefix, None) if prefix else model
    norm = None
    if isinstance(base, nn.Module):
        for module in base.children():
            if "Norm" in type(module).__name__:
                norm = module
    return {
        "embed": names.get(id(inputs)) if inputs is not None else None,
        "head": names.get(id(outputs)) if outputs is not None else None,
        "norm": names.get(id(norm)) if norm is not None else None,
        "tied": tied,
        "no_split": list(getattr(model, "_no_split_modules", None) or []),
        "classes": {n: type(m).__name__ for n, m in model.named_modules()},
    }


def plan_of(model_spec, classes: list[str] | None = None) -> tuple[str, ...]:
    """The units `fsdp2_prepare_model` makes (accelerate 1.15.0) for this model, children first:
    each module of `classes` (default: the model's `_no_split_modules`, as Accelerate's
    transformer-based policy defaults), the input embeddings, the group [final norm, output head],
    the root. A tied model is refused (its group [final norm, embeddings, head] is not in the
    model's order, which a plan's group must be: verify/case_rules.py)."""
    from fsdp_verify.units import group

    layout = _layout(model_spec)
    wanted = set(classes if classes is not None else layout["no_split"])
    if not wanted:
        raise CaseError("model", "a transformers model with _no_split_modules (Accelerate's wrap classes)", None)
    if layout["tied"]:
        raise CaseError(
            "model",
            "a model whose output head is not tied to its input embeddings: Accelerate shards a tied model's"
            " [final norm, embeddings, head] in that order, and a plan spells a group in the model's order"
            " (docs/frameworks/accelerate.md)",
            model_spec.factory,
        )
    blocks = tuple(n for n, c in layout["classes"].items() if n and c in wanted)
    tail = [m for m in (layout["norm"], layout["head"]) if m is not None and m not in blocks]
    embed = () if layout["embed"] is None else (layout["embed"],)
    return (*blocks, *embed, *((group(tail),) if tail else ()), "")


def preset(model: str, kwargs: dict[str, Any], seq_len: int | None = None) -> dict[str, Any]:
    """The case fields of an Accelerate run of `model` (an import path of a transformers
    factory; default the tiny Llama): its factory and kwargs, Accelerate's units for it, this
    engine, `reshard_after_forward` false. The loss, the reduction (FSDP2's average: Accelerate
    leaves the divide factor alone) and the precision are the case's."""
    from fsdp_verify.models import ModelSpec

    length = {} if seq_len is None else {"seq_len": seq_len}
    spec = ModelSpec(kind="custom", factory=model, kwargs=dict(kwargs), **length)
    return {
        "model": spec,
        "wrap": plan_of(spec),
        "engine": "fsdp_verify.frameworks.accelerate:prepare",
        # Accelerate keeps its [norm, head] unit unsharded after forward whatever the plugin says
        # (fsdp_utils.py: "Tail gets False"), and the case has one reshard_after_forward for every
        # unit: with False the case describes every unit Accelerate builds, so the communication
        # and memory contracts hold it; --reshard-after-forward true runs Accelerate's default, its
        # blocks resharded and its tail not, which the contracts take per unit as it built them
        # (Capabilities(reshard_per_unit=True); docs/frameworks/accelerate.md).
        "reshard_after_forward": False,
    }
