"""What a Case asks of itself: its validation, field by field and across fields, run on
construction (`validate`, called by `Case.__post_init__`), each refusal a CaseError naming the
field and what was expected. Apart from the Case's fields and their JSON (case.py) so that each
reads in one place."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fsdp_verify import units
from fsdp_verify.case_specs import (
    COMPILE_BACKENDS,
    COMPILE_SCOPES,
    GRAD_REDUCTIONS,
    INIT_MODES,
    RESUMED_ON,
    VOCABULARY_PARALLEL_LOSSES,
    LossScaleSpec,
)
from fsdp_verify.dims import registry
from fsdp_verify.dims.registry import DimSpecs
from fsdp_verify.dims.together import check_together
from fsdp_verify.models import module_classes
from fsdp_verify.models.spec import IMPORT_PATH, is_import_path
from fsdp_verify.validation import CaseError, check, is_int, is_number

if TYPE_CHECKING:
    from fsdp_verify.case import Case


def validate(case: Case) -> None:
    case.model.validate()
    case.precision.validate()
    case.optim.validate()
    case.data.validate()
    check(is_int(case.world_size) and case.world_size >= 1, "world_size", "a positive integer", case.world_size)
    check(is_int(case.tp) and case.tp >= 1, "tp", "a positive integer (1: no tensor parallelism)", case.tp)
    check(
        case.world_size % case.tp == 0,
        "world_size",
        f"a multiple of tp={case.tp} (every rank: data-parallel ranks times tp)",
        case.world_size,
    )
    _zoom(case)
    mesh = case.mesh
    check(
        len(mesh) in (1, 2) and all(is_int(d) and d >= 1 for d in mesh),
        "mesh_shape",
        "(shard,) or (replicate, shard) of positive integers",
        case.mesh_shape,
    )
    prod = 1
    for d in mesh:
        prod *= d
    check(is_int(case.pp) and case.pp >= 1, "pp", "a positive integer (1: no pipeline parallelism)", case.pp)
    check(
        case.world_size % case.pp == 0,
        "world_size",
        f"a multiple of pp={case.pp} (every rank: the stages times the data-parallel ranks)",
        case.world_size,
    )
    check(
        prod == case.dp_size,
        "mesh_shape",
        f"dimensions whose product is world_size={case.world_size}"
        + (f" / {case._parallel_degrees} = {case.dp_size} (the data-parallel ranks)" if case._parallel_degrees else ""),
        case.mesh_shape,
    )
    check(is_int(case.steps) and case.steps >= 1, "steps", "a positive integer", case.steps)
    check(
        is_int(case.microbatches) and case.microbatches >= 1,
        "microbatches",
        "a positive integer",
        case.microbatches,
    )
    per = case.dp_size * case.microbatches
    ranks = f"(world_size / {case._parallel_degrees})" if case._parallel_degrees else "world_size"
    check(
        case.data.batch_size % per == 0,
        "data.batch_size",
        f"a multiple of {ranks} * microbatches = {case.dp_size} * {case.microbatches} = {per}",
        case.data.batch_size,
    )
    check(
        case.clip_norm is None or (is_number(case.clip_norm) and case.clip_norm > 0),
        "clip_norm",
        "null or a positive max norm",
        case.clip_norm,
    )
    for name in ("seed", "data_seed"):
        check(
            is_int(getattr(case, name)) and getattr(case, name) >= 0,
            name,
            "a non-negative integer",
            getattr(case, name),
        )
    check(case.init in INIT_MODES, "init", f"one of {INIT_MODES}", case.init)
    check(
        isinstance(case.engine, str) and bool(case.engine),
        "engine",
        "'fsdp2', 'pkg.module:NAME' or 'file.py:NAME'",
        case.engine,
    )
    rsf = case.reshard_after_forward
    check(
        isinstance(rsf, bool) or (is_int(rsf) and rsf >= 1),
        "reshard_after_forward",
        "true, false or a positive int",
        rsf,
    )
    check(case.loss is None or is_import_path(case.loss), "loss", f"null or {IMPORT_PATH}", case.loss)
    check(case.step is None or is_import_path(case.step), "step", f"null or {IMPORT_PATH}", case.step)
    check(
        isinstance(case.activation_checkpointing, bool),
        "activation_checkpointing",
        "true or false",
        case.activation_checkpointing,
    )
    if case.loss_scaling is not None:
        check(
            isinstance(case.loss_scaling, LossScaleSpec),
            "loss_scaling",
            "null or an object with init_scale, growth_factor, backoff_factor, growth_interval",
            case.loss_scaling,
        )
        case.loss_scaling.validate()
        check(
            case.step is None,
            "loss_scaling",
            "null with a user's step (--step scales its own loss, if it does)",
            dataclasses.asdict(case.loss_scaling),
        )
        # Refused, not run: loss scaling guards fp16's narrow range (small gradients flush to
        # zero, large ones overflow); bf16 and fp32 have fp32's exponent range, so in them a
        # scaler only multiplies and divides by powers of two and the check would test nothing
        # a user asked about. fuzz and sweep draw it for fp16 cases only, likewise.
        check(
            case.precision.uses_fp16,
            "loss_scaling",
            "null unless the case computes in fp16 (precision.param_dtype, reduce_dtype or output_dtype"
            " fp16): dynamic loss scaling is for fp16's range; bf16 and fp32 need none (--loss-scaling off)",
            f"{case.loss_scaling.describe()} with precision {case.precision.describe()}",
        )
    _shard_knobs(case)
    _ignored(case)
    _experts_trainable(case)
    _unfreeze(case)
    _resume(case)
    _custom(case)
    _wrap(case)
    _checkpointing(case)
    _modelled_together(case)
    _dims(case)
    from fsdp_verify.engines.expert_parallel import check_experts

    check_experts(case)
    from fsdp_verify.engines.pipeline_parallel import check_pipeline

    check_pipeline(case)
    _tp(case)
    _compile(case)
    if case.data.kind == "cancellation":
        check(
            case.model.kind == "mlp",
            "data.kind",
            "'normal' for a transformer (token ids cannot cancel)",
            case.data.kind,
        )


def _shard_knobs(case: Case) -> None:
    """fully_shard's knobs (issue 28): offload and per-parameter placements."""
    from fsdp_verify.engines.placement import PLACEMENTS

    check(isinstance(case.offload, bool), "offload", "true or false", case.offload)
    check(case.shard_placement in PLACEMENTS, "shard_placement", f"one of {PLACEMENTS}", case.shard_placement)
    check(isinstance(case.replica_sync_last, bool), "replica_sync_last", "true or false", case.replica_sync_last)
    rsf = case.reshard_after_forward
    if case.shard_placement != "dim0" and is_int(rsf) and not isinstance(rsf, bool):
        check(
            not 1 < rsf < case.mesh[-1],
            "shard_placement",
            f"'dim0' with an int reshard_after_forward {rsf} below the shard group {case.mesh[-1]}: FSDP2 (torch"
            " 2.13) crashes resharding a Shard(1) parameter to the smaller group after forward"
            " (tests/upstream/test_fsdp2_shard1_int_reshard_after_forward.py)",
            case.shard_placement,
        )
    if case.replica_sync_last:
        check(
            len(case.mesh) == 2,
            "replica_sync_last",
            "false on a 1-D mesh (no replicas to all-reduce over; set mesh_shape R,S)",
            True,
        )
        check(
            case.step is None,
            "replica_sync_last",
            "false with a user's step (--step calls set_requires_all_reduce itself, if it does)",
            True,
        )
    check(
        isinstance(case.reshard_after_backward_last, bool),
        "reshard_after_backward_last",
        "true or false",
        case.reshard_after_backward_last,
    )
    if case.reshard_after_backward_last:
        check(
            case.step is None,
            "reshard_after_backward_last",
            "false with a user's step (--step calls set_reshard_after_backward itself, if it does)",
            True,
        )
    check(
        case.prefetch is None or (is_int(case.prefetch) and case.prefetch >= 1),
        "prefetch",
        "null (FSDP2's implicit prefetching) or a positive integer (units ahead)",
        case.prefetch,
    )
    # The lists follow registration order; the MLP's routed `moe` runs out of it, so a forward
    # list names a unit that already ran, and what FSDP2 then holds is not modelled (a memory
    # false alarm of 4,624 B against 544 B, seed 7's sweep).
    check(
        case.prefetch is None or not case.model.experts,
        "prefetch",
        "null with routed experts (their unit runs out of registration order: prefetch lists naming a unit"
        " that already ran are not modelled)",
        case.prefetch,
    )
    check(case.grad_reduction in GRAD_REDUCTIONS, "grad_reduction", f"one of {GRAD_REDUCTIONS}", case.grad_reduction)
    if case.grad_reduction != "avg":
        check(
            case.step is None,
            "grad_reduction",
            "'avg' with a user's step (--step scales its own loss; the toolkit cannot divide it by the world size)",
            case.grad_reduction,
        )


def _ignored(case: Case) -> None:
    """`ignored` (fully_shard's ignored_params) names parameters, and what FSDP2 leaves to the
    loop for them works: no cast, no clip over them, no resume."""
    from fsdp_verify.models import is_ignored, parameter_names

    ignored = case.ignored
    check(
        isinstance(ignored, tuple) and all(isinstance(n, str) and n for n in ignored),
        "ignored",
        "a list of parameter names (prefixes)",
        ignored,
    )
    if not ignored:
        return
    names = parameter_names(case.model)
    for prefix in ignored:
        check(
            any(is_ignored((prefix,), n) for n in names),
            "ignored",
            f"names of the model's parameters or their modules (tied weights under their first name; {prefix!r}"
            " names none)",
            ignored,
        )
    check(
        not all(is_ignored(ignored, n) for n in names),
        "ignored",
        "to leave FSDP at least one parameter (every parameter ignored: nothing is sharded)",
        ignored,
    )
    check(
        case.step is None,
        "ignored",
        "empty with a user's step (the toolkit's loop all-reduces the ignored gradients)",
        ignored,
    )
    check(
        case.precision.param_dtype in (None, "fp32"),
        "ignored",
        f"empty with param_dtype {case.precision.param_dtype}: FSDP2 does not cast ignored parameters, which stay"
        " fp32 beside low-precision activations",
        ignored,
    )
    check(
        case.clip_norm is None,
        "ignored",
        "empty with clip_norm: torch 2.13's clip_grad_norm_ refuses the ignored parameters' plain gradients"
        " beside DTensor ones ('got mixed torch.Tensor and DTensor')",
        ignored,
    )
    check(
        not case.model.experts,
        "ignored",
        "empty with routed experts (a rank no sample reaches has no gradient to all-reduce: the ranks' calls differ)",
        ignored,
    )


def _experts_trainable(case: Case) -> None:
    """An expert no sample of a micro-batch reaches takes no part in its graph: with every
    parameter outside the routed experts frozen, such a micro-batch's loss has no gradient at
    all (autograd refuses it on the reference and the ranks alike)."""
    if not case.model.experts or not case.model.frozen:
        return
    from fsdp_verify.models import is_frozen, parameter_names

    outside = [n for n in parameter_names(case.model) if not n.startswith("moe.experts.")]
    check(
        any(not is_frozen(case.model, n) for n in outside),
        "model.frozen",
        "to leave a parameter outside the routed experts trainable (an expert no sample reaches gives a loss"
        " without gradient)",
        case.model.frozen,
    )


def _unfreeze(case: Case) -> None:
    check(
        case.step is None or case.optim.schedule is None,
        "optim.schedule",
        "null with a user's step (it steps its own optimizer)",
        case.optim.schedule,
    )
    if case.unfreeze_step is None:
        return
    check(
        is_int(case.unfreeze_step) and case.unfreeze_step >= 2,
        "unfreeze_step",
        "null or a step from 2 on (the first step the frozen parameters train)",
        case.unfreeze_step,
    )
    # Named `model.frozen`: a pinned unfreeze step is valid beside a frozen model (`check_field_value`).
    check(bool(case.model.frozen), "model.frozen", f"the parameters to unfreeze at step {case.unfreeze_step}", ())
    check(case.step is None, "unfreeze_step", "null with a user's step (it trains what it trains)", case.unfreeze_step)


def _resume(case: Case) -> None:
    """A resume needs a step to save after and a step after it; what it resumes on must be a
    valid case of its own (the batch divisible by its ranks, the model by its tp degree)."""
    if case.resume_after is None:
        for name in RESUMED_ON:
            check(getattr(case, name) is None, name, "null without resume_after", getattr(case, name))
        return
    check(
        is_int(case.resume_after) and 1 <= case.resume_after < case.steps,
        "resume_after",
        f"a step in [1, steps - 1] = [1, {case.steps - 1}] (a save after it and a step to resume)",
        case.resume_after,
    )
    rws = case.resume_world_size
    check(rws is None or (is_int(rws) and rws >= 1), "resume_world_size", "null or a positive integer", rws)
    check(
        case.resume_engine is None or (isinstance(case.resume_engine, str) and bool(case.resume_engine)),
        "resume_engine",
        "null, 'fsdp2', 'fsdp1', 'pkg.module:NAME' or 'file.py:NAME'",
        case.resume_engine,
    )
    rtp = case.resume_tp
    check(rtp is None or (is_int(rtp) and rtp >= 1), "resume_tp", "null or a positive integer (1: no tp)", rtp)
    if rtp is not None and rtp != case.tp:
        # Pipeline stages beside tp are refused by the case (verify/dims/together.py); a user's step
        # is not modelled beside tp on either side of the resume.
        check(case.step is None, "resume_tp", "null with a user's step (not modelled beside tp)", rtp)
        world = rws if rws is not None else case.world_size
        if case.resume_mesh_shape is None or rws is not None:
            check(
                world % rtp == 0,
                "resume_tp",
                f"a divisor of the resumed world size {world} (every rank: data-parallel ranks times tp)",
                rtp,
            )
    for name in ("resume_ep", "resume_pp"):
        value = getattr(case, name)
        check(value is None or (is_int(value) and value >= 1), name, "null or a positive integer", value)
    from fsdp_verify.engines.compositions import check_resumed_degrees

    check_resumed_degrees(case)
    try:
        case.after_resume()
    except CaseError as e:
        raise for_the_resumed_run(e, case) from None


def _custom(case: Case) -> None:
    if case.step is not None:
        from fsdp_verify.imports import load_object

        check(
            _takes_four(load_object(case.step, "step")),
            "step",
            "a callable NAME(model, optimizer, batch, ctx)",
            case.step,
        )
    if case.data.padded:
        check(case.model.kind != "mlp", "data.padded", "false for an MLP (padding needs token sequences)", True)
    if not case.model.is_custom:
        return
    from fsdp_verify.models import custom

    info = custom.info(case.model)  # builds it on meta: a factory that fails is reported here
    if case.data.fn is None or case.loss is None:
        check(
            info.vocab_size is not None,
            "model.factory",
            "a model with an nn.Embedding (token ids are generated for it), or data.fn and loss",
            case.model.factory,
        )
    check(
        case.init == "eager" or case.model.init_fn is not None,
        "init",
        "'eager' for a model factory without an init_fn (a meta build has no values to replay)",
        case.init,
    )


def _wrap(case: Case) -> None:
    classes = module_classes(case.model)
    if case.wrap is not None:
        for entry in case.wrap:
            if units.is_group(entry):  # one unit over several modules: each a module name
                for member in units.members(entry):
                    check(
                        member in classes and member != "",
                        "wrap",
                        f"a group's members ({entry!r}) to be module names of the model other than the root"
                        f" (e.g. {sorted(n for n in classes if n)[:6]})",
                        member,
                    )
                continue
            check(
                entry in classes or entry in classes.values(),
                "wrap",
                f"module names or class names of the model (e.g. {sorted(classes)[:6]},"
                f" {sorted(set(classes.values()))[:4]}), or modules joined by '+' for one unit over them",
                entry,
            )
    plan = case.wrap_plan
    modules = [m for unit in plan for m in units.members(unit)]
    check(len(set(modules)) == len(modules), "wrap", "each module at most once", plan)
    order = {name: i for i, name in enumerate(classes)}  # the model's module order
    for unit in plan:
        inner = [(a, b) for a in units.members(unit) for b in units.members(unit) if units.is_ancestor(a, b)]
        check(not inner, "wrap", f"a group of modules none inside another ({unit!r})", plan)
        # FSDP2 lays a group's parameters out, and runs its post-forward, in the order given;
        # the model's order keeps both where the toolkit models them
        positions = [order.get(m, -1) for m in units.members(unit)]
        check(positions == sorted(positions), "wrap", f"a group's modules in the model's order ({unit!r})", plan)
    check(
        not any(m.startswith("moe.experts") for m in modules) or case.model.grouped_experts is not None,
        "wrap",
        "no routed expert as a unit of its own (a rank that routes no sample to it would skip its"
        " all-gather while the others run it)",
        plan,
    )
    check(bool(plan) and plan[-1] == "", "wrap", 'a plan that ends with the root ""', plan)
    if any(units.is_group(u) for u in plan):
        # a group's one unit over several modules: tried with tp and pp (each group in one
        # stage: verify/engines/pipeline_parallel.py), and with torchtitan's ep ([norm, lm_head]
        # beside its experts in each block: docs/frameworks/torchtitan.md), not with the built-in
        # MLP's experts
        check(case.ep == 1 or case.model.is_custom, "wrap", "units of one module each beside ep (not modelled)", plan)
        # explicit prefetching's replay places a unit's pre-forward by module nesting, which
        # a group's first member does not follow (verify/checks/prefetch.py)
        check(case.prefetch is None, "wrap", "units of one module each beside prefetch (not modelled)", plan)
    for i, unit in enumerate(plan):
        for later in plan[i + 1 :]:
            check(
                not any(units.is_ancestor(a, b) for a in units.members(unit) for b in units.members(later)),
                "wrap",
                f"children before parents ({later!r} is inside {unit!r})",
                plan,
            )
    if case.model.kind == "transformer" and case.model.tie_embeddings and case.pp == 1:  # pp: two stages hold it
        a, b = units.owner_of_module(plan, "tok_embeddings"), units.owner_of_module(plan, "output")
        check(a == b, "wrap", "tok_embeddings and output in one shard unit when embeddings are tied", plan)
    if case.model.is_custom:
        from fsdp_verify.models.custom import tied_groups

        for names in tied_groups(case.model):
            owners = {units.owner_of_module(plan, n.rsplit(".", 1)[0] if "." in n else "") for n in names}
            check(len(owners) == 1, "wrap", f"the tied parameters {list(names)} in one shard unit", plan)


def _zoom(case: Case) -> None:
    if case.zoom is None:
        return
    step, _, rest = str(case.zoom).partition("/")
    direction, _, _fqn = rest.partition("/")
    check(
        isinstance(case.zoom, str) and step.isdigit() and direction in ("", "forward", "backward"),
        "zoom",
        'null, "STEP", "STEP/forward/FQN" or "STEP/backward/FQN"',
        case.zoom,
    )


def _checkpointing(case: Case) -> None:
    """A checkpointed unit's forward runs again in backward. The KV cache of a transformers
    model is turned off for it (verify/training/checkpointing.py), but running statistics
    have no such switch: BatchNorm's would be updated twice on the ranks and once on the
    reference, which never recomputes (a divergence of the buffers that no engine caused)."""
    if not (case.activation_checkpointing and case.model.is_custom):
        return
    from fsdp_verify.models.custom import running_stats

    for unit in case.wrap_plan[:-1]:
        inside = [m for m in running_stats(case.model) if m == unit or m.startswith(unit + ".")]
        check(
            not inside,
            "activation_checkpointing",
            f"false, or a wrap plan whose units hold no module that updates running statistics in forward"
            f" (unit {unit!r} holds {inside[:1]}: its recomputation in backward would update them a second"
            " time)",
            True,
        )


def _compile(case: Case) -> None:
    """torch.compile's options (docs/compile.md), and what the compiled runs cannot take."""
    check(
        case.compile is None or case.compile in COMPILE_SCOPES,
        "compile",
        f"null or one of {COMPILE_SCOPES}",
        case.compile,
    )
    check(isinstance(case.compile_fullgraph, bool), "compile_fullgraph", "true or false", case.compile_fullgraph)
    check(
        case.compile_backend in COMPILE_BACKENDS,
        "compile_backend",
        f"one of {COMPILE_BACKENDS}",
        case.compile_backend,
    )
    if case.compile is None:
        check(not case.compile_fullgraph, "compile_fullgraph", "false without compile", True)
        check(
            case.compile_backend == "inductor",
            "compile_backend",
            "'inductor' without compile",
            case.compile_backend,
        )
        return
    breaks = fullgraph_breaks(case) if case.compile_fullgraph else None
    check(breaks is None, "compile_fullgraph", f"false where {breaks}", True)
    check(
        case.compile != "units" or len(case.wrap_plan) > 1,
        "compile",
        "'model' or null for a wrap plan of the root alone ('units' compiles each unit but the root)",
        case.compile,
    )
    check(
        case.compile != "blocks" or any(units.is_block(u) for u in case.wrap_plan),
        "compile",
        "'units', 'model' or null for a wrap plan without a block ('blocks' compiles each unit that is an"
        " element of a module list or dict, such as layers.0)",
        case.compile,
    )
    check_together(case, "compile")


def _modelled_together(case: Case) -> None:
    """Refuse, naming the field, a setting not modelled beside tp (verify/dims/together.py,
    the one table; ep, pp and compile are checked there too, after their own fields)."""
    check_together(case, "tp")


def _dims(case: Case) -> None:
    """Each registered package's spec: its own fields, what it asks of the case, and the
    together table's rows beside it (verify/dims/registry.py)."""
    check(isinstance(case.dims, DimSpecs), registry.FIELD, "dimension specs (verify/dims/registry.py)", case.dims)
    case.dims.validate()
    for package, spec in registry.on(case):
        if package.validate is not None:
            package.validate(case, spec)
        check_together(case, package.name)


def _tp(case: Case) -> None:
    """Tensor parallelism's fields (docs/tensor-parallel.md): a degree, a plan that splits the
    model evenly over it, and the knobs modelled beside it."""
    for name in ("sequence_parallel", "loss_parallel"):
        check(isinstance(getattr(case, name), bool), name, "true or false", getattr(case, name))
    check(case.tp_plan is None or is_import_path(case.tp_plan), "tp_plan", f"null or {IMPORT_PATH}", case.tp_plan)
    if case.tp == 1:
        for name in ("tp_plan", "sequence_parallel", "loss_parallel"):
            value = getattr(case, name)
            check(value in (None, False), name, f"{'null' if name == 'tp_plan' else 'false'} with tp=1", value)
        return
    rsf = case.reshard_after_forward
    check(
        isinstance(rsf, bool) or not 1 < rsf < case.mesh[-1],
        "reshard_after_forward",
        f"true or false with tp={case.tp}, or an int that is not below the shard group {case.mesh[-1]}: FSDP2"
        " (torch 2.13) builds the post-forward mesh of a data-parallel sub-mesh on some ranks only, a hang"
        " (tests/upstream/test_fsdp2_int_reshard_on_a_submesh.py)",
        rsf,
    )
    if case.sequence_parallel:
        check(
            case.model.kind == "transformer" and case.tp_plan is None,
            "sequence_parallel",
            "false unless the built-in Transformer's plan is used (a plan of your own decides its own styles)",
            True,
        )
    if case.loss_parallel:
        check(
            case.model.kind != "mlp" and case.loss in (None, *VOCABULARY_PARALLEL_LOSSES),
            "loss_parallel",
            "false for an MLP or a loss of your own (loss parallelism computes the cross-entropy; of the"
            f" losses named, only {', '.join(VOCABULARY_PARALLEL_LOSSES)} takes it)",
            True,
        )
    from fsdp_verify.engines.tensor_parallel import check_plan

    check_plan(case)


# The fields of the run that resumes, as the case spells them (`for_the_resumed_run`); ep and pp
# only where the case sets them (otherwise the resumed run's degree is the case's own, and what it
# refuses follows from the resumed world size or mesh).
_RESUMED_FIELDS = {
    "world_size": "resume_world_size",
    "mesh_shape": "resume_mesh_shape",
    "tp": "resume_tp",
    "engine": "resume_engine",
}


def for_the_resumed_run(e: CaseError, case: Case) -> CaseError:
    """`e`, raised by the resumed run's case (`Case.after_resume`), naming the case's field that
    set what it refused (`resume_tp` for its `tp`, `resume_ep` for its `ep` where set, ...)."""
    fields = dict(_RESUMED_FIELDS)
    fields.update({name: f"resume_{name}" for name in ("ep", "pp") if getattr(case, f"resume_{name}") is not None})
    return CaseError(fields.get(e.field_path, e.field_path), f"{e.expected} (for the resumed run)", e.got)


def fullgraph_breaks(case: Case) -> str | None:
    """Why fullgraph=True cannot hold for `case`, or None: what `compile_fullgraph` needs. A unit
    inside a compiled module (FSDP2 runs its hooks outside any graph: a graph break), or, under
    `units`, a unit that is a torch.nn module (its forward is in a file Dynamo skips, so there is
    no frame to compile, which fullgraph=True raises on: pytorch/pytorch#150915; judged by class
    name, as the model is known by its classes before it is built)."""
    if case.compile == "model":
        compiled = [""]
    else:
        compiled = [u for u in case.wrap_plan if u and (case.compile != "blocks" or units.is_block(u))]
    classes = module_classes(case.model)
    for outer in compiled:
        inner = next((u for u in case.wrap_plan if units.inside(u, outer)), None)
        if inner is not None:
            return (
                f"a unit's FSDP2 hooks run inside a compiled module (unit {inner!r} inside the compiled"
                f" {repr(outer) if outer else 'model'}): FSDP2 runs them outside any graph (a graph break),"
                " which fullgraph=True refuses"
            )
        if outer and _is_torch_nn(classes.get(outer)):
            return (
                f"a compiled unit is a torch.nn module ({outer!r}, {classes[outer]}): Dynamo skips its forward,"
                " so fullgraph=True finds no frame to compile (pytorch/pytorch#150915)"
            )
    return None


def _is_torch_nn(class_name: str | None) -> bool:
    import torch

    return class_name is not None and isinstance(getattr(torch.nn, class_name, None), type)


def _takes_four(fn: Any) -> bool:
    """Whether a user's step can be called as NAME(model, optimizer, batch, ctx): checked here, so
    a wrong signature is bad input named `step`, not a TypeError inside every rank."""
    import inspect

    if not callable(fn):
        return False
    try:
        inspect.signature(fn).bind(None, None, None, None)
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): let the call decide
        return True
    return True
