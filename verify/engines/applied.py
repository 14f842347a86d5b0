"""Did the engine apply what the case asked of it? Read from the module it returned, before the
first step, for each engine-side knob the case asks for (verify/engines/capabilities.py).

An engine that declares a knob and drops it would otherwise show up as something else: `ignored`
left sharded makes the loop's all-reduce of those gradients fail inside DTensor ("does not have a
sharding strategy registered"), a divide factor left at FSDP2's default shows as every gradient
1/W of the reference's, unused expert parameters left out of the reduce-scatter abort gloo. Each
is named here for what it is: "engine X did not apply `ignored`", with the evidence.

What is read: DTensor placements (public) for `ignored` and `shard_placement`; FSDP2's parameter
groups and states (private: `_fsdp_param_groups`, `offload_policy`, `gradient_divide_factor`,
`reduce_scatter_unused_params`, `_states_to_forward_prefetch`, `_states_to_backward_prefetch`)
for the rest, feature-tested: where a release lacks a name, that knob is not judged here (the
records still are).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.fsdp import CPUOffloadPolicy
from torch.distributed.tensor import DTensor, Shard

from fsdp_verify import module_names
from fsdp_verify.case import Case
from fsdp_verify.dims import registry
from fsdp_verify.engines.capabilities import TAKEABLE
from fsdp_verify.units import is_group, modules_here


def not_applied(case: Case, model: nn.Module, takes: frozenset[str]) -> list[tuple[str, str]]:
    """(knob, evidence) for each knob the case asks for, the engine declares, and the module
    shows was not applied; [] when everything asked for is in place (or cannot be read)."""
    out: list[tuple[str, str]] = []
    for knob in TAKEABLE.values():
        if knob.asked(case) and knob.name in takes and knob.name in _READERS:
            evidence = _READERS[knob.name](case, model)
            if evidence:
                out.append((knob.name, evidence))
    for package, spec in registry.on(case):  # a dimension package reads its own (its `applied` hook)
        read = package.hook("applied")
        evidence = read(model, spec, case) if read is not None and package.name in takes else None
        if evidence:
            out.append((package.name, evidence))
    return out


def _roots(case: Case, model: nn.Module) -> list[tuple[nn.Module, tuple[str, ...]]]:
    """(root, its plan) of what the engine sharded: the model and the case's plan; under pp each
    of the rank's stages, a root of its own, with the plan's units in it (`stage_wrap`)."""
    pipeline = getattr(model, "pipeline", None)
    if pipeline is None:
        return [(model, case.wrap_plan)]
    from fsdp_verify.engines.pipeline_parallel import stage_wrap

    return [(stage, stage_wrap(case.wrap_plan, model, stage)) for stage in pipeline.modules]


def _units(case: Case, model: nn.Module) -> list[tuple[str, object]]:
    """(unit FQN, its FSDP2 state) for each unit of the plan the engine made an FSDP2 module."""
    return _units_of(case.wrap_plan, model)


def _units_of(plan, model: nn.Module) -> list[tuple[str, object]]:
    out = []
    for fqn in plan:
        modules = modules_here(model, fqn)  # under pp: the units of this rank's stages
        if not modules:
            continue
        module = modules[0]  # a group's modules share one state
        get_state = getattr(module, "_get_fsdp_state", None)
        if callable(get_state):
            out.append((fqn, get_state()))
    return out


def _groups(state) -> list | None:
    """A unit's FSDP2 parameter groups (torch 2.13: `_fsdp_param_groups`; earlier releases one
    `_fsdp_param_group`), or None where this release has neither name."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    if hasattr(state, "_fsdp_param_group"):
        group = state._fsdp_param_group
        return [group] if group is not None else []
    return None


def _unit_label(fqn: str) -> str:
    return repr(fqn) if fqn else "the root"


def _first_group_without(case: Case, model: nn.Module, attribute: str, wanted, describe) -> str:
    """Evidence for the first unit whose parameter groups do not hold `wanted` in `attribute`."""
    for fqn, state in _units(case, model):
        for group in _groups(state) or []:
            if not hasattr(group, attribute):
                return ""  # this release keeps it elsewhere: not judged here
            if not wanted(getattr(group, attribute)):
                return f"unit {_unit_label(fqn)} {describe(getattr(group, attribute))}"
    return ""


def _ignored(case: Case, model: nn.Module) -> str:
    from fsdp_verify.models import is_ignored

    sharded = [
        n for n, p in module_names.named_parameters(model) if is_ignored(case.ignored, n) and isinstance(p, DTensor)
    ]
    if sharded:
        return f"{sharded[0]!r} is sharded (a DTensor), though the case names it in `ignored` (fully_shard's ignored_params)"
    return ""


def _shard_placement(case: Case, model: nn.Module) -> str:
    from fsdp_verify.engines.placement import shard_dim

    for name, p in module_names.named_parameters(model):
        if not isinstance(p, DTensor):
            continue
        shard = p.device_mesh.size(p.device_mesh.ndim - 1)
        wanted = shard_dim(case.shard_placement, name, tuple(p.shape), shard)
        last = p.placements[-1]
        got = last.dim if isinstance(last, Shard) else None
        if got != wanted:
            return (
                f"{name!r} is placed {last}, the case's `shard_placement: {case.shard_placement}` asks Shard({wanted})"
            )
    return ""


def _offload(case: Case, model: nn.Module) -> str:
    return _first_group_without(
        case,
        model,
        "offload_policy",
        lambda policy: isinstance(policy, CPUOffloadPolicy),
        lambda policy: f"has offload_policy {type(policy).__name__}, not CPUOffloadPolicy",
    )


def _grad_reduction(case: Case, model: nn.Module) -> str:
    return _first_group_without(
        case,
        model,
        "gradient_divide_factor",
        lambda factor: factor == 1.0,
        lambda factor: (
            f"divides its gradients by {'the group size (the default)' if factor is None else factor},"
            " not 1.0 (set_gradient_divide_factor)"
        ),
    )


def _experts(case: Case, model: nn.Module) -> str:
    return _first_group_without(
        case,
        model,
        "reduce_scatter_unused_params",
        bool,
        lambda _: (
            "leaves parameters without a gradient out of its reduce-scatter (set_reduce_scatter_unused_params"
            " not set): a rank no sample of an expert reaches would reduce-scatter fewer tensors than the others"
        ),
    )


def _prefetch(case: Case, model: nn.Module) -> str:
    """Not applied: no unit has an explicit list, where the case's lists are not all empty. Lists
    set otherwise than asked (one unit too many) are applied, wrongly: the memory and
    communication contracts judge those (the zoo's `prefetch_one_unit_too_many`). Under pp each
    of the rank's stages is its own root with the plan's units in it (`stage_wrap`): the lists
    asked are the stage's."""
    from fsdp_verify.engines.prefetch import prefetch_lists

    lists = ("_states_to_forward_prefetch", "_states_to_backward_prefetch")
    for root, plan in _roots(case, model):
        names = [n for n, _ in module_names.named_parameters(root)]
        wanted = prefetch_lists(plan, names, case.prefetch, case.ignored)
        units = _units_of(plan, root)
        if not all(hasattr(state, a) for _, state in units for a in lists):
            return ""  # this release keeps them elsewhere: not judged here
        if any(getattr(state, a) for _, state in units for a in lists):
            continue
        asked = next(((u, f) for u, (f, b) in wanted.items() if f or b), None)
        if asked is None:
            continue
        unit, ahead = asked[0], wanted[asked[0]][0] or wanted[asked[0]][1]
        return (
            f"no unit has a forward or backward prefetch list; the case's `prefetch: {case.prefetch}` asks unit"
            f" {_unit_label(unit)} to prefetch {ahead}"
        )
    return ""


def _ep(case: Case, model: nn.Module) -> str:
    """Expert parallelism: the grouped experts' parameters on a mesh with an "ep" dim, and their
    units dividing by the data-parallel size (verify/engines/expert_parallel.py)."""
    from fsdp_verify.engines.expert_parallel import grouped_experts, on_ep_mesh

    for fqn, experts in grouped_experts(model):
        for name, p in experts.named_parameters(recurse=False):
            if not on_ep_mesh(p):
                return (
                    f"{fqn}.{name!r} is not distributed over an 'ep' mesh dim (ExpertParallel's Shard(0)): every rank"
                    f" holds every expert though the case asks for ep={case.ep}"
                )
    return "" if case.grad_reduction == "sum" else _experts_divide(case, model)


def _experts_divide(case: Case, model: nn.Module) -> str:
    """The experts' unit divides by the data-parallel size, not by its own smaller mesh."""
    from fsdp_verify.engines.expert_parallel import grouped_experts

    for fqn, experts in grouped_experts(model):
        get_state = getattr(experts, "_get_fsdp_state", None)
        for group in (_groups(get_state()) or []) if callable(get_state) else []:
            factor = getattr(group, "gradient_divide_factor", float(case.world_size))
            if factor != float(case.world_size):
                return (
                    f"unit {_unit_label(fqn)} divides its gradients by"
                    f" {'the size of its own mesh (the default)' if factor is None else factor}, not by the"
                    f" data-parallel size {case.world_size} its gradient sums over (set_gradient_divide_factor)"
                )
    return ""


def _compile(case: Case, model: nn.Module) -> str:
    """Each module the case compiles has `module.compile()` applied (its `_compiled_call_impl`);
    one compiled otherwise (a `torch.compile(module)` wrapper registered in its place) changes the
    parameters' FQNs, which the records then show."""
    from fsdp_verify.training.compile import compiled_modules, is_compiled

    compiled = [pair for root, plan in _roots(case, model) for pair in compiled_modules(case, root, plan)]
    for fqn, module in compiled:
        if is_compiled(module) is False:
            what = "the model" if not fqn else f"unit {fqn!r}"
            return f"{what} is not compiled (module.compile() not called: ShardSpec.compile(model) before fully_shard)"
    return ""


def _tp(case: Case, model: nn.Module) -> str:
    """Every parameter the plan splits is a DTensor split over the mesh's "tp" dim as the plan
    splits it (Shard(d) there; FSDP2's data-parallel dims come before, a `_StridedShard` of it)."""
    from fsdp_verify.engines.tensor_parallel import split_parameters

    params = dict(module_names.named_parameters(model))
    for name, dim in split_parameters(case).items():
        p = params.get(name)
        if p is None:
            continue
        if not isinstance(p, DTensor):
            return f"{name!r} is a plain tensor, which the plan splits over tp (Shard({dim}))"
        names = p.device_mesh.mesh_dim_names or ()
        placement = p.placements[names.index("tp")] if "tp" in names else None
        if type(placement) is not Shard or placement.dim != dim:
            where = f"{placement} over the mesh's 'tp' dim" if placement is not None else f"on the mesh dims {names}"
            return f"{name!r} is {where} ({p.placements} over {names}), which the plan splits Shard({dim}) over 'tp'"
    return ""


def _groups_applied(case: Case, model: nn.Module) -> str:
    """Each unit over several modules one FSDP2 state: `fully_shard` called on the list, not on
    each member (their states would differ). Under pp, the groups of this rank's stages."""
    for fqn in case.wrap_plan:
        if not is_group(fqn):
            continue
        modules = modules_here(model, fqn)
        if case.pp > 1 and not any(True for m in modules for _ in m.parameters()):
            continue  # another stage's group: this rank's copy holds none of its parameters
        states = []
        for module in modules:
            get_state = getattr(module, "_get_fsdp_state", None)
            states.append(get_state() if callable(get_state) else None)
        if any(s is None for s in states) or len({id(s) for s in states}) > 1:
            return f"the modules of {fqn!r} are not one unit (each sharded on its own, or not at all)"
    return ""


_READERS = {
    "ep": _ep,
    "tp": _tp,
    "offload": _offload,
    "shard_placement": _shard_placement,
    "ignored": _ignored,
    "grad_reduction": _grad_reduction,
    "prefetch": _prefetch,
    "experts": _experts,
    "compile": _compile,
    "groups": _groups_applied,
}
