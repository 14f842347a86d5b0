"""Pipeline parallelism composed with FSDP2, as torchtitan composes them (docs/pipeline-parallel.md):
the model cut into stages over a "pp" mesh dim (outermost), each stage sharded by FSDP2 over its
data-parallel ranks, the micro-batches run by a `torch.distributed.pipelining` schedule.

Every rank builds the whole model (the same seed everywhere), keeps the stages it runs (one, or
two under Interleaved1F1B: stages p and p + pp on pp rank p) and drops the parameters of the
others from its copy, which then holds exactly what the rank trains, under the model's own names:
the module the loop records and steps (`Pipeline.module`). Each stage is sharded by the engine's
own per-module sharding (`shard_stage(stage, dp_mesh, stage_spec)`: the fsdp2 engine itself, with
the wrap plan's units that lie in the stage and the stage as its root), wrapped in a
`PipelineStage` and scheduled: FSDP2 accumulates every micro-batch's gradients unreduced (the
stage turns its sync off for each backward) and reduces once after the last; the schedule then
divides the gradients by the number of micro-batches (`scale_grads`), so each micro-batch's loss is
its sum over items times dp x micro-batches / the step's items (`Pipeline.loss`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from fsdp_verify.units import group, is_group, members, modules_of
from fsdp_verify.validation import check, is_int

PP = "pp"
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


def stages_per_rank(schedule: str) -> int:
    return 2 if schedule == "interleaved1f1b" else 1


# ---- the case -----------------------------------------------------------------------------------
def check_pipeline_value(name: str, value: Any) -> None:
    """What each pipeline field takes on its own."""
    from fsdp_verify.models.spec import IMPORT_PATH, is_import_path

    if name == "pp":
        check(is_int(value) and value >= 1, "pp", "a positive integer (1: no pipeline parallelism)", value)
    elif name == "pp_schedule":
        check(value in SCHEDULES, "pp_schedule", f"one of {SCHEDULES}", value)
    elif name == "pp_split":
        check(value is None or is_import_path(value), "pp_split", f"null or {IMPORT_PATH}", value)
    elif name == "pp_scale_grads":
        check(isinstance(value, bool), "pp_scale_grads", "true or false", value)


def check_pipeline(case) -> None:
    """The case's pipeline: a degree, a schedule the micro-batches fit, a model that splits into
    its stages, beside only what the reference models with it."""
    for name in ("pp", "pp_schedule", "pp_split", "pp_scale_grads"):
        check_pipeline_value(name, getattr(case, name))
    pp = case.pp
    if pp == 1:
        for name, off in (("pp_schedule", "1f1b"), ("pp_split", None), ("pp_scale_grads", True)):
            check(getattr(case, name) == off, name, f"{off!r} with pp=1 (no pipeline)", getattr(case, name))
        return
    stages, m = pp * stages_per_rank(case.pp_schedule), case.microbatches
    if case.pp_schedule == "1f1b":
        check(m >= pp, "microbatches", f"at least pp={pp} under 1F1B (torch's Schedule1F1B refuses fewer)", m)
    if case.pp_schedule == "interleaved1f1b":
        rounds = max(1, m // pp)
        check(
            m >= pp and m % rounds == 0,
            "microbatches",
            f"at least pp={pp} and a multiple of max(1, microbatches // pp) under Interleaved1F1B",
            m,
        )
    model = case.model
    if case.pp_split is None:
        check(
            not model.is_custom,
            "pp_split",
            "a function (model, n_stages) -> the stage modules for a model of your own (--pp-split)",
            None,
        )
        check(
            model.n_blocks >= stages,
            "pp",
            f"at most as many stages ({stages} under {case.pp_schedule}) as the model has blocks ({model.n_blocks})",
            pp,
        )
    if case.pp_split is not None:
        _check_split(case, stages)
    if case.pp_split is not None and model.is_custom:
        from fsdp_verify.models.custom import tied_groups

        check(
            not tied_groups(model),
            "pp_split",
            "null beside tied parameters of your own model (tied across stages: the built-in Transformer's only)",
            case.pp_split,
        )
    if any(is_group(u) for u in case.wrap_plan):
        _check_groups_in_one_stage(case, stages)
    if case.unfreeze_step is not None:
        _check_unfrozen_stages(case, stages)
    check(
        not case.sync_every_microbatch,
        "sync_every_microbatch",
        f"false with pp={pp}: a stage accumulates every micro-batch and reduces once after the last (--sync-last)",
        True,
    )
    if case.zoom is not None:  # the zoom's passes open where a stage runs one micro-batch (verify/zoom/probe.py)
        check(
            stage_chunks(),
            "zoom",
            f"None with pp={pp} on this torch: its pipeline stages lack forward_one_chunk/backward_one_chunk",
            case.zoom,
        )
    from fsdp_verify.dims.together import check_together

    check_together(case, PP)


def _check_groups_in_one_stage(case, n_stages: int) -> None:
    """Each unit over several modules inside one stage: a stage is sharded on its own, so a group
    across two would be two units (torchtitan's `[norm, lm_head]` lies in its last stage)."""
    from fsdp_verify.models import _construct

    with torch.device("meta"):
        model = _construct(case.model)
    where: dict[int, int] = {}
    for s, stage in enumerate(split(case, model, n_stages)):
        for module in stage.modules():
            where.setdefault(id(module), s)
    for unit in case.wrap_plan:
        if is_group(unit):
            stages = sorted({where.get(id(model.get_submodule(m)), -1) for m in members(unit)})
            check(
                len(stages) == 1 and stages[0] >= 0,
                "wrap",
                f"each unit over several modules inside one stage ({unit!r} lies in stages {stages}, -1: none)",
                case.wrap,
            )


def _check_unfrozen_stages(case, n_stages: int) -> None:
    """Unfreezing beside stages whose input needs no gradient at the first step. A stage's
    input needs one when a parameter of an earlier stage trains; torch's `PipelineStage` reads
    that once, at its first step, so a first stage frozen whole and unfrozen later is never sent
    the gradient of its output (torch 2.13: "grad can be implicitly created only for scalar
    outputs" in the stage's backward)."""
    from fsdp_verify.models import _construct, is_frozen

    with torch.device("meta"):
        model = _construct(case.model)
    names = {id(p): n for n, p in model.named_parameters()}
    trains = [
        any(not is_frozen(case.model, names[id(p)]) for p in stage.parameters())
        for stage in split(case, model, n_stages)
    ]
    check(
        trains[0],
        "unfreeze_step",
        f"null with pp={case.pp} when the first stage is frozen whole (its PipelineStage fixes at the"
        " first step that its output needs no gradient; one of its parameters left trainable lifts it)",
        case.unfreeze_step,
    )


def stage_chunks() -> bool:
    """Whether torch's pipeline stages run one micro-batch a call where a zoom can hook them
    (private methods of `_PipelineStageBase`: feature-tested)."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:
        return False
    return all(hasattr(_PipelineStageBase, name) for name in ("forward_one_chunk", "backward_one_chunk"))


# ---- the mesh -----------------------------------------------------------------------------------
def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """`mesh` without its "pp" dim: ("shard",) or ("replicate", "shard")."""
    names = tuple(n for n in (mesh.mesh_dim_names or ()) if n != PP)
    if len(names) == len(mesh.mesh_dim_names or ()):
        return mesh
    return mesh[names] if len(names) > 1 else mesh[names[0]]


# ---- the stages ---------------------------------------------------------------------------------
def split(case, model: nn.Module, n_stages: int) -> list[nn.Module]:
    """Every stage of `model`: the built-in model's views (verify/models/stages.py), or what the
    case's `pp_split` returns (modules whose parameters are the model's own)."""
    if case.pp_split is None:
        from fsdp_verify.models.stages import stage_views

        return stage_views(model, case.model, n_stages)
    from fsdp_verify.imports import load_object

    stages = list(load_object(case.pp_split, "pp_split")(model, n_stages))
    own = {id(p) for p in model.parameters()}
    if len(stages) != n_stages or not all(isinstance(s, nn.Module) for s in stages):
        raise ValueError(f"pp_split {case.pp_split!r}: expected {n_stages} nn.Modules, got {len(stages)} items")
    for s, stage in enumerate(stages):
        foreign = [n for n, p in stage.named_parameters() if id(p) not in own]
        if foreign:
            raise ValueError(f"pp_split {case.pp_split!r}: stage {s}'s {foreign[0]!r} is not a parameter of the model")
    return stages


def _check_split(case, n_stages: int) -> None:
    """The case's `pp_split` run on the model built on the meta device, before any rank starts:
    n stage modules whose parameters are the model's own, each of them in one stage."""
    from fsdp_verify.models import _construct
    from fsdp_verify.validation import CaseError

    with torch.device("meta"):
        model = _construct(case.model)
    try:
        stages = split(case, model, n_stages)
    except Exception as e:
        raise CaseError(
            "pp_split", f"fn(model, n_stages) -> {n_stages} stage modules sharing the model's parameters", str(e)
        ) from None
    seen: dict[int, int] = {}
    for s, stage in enumerate(stages):
        for p in stage.parameters():
            check(
                seen.setdefault(id(p), s) == s,
                "pp_split",
                "stages that share no parameter (each parameter in one stage)",
                f"a parameter in stages {seen[id(p)]} and {s}",
            )


def stage_wrap(plan: tuple[str, ...], model: nn.Module, stage: nn.Module) -> tuple[str, ...]:
    """The plan's units that lie in `stage`, by their names there, children first, then the
    stage itself (its root: the parameters no other unit holds)."""
    where = {id(m): n for n, m in stage.named_modules()}
    units = []
    for fqn in plan:
        if not fqn:
            continue
        names = [where.get(id(m)) for m in modules_of(model, fqn)]  # a group's members, by their stage names
        if all(names):
            units.append(group(names))
    return (*units, "")


def drop_others(model: nn.Module, mine: list[nn.Module]) -> None:
    """The model's parameters that none of `mine` holds removed from their modules: the rank's
    copy then holds what it trains, under the model's names."""
    held = {(id(m), n) for stage in mine for m in stage.modules() for n in m._parameters}
    for module in model.modules():
        for name in list(module._parameters):
            if (id(module), name) not in held:
                del module._parameters[name]
