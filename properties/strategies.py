"""Hypothesis strategies that generate valid, tiny Cases.

`cases()` draws every field of a Case; `pins` fix some fields (a plain value) or draw them from a
strategy of your own, by Case field name or dotted nested name (`"optim.name"`, `"model.dropout"`).
The pieces (`precision_specs()`, `optim_specs()`, `data_specs()` here, `models()` and
`wrap_plans(spec)` in model_draws.py) compose on their own too. Each dimension's draw step sits in
its own module, named as its emulation under reference/ (tensor_parallel.py, expert_parallel.py,
pipeline_parallel.py; compile_draws.py), the pins every draw reads in pins.py.

Cases stay tiny (widths <= 40, <= 3 layers, <= 3 steps, small batches) so one costs well under a
second on CPU: the search's power comes from many cases, not big ones. Every draw shrinks towards
the simplest value (world size and steps towards the smallest, flags towards off), so Hypothesis's
shrinking ends at a small case a person can read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify import units
from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import (
    GRAD_REDUCTIONS,
    OPTIMIZERS,
    SCHEDULES,
    DataSpec,
    LossScaleSpec,
    OptimSpec,
    PrecisionSpec,
)
from fsdp_verify.dims import registry
from fsdp_verify.dtypes import DRAWABLE_POLICIES, PRECISION_POLICIES, canonical
from fsdp_verify.engines.placement import PLACEMENTS
from fsdp_verify.properties.compile_draws import with_compile
from fsdp_verify.properties.expert_parallel import (
    checkpointed_blocks_recomputed,
    grouped_experts,
    routing_never_decides_what_requires_grad,
)
from fsdp_verify.properties.fsdp1 import fsdp1_modelled
from fsdp_verify.properties.meshes import hsdp_meshes, takes_2d_meshes
from fsdp_verify.properties.model_draws import (
    custom_pins,
    experts_cannot_accumulate,
    frozen_in_units,
    ignored_draws,
    model_keywords,
    models,
    with_frozen_in_units,
    wrap_plans,
)
from fsdp_verify.properties.pins import (
    PinError,
    check_loss_scaling_pins,
    check_pin_names,
    check_pin_value,
    pinned,
    pins_under,
    valid_pin_names,
)
from fsdp_verify.properties.pipeline_parallel import pipelines
from fsdp_verify.properties.resumes import resumes
from fsdp_verify.properties.tensor_parallel import (
    sequence_parallel_norms_trainable,
    tp_clip,
    tp_divisible,
    tp_draws,
    tp_styles,
)
from fsdp_verify.properties.unit_groups import unit_groups

PRECISIONS = PRECISION_POLICIES
LEARNING_RATES = (1e-3, 1e-2, 1e-1)
# A tiny model's gradient norm is O(0.1..1), and O(0.01) with most of it frozen (whole units frozen
# are drawn): these clip on every step.
CLIP_NORMS = (1e-4, 1e-3)


# ---- precision, optimizer, data -----------------------------------------------------------------
def _policy_name(name: str) -> str:
    """`bfloat16` -> `bf16`, as everywhere (fsdp_verify.dtypes); an unknown name stays as it is."""
    try:
        return canonical(name)
    except ValueError:
        return name


def precision_specs(precisions: Iterable[str] = PRECISIONS, **pins: Any) -> SearchStrategy[PrecisionSpec]:
    """ "fp32": PrecisionSpec(); "bf16" (or "fp16"): bf16 (fp16) params, fp32 or bf16 (fp16)
    reduction, any output dtype, cast_forward_inputs on or off. `cases` gives "fp16" cases
    dynamic loss scaling."""
    precisions = tuple(_policy_name(p) for p in precisions)
    bad = [p for p in precisions if p not in DRAWABLE_POLICIES]
    if bad or not precisions:
        raise PinError(f"precisions: expected a non-empty subset of {DRAWABLE_POLICIES}, got {precisions!r}")

    def build(name: str) -> SearchStrategy[PrecisionSpec]:
        if name == "fp32":
            defaults = {
                "param_dtype": st.just(None),
                "reduce_dtype": st.just(None),
                "output_dtype": st.just(None),
                "cast_forward_inputs": st.just(True),
            }
        else:
            defaults = {
                "param_dtype": st.just(name),
                "reduce_dtype": st.sampled_from(("fp32", name)),
                "output_dtype": st.sampled_from((None, "fp32", name)),
                "cast_forward_inputs": st.sampled_from((True, False)),
            }
        return st.builds(PrecisionSpec, **{k: pinned(pins, k, v) for k, v in defaults.items()})

    return st.sampled_from(precisions).flatmap(build)


def optim_specs(**pins: Any) -> SearchStrategy[OptimSpec]:
    """SGD with momentum, Adam, AdamW with weight decay, Adagrad and RMSprop (state that is a
    running sum or average, and a scalar step), at a few learning rates; Adam(W) with or without
    AMSGrad's running max (a pinned `amsgrad` applies to the Adam(W) draws); a constant rate or
    one of the schedules (docs/optimizers-and-schedules.md). AMSGrad's max differs from the
    second moment only where the moment falls, which beta2 = 0.999 makes rare in three steps:
    its draws take beta2 = 0.5 too."""

    def build(name: str) -> SearchStrategy[OptimSpec]:
        decay = {
            "sgd": st.sampled_from((0.0, 0.01)),
            "adam": st.just(0.0),
            "adamw": st.sampled_from((0.01, 0.1)),
            "adagrad": st.sampled_from((0.0, 0.01)),
            "rmsprop": st.sampled_from((0.0, 0.01)),
        }
        adam = name in ("adam", "adamw")
        amsgrad = draw_amsgrad = st.booleans() if adam else st.just(False)
        if adam and "amsgrad" in pins:
            amsgrad = pinned(pins, "amsgrad", draw_amsgrad)

        def betas(uses_max: bool) -> SearchStrategy[tuple[float, float]]:
            return pinned(
                pins, "betas", st.sampled_from(((0.9, 0.999), (0.9, 0.5))) if uses_max else st.just((0.9, 0.999))
            )

        return amsgrad.flatmap(
            lambda uses_max: st.builds(
                OptimSpec,
                name=st.just(name),
                lr=pinned(pins, "lr", st.sampled_from(LEARNING_RATES)),
                momentum=pinned(
                    pins, "momentum", st.sampled_from((0.9, 0.0)) if name in ("sgd", "rmsprop") else st.just(0.9)
                ),
                weight_decay=pinned(pins, "weight_decay", decay[name]),
                betas=betas(uses_max),
                eps=pinned(pins, "eps", st.just(1e-8)),
                amsgrad=st.just(uses_max),
                schedule=pinned(pins, "schedule", st.sampled_from((None, *SCHEDULES))),
                schedule_factor=pinned(pins, "schedule_factor", st.sampled_from((0.5, 0.9))),
            )
        )

    return pinned(pins, "name", st.sampled_from(OPTIMIZERS)).flatmap(build)


def sync_values(model: ModelSpec, precision: PrecisionSpec) -> SearchStrategy[bool]:
    """Reduce every micro-batch, or only the last. Routed experts under a reduce dtype other than
    param_dtype reduce every micro-batch: FSDP2 cannot accumulate them without sync (an expert
    first reached in the last micro-batch brings a param_dtype gradient among the reduce_dtype
    accumulated ones; tests/upstream/test_fsdp2_no_sync_param_used_only_in_last_microbatch.py)."""
    if experts_cannot_accumulate(model, precision):
        return st.just(True)
    return st.sampled_from((True, False))


def unfreeze_steps(model: ModelSpec, steps: int) -> SearchStrategy[int | None]:
    """None, or a step from 2 to the last at which the frozen parameters start to train (a
    model with none frozen: None)."""
    if not model.frozen or steps < 2:
        return st.just(None)
    return st.one_of(st.just(None), st.integers(2, steps))


def loss_scale_specs(**pins: Any) -> SearchStrategy[LossScaleSpec]:
    """Scales from 2**10 to 2**26 around fp16's largest value (65504, about 2**16): a tiny model's
    gradients are O(0.01..1), so the scaled ones overflow on some steps and not on others, and
    near the edge only in their largest elements, which one rank's shard may hold alone. Growth
    every 1-3 good steps, so a 1-3 step case sees the scale grow, overflow and back off. Powers
    of two: scaling and unscaling are exact."""
    return st.builds(
        LossScaleSpec,
        init_scale=pinned(pins, "init_scale", st.integers(10, 26).map(lambda k: 2.0**k)),
        growth_factor=pinned(pins, "growth_factor", st.sampled_from((2.0, 4.0))),
        backoff_factor=pinned(pins, "backoff_factor", st.sampled_from((0.5, 0.125))),
        growth_interval=pinned(pins, "growth_interval", st.integers(1, 3)),
    )


def data_specs(batch_multiple: int = 1, model_kind: str = "mlp", **pins: Any) -> SearchStrategy[DataSpec]:
    """Global batches of 1-2 samples per rank per micro-batch (`batch_multiple` = world size x
    micro-batches). Cancellation data (seed 000's large, nearly cancelling values) only for MLPs;
    variable-length padded sequences only for token models."""
    kinds = ("normal", "cancellation") if model_kind == "mlp" else ("normal",)
    return st.builds(
        DataSpec,
        batch_size=pinned(pins, "batch_size", st.integers(1, 2).map(lambda k: k * batch_multiple)),
        kind=pinned(pins, "kind", st.sampled_from(kinds)),
        scale=pinned(pins, "scale", st.sampled_from((1.0, 0.01, 100.0))),
        padded=pinned(pins, "padded", st.just(False) if model_kind == "mlp" else st.booleans()),
    )


def reshard_values(world_size: int) -> SearchStrategy[bool | int]:
    """True, False, or an int FSDP2 accepts: a non-trivial divisor of the shard dimension (FSDP2's
    `_get_post_forward_mesh_info` rejects non-divisors and turns 1 and the full size into
    False and True; `fully_shard`'s docstring asks for a divisor excluding 1 and the size)."""
    divisors = [d for d in range(2, world_size) if world_size % d == 0]
    return st.one_of(st.booleans(), st.sampled_from(divisors)) if divisors else st.booleans()


# ---- whole cases --------------------------------------------------------------------------------
@st.composite
def _cases(
    draw: Callable,
    engine: str,
    world_sizes: tuple[int, ...],
    precisions: tuple[str, ...],
    model_kinds: tuple[str, ...],
    pins: dict[str, Any],
    hsdp: bool = False,
    compile_rate: float | None = None,
    tps: tuple[int, ...] = (1,),
    resume: bool = False,
) -> Case:
    def field(name: str, default: SearchStrategy) -> Any:
        return draw(pinned(pins, name, default))

    world = field("world_size", st.sampled_from(world_sizes))
    # The tp degree (docs/tensor-parallel.md): drawn only where asked (`tps`), so a seed's draws
    # without it stay what they were; the data-parallel ranks are then world / tp.
    tp = draw(st.sampled_from([t for t in tps if world % t == 0])) if tps != (1,) else 1
    dp = world // tp
    model = field("model", models(model_kinds, **pins_under(pins, "model")))
    # A resume may change the degree to any of `tps` (`resumes`): the model splits over each.
    split = math.lcm(*tps) if resume else tp
    if split > 1:
        model = tp_divisible(model, split, pins_under(pins, "model"))
    precision = field("precision", precision_specs(precisions, **pins_under(pins, "precision")))
    wrap = field("wrap", wrap_plans(model, precision=precision))
    steps = field("steps", st.integers(1, 3))
    microbatches = field("microbatches", st.integers(1, 4))
    optim = field("optim", optim_specs(**pins_under(pins, "optim")))
    data = field("data", data_specs(dp * microbatches, model.kind, **pins_under(pins, "data")))
    # A pinned int reshard_after_forward: only meshes whose shard dimension it divides (`cases`
    # left only the world sizes it divides).
    multiple = _pinned_reshard_int(engine, pins)
    mesh = field("mesh_shape", hsdp_meshes(dp, multiple) if hsdp else st.just(None))
    # An int divides the shard dimension (the mesh's last), not the world: (4, 1) takes none.
    # (Drawn here, where the dict below drew it first: a seed draws what it drew.)
    # Beside tp, True or False: an int below the shard group hangs FSDP2 on a sub-mesh (Case
    # refuses it; tests/upstream/test_fsdp2_int_reshard_on_a_submesh.py).
    ints = tp == 1 and _takes_reshard_ints(engine)
    rsf = field("reshard_after_forward", reshard_values(mesh[-1] if mesh else dp) if ints else st.booleans())
    values = {
        "model": model,
        "wrap": wrap,
        "world_size": world,
        "mesh_shape": mesh,
        "precision": precision,
        "reshard_after_forward": rsf,
        "optim": optim,
        "steps": steps,
        "microbatches": microbatches,
        "sync_every_microbatch": field("sync_every_microbatch", sync_values(model, precision)),
        "clip_norm": field("clip_norm", st.sampled_from((None,) + CLIP_NORMS)),
        "data": data,
        "seed": field("seed", st.integers(0, 2**16)),
        "data_seed": field("data_seed", st.integers(0, 2**16)),
        "init": field("init", st.sampled_from(("eager", "meta"))),
        "engine": field("engine", st.just(engine)),
        "step": field("step", st.just(None)),
        # Checkpointing recomputes each unit's forward in backward. Drawn for every engine alike:
        # one seed draws the same cases under any engine (a case's key leaves the engine out, and
        # a nightly diff of FSDP2 against a mutant compares them case by case).
        "activation_checkpointing": field("activation_checkpointing", st.booleans()),
        # Drawn for fp16 cases only, so fp32 and bf16 draws stay what they were.
        "loss_scaling": field(
            "loss_scaling",
            loss_scale_specs(**pins_under(pins, "loss_scaling")) if precision.param_dtype == "fp16" else st.just(None),
        ),
        # fully_shard's knobs (issue 28, items 1-4), drawn last so that the draws before them stay
        # what they were for a seed. An engine that cannot take them gets them pinned off by
        # `cases` (verify/engines/capabilities.py).
        "offload": field("offload", st.booleans()),
        # Not with an int reshard_after_forward between 1 and S: FSDP2 crashes there (Case refuses it).
        "shard_placement": field(
            "shard_placement",
            st.sampled_from(PLACEMENTS) if _shard1_takes(rsf, mesh[-1] if mesh else dp) else st.just("dim0"),
        ),
        "replica_sync_last": field(
            "replica_sync_last", st.booleans() if mesh is not None and len(mesh) == 2 else st.just(False)
        ),
        # What is trained changes: the frozen parameters train from this step on.
        "unfreeze_step": field(
            "unfreeze_step", unfreeze_steps(model, steps) if pins.get("step") is None else st.just(None)
        ),
        # Drawn after the rest, so a seed's earlier draws stay what they were.
        "reshard_after_backward_last": field(
            "reshard_after_backward_last", st.booleans() if pins.get("step") is None else st.just(False)
        ),
        # A SUM reduction with each rank's loss divided by the world size (a user's step scales its own).
        "grad_reduction": field(
            "grad_reduction", st.sampled_from(GRAD_REDUCTIONS) if pins.get("step") is None else st.just("avg")
        ),
        # Drawn last, so a seed's earlier draws stay what they were.
        "prefetch": field("prefetch", st.one_of(st.none(), st.integers(1, 2)) if not model.experts else st.none()),
    }
    # fully_shard's ignored_params: drawn last, where FSDP2 and the loop can take them (Case
    # refuses the rest: a user's step, low-precision parameters, a clip, routed experts).
    takes = pins.get("step") is None and precision.param_dtype in (None, "fp32")
    takes = takes and values["clip_norm"] is None and not model.experts
    values["ignored"] = field("ignored", ignored_draws(model) if takes else st.just(()))
    if tp > 1:
        values.update(tp=tp, **draw(tp_styles(model, values["precision"], pins, tp)))
        values["clip_norm"] = tp_clip(values)
    try:
        case = Case(**values)
    except CaseError:
        # Only pins can make a drawn case invalid (e.g. a pinned batch size the drawn world size
        # does not divide): discard the draw, Hypothesis draws another.
        assume(False)
        raise
    if "model.frozen" in pins or ("model" in pins and not isinstance(pins["model"], SearchStrategy)):
        return with_compile(draw, case, pins, compile_rate)  # the frozen set (or the whole model) is the user's
    # Frozen parameters mixed into the units (a whole frozen unit, a unit half frozen, the root's),
    # drawn last so that a seed's earlier draws stay what they were.
    model = with_frozen_in_units(model, draw(frozen_in_units(model, case.wrap_plan)))
    if model is not case.model:
        unfreeze = values["unfreeze_step"]
        if unfreeze is None and not case.model.frozen:  # none was drawn: nothing was frozen then
            unfreeze = field(
                "unfreeze_step", unfreeze_steps(model, steps) if pins.get("step") is None else st.just(None)
            )
        try:
            case = case.with_(model=model, unfreeze_step=unfreeze)
        except CaseError:
            assume(False)
            raise
    return with_compile(draw, case, pins, compile_rate)


def cases(
    *,
    engine: str = "fsdp2",
    world_sizes: Iterable[int] = (1, 2, 3, 4),
    precisions: Iterable[str] = PRECISIONS,
    model_kinds: Iterable[str] = ("mlp", "transformer"),
    hsdp: bool = False,
    custom_model: ModelSpec | None = None,
    resume: bool = False,
    compile_rate: float | None = None,
    **pins: Any,
) -> SearchStrategy[Case]:
    """Valid, tiny Cases for `engine`. `pins`: Case field names or dotted nested names mapped to a
    value (fixed) or a strategy (drawn from it), or the command line's flag names (`optimizer=
    ["adam", "sgd"]`, `sync_last=True`, `mesh_shape="2,2"`: verify/commands/case_flags.py); every
    other field is drawn. `model`: "mlp", "transformer", a user's factory as `check --model`
    spells it ("pkg.module:NAME" or "path/to/file.py:NAME", with `model_kwargs`, `init_fn`,
    `output_fn`, `shrinkable`) or a ModelSpec. For "fsdp1", only cases FSDP1 can express and the
    reference models (`fsdp1_modelled`). `compile_rate`: the share of cases torch.compile is drawn
    in, for an engine that takes it (None: the Hypothesis profile's, `profiles.COMPILE_RATES`);
    a `compile` pin draws it in every case."""
    from fsdp_verify.commands.case_flags import keyword_pins

    pins = keyword_pins(pins, valid_pin_names())
    model_kinds, custom_model, pins = model_keywords(model_kinds, custom_model, pins)
    check_pin_names(pins)
    for name, value in pins.items():
        check_pin_value(name, value)
    world_sizes, model_kinds = tuple(world_sizes), tuple(model_kinds)
    mesh = pins.get("mesh_shape")
    if isinstance(mesh, tuple) and mesh and all(isinstance(d, int) and d >= 1 for d in mesh):
        world_sizes = (math.prod(mesh),)  # a pinned mesh pins the world size (its product)
    precisions = tuple(_policy_name(p) for p in precisions)
    if not world_sizes or not all(isinstance(w, int) and w >= 1 for w in world_sizes):
        raise PinError(f"world_sizes: expected positive integers, got {world_sizes!r}")
    bad = [k for k in model_kinds if k not in ("mlp", "transformer")]
    if bad or not model_kinds:
        raise PinError(f"model_kinds: expected a non-empty subset of ('mlp', 'transformer'), got {model_kinds!r}")
    precision_specs(precisions)  # validates the names now, not at the first draw
    check_loss_scaling_pins(precisions, pins)
    if custom_model is not None:
        pins = custom_pins(custom_model, pins)
    hsdp = hsdp and takes_2d_meshes(engine, pins)
    tps, world_sizes, pins = tp_draws(engine, world_sizes, precisions, pins)
    world_sizes = _reshard_int_worlds(engine, world_sizes, pins)
    pins = _knob_pins(engine, pins)
    from fsdp_verify.engines import engine_capabilities

    rate = compile_rate  # None: the profile loaded when the case is drawn (`with_compile`)
    if engine == "fsdp1":
        pins = {"precision.output_dtype": None, **pins}  # FSDP1 has no output_dtype
        drawn = _cases(engine, tuple(sorted(world_sizes)), precisions, model_kinds, pins, hsdp, rate).filter(
            fsdp1_modelled
        )
    else:
        drawn = _cases(engine, tuple(sorted(world_sizes)), precisions, model_kinds, pins, hsdp, rate, tps, resume)
        if tps != (1,):
            drawn = drawn.map(sequence_parallel_norms_trainable)
    drawn = drawn.flatmap(lambda case: grouped_experts(case, pins))
    if "model.frozen" not in pins:
        drawn = drawn.map(routing_never_decides_what_requires_grad).map(checkpointed_blocks_recomputed)
    drawn = drawn.flatmap(lambda case: pipelines(case, pins))
    if "groups" in engine_capabilities(engine).takes:
        drawn = drawn.flatmap(lambda case: unit_groups(case, pins))
    if resume:  # docs/resume.md
        drawn = drawn.flatmap(lambda case: resumes(case, tuple(sorted(world_sizes)), hsdp, tps, pins))
    return _with_packages(drawn, engine, pins)


def _with_packages(drawn: SearchStrategy[Case], engine: str, pins: dict[str, Any]) -> SearchStrategy[Case]:
    """Each registered dimension package's draw step (verify/dims/registry.py), last, for an
    engine that takes it: on or off, beside what the together table allows."""
    from fsdp_verify.engines import engine_capabilities
    from fsdp_verify.engines.capabilities import not_declared

    takes = engine_capabilities(engine).takes
    for package in registry.packages():
        field = f"{registry.FIELD}.{package.name}"
        asked = {k: v for k, v in pins.items() if k.startswith(field + ".") and v not in (None, (), False)}
        if package.name not in takes and asked:
            key = next(iter(asked))
            raise PinError(f"{key}: expected {package.off!r}: {not_declared(engine, package.name)}, got {asked[key]!r}")
        if package.draw is not None and package.name in takes:
            drawn = drawn.flatmap(lambda case, p=package: p.draw(case, pins))
    return drawn


def _shard1_takes(rsf: bool | int, shard: int) -> bool:
    """Whether FSDP2 can take Shard(1) placements beside this reshard_after_forward (see Case)."""
    return isinstance(rsf, bool) or not 1 < rsf < shard


def _knob_pins(engine: str, pins: dict[str, Any]) -> dict[str, Any]:
    """Every optional knob the engine does not take (verify/engines/capabilities.py: engine-side
    ones it did not declare, loop-side ones its module lacks) pinned off, so it is never drawn; a
    pin that asks for one is refused now, naming the field and how an engine declares it."""
    from fsdp_verify.engines import engine_capabilities
    from fsdp_verify.engines.capabilities import KNOBS, not_declared

    taken = engine_capabilities(engine).taken()
    # a knob asked otherwise than by its field's value (units over several modules: an entry of
    # the plan) is drawn only for an engine that takes it (`unit_groups`), not pinned off here
    off = {k.field: k.off for k in KNOBS.values() if k.name not in taken and k.asks is None}
    for knob in KNOBS.values():
        given = pins.get(knob.field, knob.off)
        if knob.field in off and not isinstance(given, SearchStrategy) and given != knob.off:
            raise PinError(f"{knob.field}: expected {knob.off!r}: {not_declared(engine, knob.name)}, got {given!r}")
    refused = engine_capabilities(engine).compile_refusal(engine, pins.get("compile"), pins.get("compile_fullgraph"))
    if refused is not None:
        field, expected, got = refused
        raise PinError(f"{field}: expected {expected}, got {got!r}")
    wrap = pins.get("wrap")
    if "groups" not in taken and isinstance(wrap, tuple) and any(units.is_group(u) for u in wrap):
        raise PinError(f"wrap: expected units of one module each: {not_declared(engine, 'groups')}, got {wrap!r}")
    return {**pins, **off}


def _pinned_reshard_int(engine: str, pins: dict[str, Any]) -> int:
    """A pinned int reshard_after_forward the engine needs to divide the shard dimension
    (verify/engines/capabilities.py, `reshard_int_divides_shard`); 1 where there is none."""
    from fsdp_verify.engines import engine_capabilities

    rsf = pins.get("reshard_after_forward")
    if isinstance(rsf, bool) or not isinstance(rsf, int) or rsf < 1:
        return 1  # a bool, a strategy (its draws are judged as drawn) or a value check_pin_value refused
    return rsf if engine_capabilities(engine).reshard_int_divides_shard else 1


def _reshard_int_worlds(engine: str, world_sizes: tuple[int, ...], pins: dict[str, Any]) -> tuple[int, ...]:
    """The world sizes a pinned int reshard_after_forward can shard over: a shard dimension it
    divides needs a world size it divides (a 1-D mesh is the world, a 2-D one's shard dimension
    divides it). The draw then draws around the pin instead of drawing cases the engine refuses;
    none left is refused now, naming both options, as is a pinned mesh the int does not fit."""
    rsf = _pinned_reshard_int(engine, pins)
    mesh = pins.get("mesh_shape")
    if isinstance(mesh, tuple) and mesh and all(isinstance(d, int) for d in mesh) and mesh[-1] % rsf:
        raise PinError(
            f"reshard_after_forward: expected true, false or an int dividing the shard dimension {mesh[-1]} of the"
            f" pinned mesh_shape {mesh} (engine {engine!r}), got {rsf}"
        )
    world = pins.get("world_size")
    if isinstance(world, int) and not isinstance(world, bool) and world % rsf:
        raise PinError(
            f"reshard_after_forward: expected true, false or an int dividing the pinned world_size {world}"
            f" (engine {engine!r}), got {rsf}"
        )
    kept = tuple(w for w in world_sizes if w % rsf == 0)
    if not kept:
        raise PinError(
            f"reshard_after_forward: {rsf} divides the shard group of no world size in world_sizes"
            f" {tuple(world_sizes)} (engine {engine!r} needs an int that divides it): pin true, false or a divisor,"
            f" or draw world sizes that are multiples of {rsf} (--reshard-after-forward, --world-sizes)"
        )
    return kept


def _takes_reshard_ints(engine: str) -> bool:
    """Whether the engine takes an int reshard_after_forward (verify/engines/capabilities.py,
    `reshard_ints`); one that does not is drawn True or False."""
    from fsdp_verify.engines import engine_capabilities

    return engine_capabilities(engine).reshard_ints
