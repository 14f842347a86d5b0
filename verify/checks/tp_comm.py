"""Tensor parallelism's collectives per layer, as the communication contract expects them
(verify/checks/comm.py holds FSDP2's over the data-parallel dims beside them).

Each style of the case's plan issues its collectives over the mesh's "tp" dim where its layouts
change (torch 2.13's ParallelStyles and DTensor redistributions; measured on CPU/gloo with the
probe, verify/probes/comm.py). Bytes are the full side of the activation (an all-gather's output,
a reduce-scatter's input, an all-reduce's tensor): tokens x features of one micro-batch of one
data-parallel rank, in the dtype of the tensor that reaches the collective (see "Dtypes" below):

| style (module)                 | forward                                  | backward (where the input / output needs a gradient) |
|--------------------------------|------------------------------------------|-------------------------------------------|
| Colwise (Linear), input local  | input Shard(1): all_gather of the input   | input Replicate: all_reduce of its grad;   |
|                                |                                          | Shard(1): reduce_scatter of its grad       |
| Colwise, output Replicate      | all_gather of the output                 | -                                          |
| Rowwise (Linear)               | output Replicate: all_reduce; Shard(1):  | Shard(1) output: all_gather of its grad;   |
|                                | reduce_scatter of the output             | input Replicate: all_gather of its grad    |
| Rowwise (Embedding)            | as a rowwise Linear's output (MaskPartial) | as a rowwise Linear's output               |
| PrepareModuleInput             | Shard(1) -> Replicate: all_gather        | reduce_scatter of the grad                 |
| SequenceParallel (norm)        | -                                        | the weight's partial gradient all-reduced  |
|                                |                                          | (FSDP2's post-backward, where it reduces)  |
| loss parallelism               | -                                        | 3 all_reduces fp32, 4 B a token: the max,  |
|                                |                                          | the sum of exponentials, the target's      |
|                                |                                          | log-probability (the loss runs after the   |
|                                |                                          | forward window closes)                     |

A colwise linear whose input comes from a PrepareModuleInput (a DTensor already, Replicate)
issues nothing for it: the gradients of the modules sharing that input add up as one Partial
DTensor, reduce-scattered once by the PrepareModuleInput's backward. A rowwise bias is added as
each rank's share (Replicate -> Partial, no collective). The norm's gradient sum is FSDP2's, on
the unsharded gradient before its reduce-scatter: the model says `reduce_dtype` (torch 2.13 sums
in param_dtype: pytorch/pytorch#190626, not drawn), once per synced micro-batch (a no-sync
micro-batch accumulates the Partial gradient), at every shard group size. Under activation
checkpointing a checkpointed unit that backward runs through runs its forward again there, and
its layers' forward collectives with it (in the backward window), up to where torch's
non-reentrant checkpoint stops the recompute early (once every tensor backward saved is back:
measured, a block's last rowwise all-reduce or reduce-scatter feeds only the residual add and is
not issued again, an MLP's gathered output neither), so those are allowed, not required
(`optional`, as comm.py's re-issued prefetch); nested checkpointed units are not modelled
(`underivable`). The clip's stacked
norms are all-reduced over tp (4 B a parameter with a gradient) when some gradient is split over
tp; a norm replicated over tp needs none.

Dtypes: a style's collective carries the tensor its hook redistributes, in the dtype that tensor
has there, not the case's headline dtype. FSDP2's hooks sit around the styles' (tp is applied
before `fully_shard`; FSDP2 registers its pre-forward hook with `prepend=True` and its
post-forward hook after the styles' output hooks, torch 2.13 `FSDPState.init`): a unit's inputs
are cast to param_dtype (`_cast_forward_inputs`, where `cast_forward_inputs` and param_dtype)
before a style on that module turns them into a DTensor, and a unit's outputs are cast to
`output_dtype` (`_cast_output_dtype`) after a style on it has redistributed them. So a layer's
output collectives (a rowwise partial sum, a colwise gathered output) are in its compute dtype
(the Linear or Embedding computes in its weight's dtype: param_dtype), and its input
collectives (a colwise input's gradient all-reduced, a Shard(1) input gathered, a
PrepareModuleInput's) are in the dtype its input arrives in: the `output_dtype` of the unit
that produced it (the built-in Linear casts its input to the weight's dtype only inside its
forward, after the style's hook; the cast's backward hands the gradient back in the input's
dtype, so the all-reduce runs there). Measured, torch 2.13: the MLP `layers.2.linear` in the root unit,
fed by the unit `layers.1` with output_dtype fp32 under bf16 parameters, all-reduces its input's
gradient in fp32 (tests/regressions/901b93e0a196.json, a fuzz false alarm when the model said
param_dtype). The traced forward below emulates those casts (`_fsdp2_casts`) and reads each
dtype where the style's hook sees it.

Where the activations' shapes come from: one forward of the model as built on the meta device
(a transformers model on the CPU: its masks read values),
a micro-batch of the right shape in, hooks on the plan's modules recording their inputs' and
outputs' shapes and whether they need a gradient (frozen parameters included). Only torch's own
styles on Linear, Embedding and norm modules are modelled; a user's plan (`tp_plan`: a function
or dict of the user's, whose styles may be subclasses with collectives of their own) is not, and
its tp part of the contract is n/a (`underivable`): the FSDP2 part is still held.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import nn

from fsdp_verify import units

COLLECTIVES_OVER = "tp"
LOSS_REDUCTIONS = 3  # loss_parallel(): the max, the sum of exponentials, the target's log-probability


def underivable(case) -> str | None:
    """Why this tp case's own collectives cannot be derived, or None."""
    if case.tp_plan is not None:
        return (
            "a user's tp plan (tp_plan) may bring styles of its own, whose collectives are not derived;"
            " tensor parallelism's collectives are not in the contract there"
        )
    if case.activation_checkpointing:
        names = [u for u in case.wrap_plan if u]
        if any(units.inside(b, a) for a in names for b in names):
            return (
                "nested checkpointed units recompute their layers more than once (not measured);"
                " tensor parallelism's collectives are not in the contract there"
            )
    return None


def local_shape(shape: list[int], split: int | None, tp: int) -> list[int]:
    """A parameter's shape on one tp rank: its split dim divided by tp."""
    if split is None:
        return list(shape)
    return [n // tp if d == split else n for d, n in enumerate(shape)]


def expected_tp(case, step: int, with_grad: set[str], recomputed: set[str], collective) -> list:
    """The tp group's collectives of `step` (all micro-batches), each named by its layer;
    `recomputed` the checkpointed units whose forward runs again in backward (their layers'
    forward collectives are issued again there); `collective(step, microbatch, phase, kind,
    dtype, bytes, unit, optional=False)` builds one."""
    reduce_dtype = case.precision.reduce_dtype or case.precision.param_dtype or "fp32"
    out = []
    layers = _layers(case, step)
    for m in range(case.microbatches):
        last = m == case.microbatches - 1
        synced = case.sync_every_microbatch or last
        for fqn, kind, io in layers:
            # inside a recomputed unit (a member of it, for a unit over several modules)
            again = any(units.is_ancestor(m, fqn) for u in recomputed if u for m in units.members(u))
            for phase, what, numel, dtype in io:  # dtype: what reaches the collective (module docstring)
                size = numel * _size(dtype)
                out.append(collective(step, m, phase, what, dtype, size, fqn))
                if again and phase == "forward":
                    out.append(collective(step, m, "backward", what, dtype, size, fqn, optional=True))
            if kind == "norm" and synced:
                for name, numel in _norm_weights(case, fqn):
                    if name in with_grad:
                        size = numel * _size(reduce_dtype)
                        out.append(collective(step, m, "backward", "all_reduce", reduce_dtype, size, name))
        if case.loss_parallel:
            tokens = _tokens(case)
            for _ in range(LOSS_REDUCTIONS):
                out.append(collective(step, m, "backward", "all_reduce", "fp32", 4 * tokens, "loss_parallel"))
    return out


def clip_groups(case, with_grad: set[str]) -> list[set[str]]:
    """The gradients the clip reduces together, in the order of their first parameter: one group,
    or beside tp, where the plan leaves parameters off the tp mesh (FSDP2 shards those over the
    data-parallel mesh alone), the tp mesh's and the others (`EngineView.clip_grad_norm_`)."""
    from fsdp_verify.models import parameter_names

    order = [n for n in parameter_names(case.model) if n in with_grad]
    if case.parallel.tp <= 1:
        return [set(order)]
    from fsdp_verify.engines.tensor_parallel import tp_mesh_parameters

    on = tp_mesh_parameters(case)
    groups: dict[bool, set[str]] = {}
    for n in order:
        groups.setdefault(n in on, set()).add(n)
    return list(groups.values())


def clip_over_tp(case, with_grad: set[str]) -> bool:
    """Whether the clip's stacked norms are partial over tp: some gradient is split over tp."""
    from fsdp_verify.engines.tensor_parallel import split_parameters

    return any(n in with_grad for n in split_parameters(case))


def _size(dtype: str) -> int:
    from fsdp_verify.dtypes import to_torch

    return torch.empty((), dtype=to_torch(dtype)).element_size()


def _tokens(case) -> int:
    """Rows of one micro-batch's activations on one data-parallel rank (samples x sequence)."""
    rows = case.local_batch // case.microbatches
    return rows if case.model.kind == "mlp" else rows * case.model.seq_len


def _norm_weights(case, fqn: str) -> list[tuple[str, int]]:
    """A norm's own parameters (name, elements): whole on every tp rank."""
    return list(_own_params(case.model)[fqn])


@functools.lru_cache(maxsize=64)
def _own_params(spec) -> dict[str, tuple[tuple[str, int], ...]]:
    from fsdp_verify.models import _construct

    with torch.device("meta"):
        model = _construct(spec)
    return {
        fqn: tuple((f"{fqn}.{n}", p.numel()) for n, p in m.named_parameters(recurse=False))
        for fqn, m in model.named_modules()
    }


def _layers(case, step: int) -> list[tuple[str, str, list[tuple[str, str, int, str]]]]:
    """(module, kind, [(phase, collective, elements, dtype)]) for every module of the plan, in
    plan order, at `step`: from `unfreeze_step` on nothing is frozen, so more needs a gradient (a
    frozen embedding's output under SP, all-gathered in backward once it trains). The dtype is
    the one the tensor has where the style's hook redistributes it (the module docstring's
    "Dtypes"), from the precision policy and the units that cast around the layer."""
    unfrozen = case.unfreeze_step is not None and step >= case.unfreeze_step  # as comm's `unfrozen_at`
    spec = dataclasses.replace(case.model, frozen=()) if unfrozen else case.model
    rows = case.local_batch // case.microbatches
    p = case.precision
    casts = (p.param_dtype, p.output_dtype, p.cast_forward_inputs, tuple(case.wrap_plan))
    return _layers_of(spec, case.tp, case.sequence_parallel, case.loss_parallel, rows, casts)


@functools.lru_cache(maxsize=64)
def _layers_of(
    spec, tp: int, sequence_parallel: bool, loss_parallel: bool, rows: int, casts: tuple = (None, None, True, ())
) -> tuple:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    from fsdp_verify.engines.tensor_parallel import _PlanOf

    case = _PlanOf(spec, tp, None, sequence_parallel, loss_parallel)
    model, plan, seen = _traced(case, rows, casts)
    prepared = {fqn for fqn, style in plan.items() if isinstance(style, PrepareModuleInput)}
    out = []
    for fqn, style in plan.items():
        module = model.get_submodule(fqn)
        if fqn not in seen:
            raise NotModelled(f"{fqn!r} did not run in the traced forward")
        (x_numel, x_grad, x_dtype), (y_numel, y_grad, y_dtype) = seen[fqn]
        x, y = (x_numel, x_dtype), (y_numel, y_dtype)  # a collective of the input or of the output
        io: list[tuple[str, str, int, str]] = []
        kind = "linear"
        if type(style) is ColwiseParallel and isinstance(module, nn.Linear):
            il, ol = style.input_layouts[0], style.output_layouts[0]
            from_prepared = fqn.rpartition(".")[0] in prepared  # a Replicate DTensor already
            if il == Shard(1):
                io.append(("forward", "all_gather", *x))
                if x_grad:
                    io.append(("backward", "reduce_scatter", *x))
            elif il == Replicate():
                if x_grad and not from_prepared:
                    io.append(("backward", "all_reduce", *x))
            else:
                raise NotModelled(f"{fqn!r}: ColwiseParallel from {il}")
            if ol == Replicate():
                io.append(("forward", "all_gather", *y))
            elif not isinstance(ol, Shard):
                raise NotModelled(f"{fqn!r}: ColwiseParallel to {ol}")
        elif type(style) is RowwiseParallel and isinstance(module, (nn.Linear, nn.Embedding)):
            il, ol = style.input_layouts[0], style.output_layouts[0]
            if isinstance(module, nn.Linear) and il == Replicate() and x_grad:
                io.append(("backward", "all_gather", *x))
            if ol == Replicate():
                io.append(("forward", "all_reduce", *y))
            elif ol == Shard(1):
                io.append(("forward", "reduce_scatter", *y))
                if y_grad:
                    io.append(("backward", "all_gather", *y))
            else:
                raise NotModelled(f"{fqn!r}: RowwiseParallel to {ol}")
        elif type(style) is PrepareModuleInput:
            kind = "prepare"
            for layout, desired in zip(style.input_layouts, style.desired_input_layouts):
                if layout is None or layout == desired:
                    continue
                if (layout, desired) != (Shard(1), Replicate()):
                    raise NotModelled(f"{fqn!r}: PrepareModuleInput from {layout} to {desired}")
                io.append(("forward", "all_gather", *x))
                if x_grad:
                    io.append(("backward", "reduce_scatter", *x))
        elif type(style) is SequenceParallel:
            kind = "norm"
        else:
            raise NotModelled(f"{fqn!r}: {type(style).__name__} on {type(module).__name__}")
        out.append((fqn, kind, io))
    return tuple(out)


class NotModelled(Exception):
    """A style, or a layout it changes, that the model does not derive."""


def _traced(case, rows: int, casts: tuple = (None, None, True, ())):
    """The model on the meta device, its plan, and per planned module ((input elements, input
    needs a gradient, input dtype), (output elements, output needs a gradient, output dtype))
    from one forward of `rows` samples (frozen parameters frozen, as the ranks build them), under
    FSDP2's casts (`casts`: param_dtype, output_dtype, cast_forward_inputs, the wrap plan;
    `_fsdp2_casts`). The input is read as the module's forward gets it (after every pre-hook, so
    after a unit's input cast, where a style's input hook sees it), the output as the module
    returns it (a hook registered before the unit's output cast, where a style's output hook
    sees it)."""
    from fsdp_verify.engines.tensor_parallel import plan_for
    from fsdp_verify.models import _construct, is_frozen

    spec = case.model
    # a transformers model builds its masks from the values (`.item()`): it runs on the CPU, as
    # tiny as the case builds it; the built-in models on the meta device
    device = "cpu" if spec.is_custom else "meta"
    with torch.device(device):
        model = _construct(spec)
    for name, p in model.named_parameters():
        p.requires_grad_(not is_frozen(spec, name))
    plan = plan_for(case, model)
    seen: dict = {}

    def hook(fqn):
        def record(module, args, kwargs, output):
            x = next((t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)), None)
            y = output[0] if isinstance(output, (tuple, list)) else output
            if fqn not in seen and x is not None and isinstance(y, torch.Tensor):
                seen[fqn] = (
                    (x.numel(), x.requires_grad, _name(x.dtype)),
                    (y.numel(), y.requires_grad, _name(y.dtype)),
                )

        return record

    handles = [model.get_submodule(f).register_forward_hook(hook(f), with_kwargs=True) for f in plan]
    handles += _fsdp2_casts(model, *casts)  # output casts after the records: a style sees the output first
    try:
        with torch.device(device):
            model(*_inputs(spec, rows))
    finally:
        for h in handles:
            h.remove()
    return model, plan, seen


def _name(dtype: torch.dtype) -> str:
    """A floating dtype's printed name (fp32, bf16, fp16); another's torch name (token ids: no
    style's collective carries them)."""
    from fsdp_verify.dtypes import canonical

    name = str(dtype).removeprefix("torch.")
    return canonical(name) if dtype.is_floating_point else name


def _fsdp2_casts(model: nn.Module, param_dtype, output_dtype, cast_forward_inputs: bool, unit_names) -> list:
    """What FSDP2's mixed precision does to the dtypes of a forward, on a plain model: every
    parameter in param_dtype (each unit computes with its unsharded param_dtype copy), each
    unit's floating inputs cast to param_dtype first (`FSDPState._cast_forward_inputs`, a
    pre-hook prepended before any other), its floating outputs to `output_dtype` last
    (`_cast_output_dtype`, in its post-forward hook). Returns the hooks' handles."""
    from fsdp_verify.dtypes import to_torch

    if param_dtype is not None:
        low = to_torch(param_dtype)
        for module in model.modules():
            for n, p in list(module._parameters.items()):
                if p is not None and p.is_floating_point():
                    module._parameters[n] = nn.Parameter(p.detach().to(low), requires_grad=p.requires_grad)

    def cast(dtype):
        def to(t):
            return t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t

        return lambda tree: torch.utils._pytree.tree_map(to, tree)

    handles = []
    # a unit over several modules casts each member's inputs and outputs (FSDP2's hooks of a group
    # are on every module of it)
    for module in (model.get_submodule(m) for unit in unit_names for m in units.members(unit)):
        if cast_forward_inputs and param_dtype is not None:
            inputs = cast(to_torch(param_dtype))
            handles.append(
                module.register_forward_pre_hook(
                    lambda _m, a, k, f=inputs: (f(a), f(k)), prepend=True, with_kwargs=True
                )
            )
        if output_dtype is not None:
            outputs = cast(to_torch(output_dtype))
            handles.append(module.register_forward_hook(lambda _m, _a, out, f=outputs: f(out)))
    return handles


def _inputs(spec, rows: int) -> tuple:
    """A micro-batch's inputs by shape, on the default device (a transformers model's mask left
    out: it changes no shape)."""
    if spec.kind == "mlp":
        return (torch.zeros(rows, spec.widths[0]),)
    return (torch.zeros(rows, spec.seq_len, dtype=torch.long),)
