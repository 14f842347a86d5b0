"""The reference's model as FSDP2 presents it to the forward: built as the case says, its units'
hooks (the input casts of a mixed-precision policy, FSDP2's identity node on unit inputs), compiled
as the sharded run compiles it."""

from __future__ import annotations

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from fsdp_verify.case import Case
from fsdp_verify.dims import registry
from fsdp_verify.dtypes import to_torch
from fsdp_verify.engines import engine_capabilities
from fsdp_verify.engines.arithmetic import Arithmetic
from fsdp_verify.models import build_model, is_ignored
from fsdp_verify.reference.pipeline_parallel import staged_forward
from fsdp_verify.training.casts import cast_floats
from fsdp_verify.training.checkpointing import checkpoint_units, without_kv_cache
from fsdp_verify.units import modules_of, owner_of_param


def reference_model(
    case: Case, arithmetic: Arithmetic, unit_input_node: bool | None = None, compiled: bool = True
) -> nn.Module:
    """The case's model as built (eager, from its seed) with the casts and the unit-input node of
    the engine's arithmetic installed, compiled as the case compiles (`compiled=False`: eager):
    what every reference run computes with."""
    model = build_model(case.model, case.seed, init="eager")
    registry.call(case, "convert_reference", model)  # the dimension packages' conversions (float8)
    compile_it = case.compile is not None and compiled
    if case.activation_checkpointing:
        # Eager, the reference never checkpoints (recomputation must not change a value), but it runs
        # the forward the ranks run: with the KV cache the ranks turn off (verify/training/checkpointing.py).
        without_kv_cache(model)
        if compile_it:
            # Compiled, it does: the backward graph then recomputes the forward inside it, fused
            # otherwise than the forward graph (bf16 gradients one ulp apart from an uncheckpointed
            # compiled run's, measured); the same units checkpointed give the ranks' graphs.
            checkpoint_units(model, case.wrap_plan)
    _install_precision_hooks(
        model,
        case,
        arithmetic.unit_input_node if unit_input_node is None else unit_input_node,
        arithmetic.casts_inputs_without_params,
    )
    if compile_it:
        _compile_as_sharded(model, case)
    return model


def _compile_as_sharded(model: nn.Module, case: Case) -> None:
    """The reference compiled as the engine compiles the ranks' model (verify/training/compile.py:
    each unit but the root, or the whole model, in place), so that both run the same graphs. FSDP2
    runs its pre- and post-forward hooks outside any graph (`_dynamo_disable`): under "model" the
    graph breaks at every inner unit. The hooks standing for them here (the casts, the unit-input
    node) run outside the graphs likewise, and a unit without any gets an empty pair, so the graphs
    break at the same places and hold the same operations."""
    import torch._dynamo

    from fsdp_verify.training.compile import compile_in_place

    empty = torch._dynamo.disable(_nothing, recursive=True)
    for unit in case.wrap_plan:
        for module in modules_of(model, unit):
            _as_unit_class(module)
            for hooks in (module._forward_pre_hooks, module._forward_hooks):
                for key, hook in list(hooks.items()):
                    hooks[key] = torch._dynamo.disable(hook, recursive=True)
            module.register_forward_pre_hook(empty)
            module.register_forward_hook(empty)
    # Under pp only units and blocks compile (verify/dims/together.py): the same modules as each
    # stage's. With the engine's `dynamic` (torchtitan's: torch's automatic dynamic shapes).
    compile_in_place(case, model, dynamic=engine_capabilities(case.engine).compile_dynamic)


# FSDP2 makes each unit an instance of a class of its own, `FSDP<class>` (one per original class,
# fully_shard's `cls_to_fsdp_cls`), and Dynamo guards a graph on its modules' types. So a module of
# a compiled unit's class that is not a unit (or a unit that is not) fails the guards of a graph
# traced through the other and is compiled afresh: in a sharded run, `layers.1` (whose
# `attention_norm` is no unit) gets a graph of its own where `layers.0.attention_norm` is one. With
# the classes as built, the reference's `layers.1` passed the guards of `layers.0`'s graphs and ran
# its norm eagerly between them: other graphs than the ranks', and under AOTAutograd, whose
# decompositions round otherwise than eager autograd, other gradients (fuzz seed 20270408, case
# 2d78feb47bc4, 1.75x; regression 2d78feb47bc4). The units' classes changed the same way give the
# same guards, so the same graphs. And the class's module is not `torch.nn`'s (FSDP2's are
# torch.distributed's): Dynamo traces an inbuilt torch.nn module's `forward` as a frame of its own
# (after its `_call_impl` is skipped) only where the module's class is from `torch.nn.` and it has
# hooks (torch 2.13, `trace_rules.check_verbose`), so a torch.nn leaf that is a unit (a Dropout, an
# Embedding) compiles nothing in a sharded run. The reference's, of torch.nn's class, compiled
# theirs: a Dropout unit in bf16 under AOTAutograd (its decomposition multiplies in two roundings)
# gave other gradients than the ranks' eager one (fuzz seed 20270407, case fffd3e314091, 1e3x).
_UNIT_CLASSES: dict[type, type] = {}


def _as_unit_class(module: nn.Module) -> None:
    """`module` an instance of a subclass of its class made for units, as fully_shard does."""
    cls = type(module)
    if cls in _UNIT_CLASSES.values():
        return
    if cls not in _UNIT_CLASSES:
        _UNIT_CLASSES[cls] = type(f"Unit{cls.__name__}", (cls,), {})  # of this module, as FSDP<class> of torch's
    module.__class__ = _UNIT_CLASSES[cls]


def _nothing(*_args) -> None:
    """A hook that does nothing: where FSDP2 runs its own, outside any graph."""


def _install_precision_hooks(
    model: nn.Module, case: Case, unit_input_node: bool = True, cast_units_without_params: bool = True
) -> None:
    """FSDP2 casts floating inputs of every shard unit to `param_dtype` (cast_forward_inputs) and
    its outputs to `output_dtype`; the same casts, on the same modules (FSDP1 only on the root and
    on units holding parameters of their own: `cast_units_without_params=False`). Under pipeline
    parallelism each stage is a root of its own: the model's forward runs the stages in order,
    each with the root's casts and node (reference/pipeline_parallel.py)."""
    # FSDP2 has no param group, so no post-backward node, for a unit whose parameters are all ignored
    units_with_params = {
        owner_of_param(case.wrap_plan, name)
        for name, _ in model.named_parameters()
        if not is_ignored(case.ignored, name)
    }
    # A unit over several modules (fully_shard([a, b])) casts and passes through the node at each
    # member's forward (its pre-forward fires per member: torch's _register_group_forward_hooks).
    for fqn in case.wrap_plan if case.pp == 1 else case.wrap_plan[:-1]:
        casts = cast_units_without_params or fqn == "" or fqn in units_with_params
        for module in modules_of(model, fqn):
            _unit_hooks(module, case.precision, casts, unit_input_node and fqn in units_with_params)
    if case.pp > 1:
        for stage, owns_params in staged_forward(model, case):
            _unit_hooks(stage, case.precision, True, unit_input_node and owns_params)


def _unit_hooks(module: nn.Module, policy, casts: bool, node: bool) -> None:
    """One unit's hooks: its inputs cast to `param_dtype` (where it `casts`), its output to
    `output_dtype`, its inputs through FSDP2's post-backward node (`node`)."""
    param_dtype, output_dtype = to_torch(policy.param_dtype), to_torch(policy.output_dtype)
    if policy.cast_forward_inputs and param_dtype is not None and casts:
        module.register_forward_pre_hook(
            lambda _m, args, kw, d=param_dtype: (cast_floats(args, d), cast_floats(kw, d)), with_kwargs=True
        )
    if output_dtype is not None:
        module.register_forward_hook(lambda _m, _a, out, d=output_dtype: cast_floats(out, d))
    if node:
        module.register_forward_pre_hook(_post_backward_node, with_kwargs=True)


class _PostBackwardNode(torch.autograd.Function):
    """Identity, as FSDP2's RegisterPostBackwardFunction: after casting a unit's inputs, FSDP2
    passes those that require grad through this one autograd node (to run its post-backward).
    It regroups the gradient sum of a tensor with several consumers: the residual stream `x`
    feeds both `x + ...` and a wrapped RMSNorm that reads `x.float()` twice, so without the node
    autograd adds three bf16 contributions in one order and with it the two inside the unit
    first (one bf16 ulp apart in the embedding's gradient). The same node here, on the same
    inputs of the same units (those managing parameters: FSDP2 has no param group otherwise)."""

    @staticmethod
    def forward(ctx, *inputs: torch.Tensor):
        return inputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor):
        return grads


def _post_backward_node(_module: nn.Module, args: tuple, kwargs: dict):
    flat, spec = tree_flatten((args, kwargs))
    where = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
    if not where or not torch.is_grad_enabled():
        return None
    for i, t in zip(where, _PostBackwardNode.apply(*[flat[i] for i in where])):
        flat[i] = t
    return tree_unflatten(flat, spec)
