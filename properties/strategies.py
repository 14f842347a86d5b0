"""Hypothesis strategies that generate valid, tiny Cases.

`cases()` draws every field of a Case; `pins` fix some fields (a plain value) or draw them from a
strategy of your own, by Case field name or dotted nested name (`"optim.name"`, `"model.dropout"`).
The pieces (`models()`, `wrap_plans(spec)`, `precision_specs()`, `optim_specs()`, `data_specs()`)
compose on their own too.

Cases stay tiny (widths <= 40, <= 3 layers, <= 3 steps, small batches) so one costs well under a
second on CPU: the search's power comes from many cases, not big ones. Every draw shrinks towards
the simplest value (world size and steps towards the smallest, flags towards off), so Hypothesis's
shrinking ends at a small case a person can read.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import fields, replace
from functools import lru_cache
from typing import Any

import torch
from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import nn

from fsdp_verify import units
from fsdp_verify.case import (
    GRAD_REDUCTIONS,
    OPTIMIZERS,
    SCHEDULES,
    Case,
    CaseError,
    DataSpec,
    LossScaleSpec,
    ModelSpec,
    OptimSpec,
    PrecisionSpec,
    check_field_value,
)
from fsdp_verify.dims import registry
from fsdp_verify.dims.together import beside_another, drawn_off, not_modelled_beside, pinned_beside
from fsdp_verify.dtypes import DRAWABLE_POLICIES, PRECISION_POLICIES, canonical
from fsdp_verify.engines.placement import PLACEMENTS
from fsdp_verify.models import _construct
from fsdp_verify.properties.profiles import profile_compile_rate

PRECISIONS = PRECISION_POLICIES
MAX_WIDTH = 40
LEARNING_RATES = (1e-3, 1e-2, 1e-1)
# A tiny model's gradient norm is O(0.1..1), and O(0.01) with most of it frozen (whole units frozen
# are drawn): these clip on every step.
CLIP_NORMS = (1e-4, 1e-3)


class PinError(ValueError):
    """A pin names no field of a Case."""


# ---- pins ---------------------------------------------------------------------------------------
def _valid_pin_names() -> set[str]:
    names = {f.name for f in fields(Case)}
    for head, spec in (
        ("model", ModelSpec),
        ("precision", PrecisionSpec),
        ("optim", OptimSpec),
        ("data", DataSpec),
        ("loss_scaling", LossScaleSpec),
    ):
        names |= {f"{head}.{f.name}" for f in fields(spec)}
    for package in registry.packages():  # a dimension package's spec, whole or by field
        names |= {f"{registry.FIELD}.{package.name}"}
        names |= {f"{registry.FIELD}.{package.name}.{f.name}" for f in fields(package.spec)}
    return names


def _check_pins(pins: dict[str, Any]) -> None:
    unknown = sorted(set(pins) - _valid_pin_names())
    if unknown:
        raise PinError(f"pins: {unknown[0]!r} is no field of a Case (e.g. 'steps', 'optim.name', 'model.dropout')")


def _check_loss_scaling_pins(precisions: tuple[str, ...], pins: dict[str, Any]) -> None:
    """`loss_scaling.*` pins: fixed values validated now (CaseError naming the field, not a
    Hypothesis health check after every draw failed), and only where fp16 cases are drawn."""
    fixed = {k: v for k, v in _sub(pins, "loss_scaling").items() if not isinstance(v, SearchStrategy)}
    if (pins.get("loss_scaling") is not None or _sub(pins, "loss_scaling")) and "fp16" not in precisions:
        raise PinError("pins: loss_scaling is drawn for fp16 cases only (add --precisions fp16)")
    if fixed:
        LossScaleSpec(**fixed).validate()
    if pins.get("step") is not None and "fp16" in precisions:
        # Case validation refuses loss_scaling with a user's step (the scaler would be the
        # step's own), and every fp16 case is drawn with one: say so now, not after every draw.
        raise PinError("precisions: fp16 cases are drawn with loss scaling, which a user's step (--step) cannot take")


def check_pin_value(name: str, value: Any) -> None:
    """A pinned value no case could hold refused now, naming the field (`check_field_value`); a
    strategy is drawn from, and its draws are judged as drawn."""
    if not isinstance(value, SearchStrategy):
        check_field_value(name, value)


def _pinned(pins: dict[str, Any], name: str, default: SearchStrategy) -> SearchStrategy:
    """The strategy for field `name`: the pin (a strategy, or a value to fix) or the default."""
    if name not in pins:
        return default
    value = pins[name]
    return value if isinstance(value, SearchStrategy) else st.just(value)


def _sub(pins: dict[str, Any], head: str) -> dict[str, Any]:
    """The pins under `head.` with the prefix removed."""
    return {k.split(".", 1)[1]: v for k, v in pins.items() if k.startswith(head + ".")}


def _widths() -> SearchStrategy[int]:
    """1..MAX_WIDTH: primes, uneven splits over 2-4 ranks and one-element rows all occur. A plain
    integer range (no one_of with a list of favourites) keeps shrinking short."""
    return st.integers(1, MAX_WIDTH)


# ---- models -------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def _param_names(spec: ModelSpec) -> tuple[str, ...]:
    with torch.device("meta"):
        return tuple(name for name, _ in _construct(spec).named_parameters())


@st.composite
def _frozen(draw: Callable, spec: ModelSpec) -> tuple[str, ...]:
    """Up to two frozen parameters, never all of them (the optimizer needs something to train)."""
    names = _param_names(spec)
    if len(names) < 2:
        return ()
    return tuple(draw(st.lists(st.sampled_from(names), unique=True, max_size=min(2, len(names) - 1))))


def frozen_in_units(spec: ModelSpec, plan: tuple[str, ...]) -> SearchStrategy[tuple[str, ...]]:
    """More frozen parameters, aimed at the wrap plan's units (issue 28, item 4: "frozen parameters
    mixed into any unit"): up to two units, the root among them, each frozen whole (every
    parameter it owns: a unit with nothing to reduce) or in part (a proper subset of them: a unit
    that reduces some of its parameters and not others). `_frozen`'s two parameters anywhere reach
    neither a whole unit of more than two parameters nor a chosen mix in one. Shrinks to nothing."""
    from fsdp_verify.units import owner_of_module

    owned: dict[str, list[str]] = {}
    for name in _param_names(spec):
        owned.setdefault(owner_of_module(plan, name.rpartition(".")[0]) or "", []).append(name)
    units = sorted(owned)  # the root ("") first: shrinks towards it

    @st.composite
    def draw_frozen(draw: Callable) -> tuple[str, ...]:
        picks = draw(st.lists(st.tuples(st.sampled_from(units), st.booleans()), max_size=2, unique_by=lambda t: t[0]))
        frozen: list[str] = []
        for unit, part in picks:
            own = owned[unit]
            if part and len(own) > 1:
                frozen += draw(st.lists(st.sampled_from(own), min_size=1, max_size=len(own) - 1, unique=True))
            else:
                frozen += own
        return tuple(frozen)

    return draw_frozen()


def _with_frozen_in_units(spec: ModelSpec, more: tuple[str, ...]) -> ModelSpec:
    """`spec` with `more` frozen too, unless that would freeze every parameter outside the routed
    experts (the optimizer needs something to train, and an expert may see no sample): then as
    it was."""
    from fsdp_verify.models import is_frozen

    frozen = spec.frozen + tuple(n for n in more if not is_frozen(spec, n))
    merged = replace(spec, frozen=frozen)
    # A routed expert may be reached by no sample: something outside the experts must train too.
    outside = [n for n in _param_names(spec) if not n.startswith("moe.experts.")]
    if frozen == spec.frozen or all(is_frozen(merged, n) for n in outside):
        return spec
    return merged


@st.composite
def _mlp(draw: Callable, pins: dict[str, Any]) -> ModelSpec:
    widths = draw(_pinned(pins, "widths", st.lists(_widths(), min_size=2, max_size=4).map(tuple)))
    dropout = draw(_pinned(pins, "dropout", st.sampled_from((0.0, 0.1, 0.5))))
    # Routed experts: with 1-2 samples a rank and micro-batch, some expert is often reached by none.
    experts = draw(_pinned(pins, "experts", st.sampled_from((0, 2, 3))))
    spec = ModelSpec(kind="mlp", widths=widths, dropout=dropout, experts=experts)
    frozen = draw(_pinned(pins, "frozen", _frozen(spec)))
    return ModelSpec(kind="mlp", widths=widths, dropout=dropout, frozen=frozen, experts=experts)


@st.composite
def _transformer(draw: Callable, pins: dict[str, Any]) -> ModelSpec:
    n_heads = draw(_pinned(pins, "n_heads", st.sampled_from((1, 2, 4))))
    head_dim = draw(st.sampled_from((2, 4, 6, 8)))  # RoPE rotates pairs: even
    values = {
        "vocab_size": draw(_pinned(pins, "vocab_size", st.integers(2, 40))),
        "dim": draw(_pinned(pins, "dim", st.just(n_heads * head_dim))),
        "n_layers": draw(_pinned(pins, "n_layers", st.integers(1, 3))),
        "n_heads": n_heads,
        "ffn_hidden": draw(_pinned(pins, "ffn_hidden", _widths())),
        "seq_len": draw(_pinned(pins, "seq_len", st.integers(1, 8))),
        "tie_embeddings": draw(_pinned(pins, "tie_embeddings", st.booleans())),
        "dropout": draw(_pinned(pins, "dropout", st.sampled_from((0.0, 0.1)))),
    }
    spec = ModelSpec(kind="transformer", **values)
    frozen = draw(_pinned(pins, "frozen", _frozen(spec)))
    return ModelSpec(kind="transformer", frozen=frozen, **values)


def models(kinds: Iterable[str] = ("mlp", "transformer"), **pins: Any) -> SearchStrategy[ModelSpec]:
    """ModelSpecs of the given kinds; `pins` by ModelSpec field name (`widths`, `dropout`, ...)."""
    kinds = tuple(kinds)
    kind_strategy = _pinned(pins, "kind", st.sampled_from(kinds))
    rest = {k: v for k, v in pins.items() if k != "kind"}
    return kind_strategy.flatmap(lambda kind: _mlp(rest) if kind == "mlp" else _transformer(rest))


@st.composite
def _custom(draw: Callable, base: ModelSpec, pins: dict[str, Any]) -> ModelSpec:
    """A user's model as given (factory and kwargs fixed); drawn: the sequence length of its
    token batches and up to two frozen parameters."""
    seq_len = draw(_pinned(pins, "seq_len", st.integers(1, 8)))
    spec = replace(base, seq_len=seq_len)
    return replace(spec, frozen=draw(_pinned(pins, "frozen", _frozen(spec))))


# ---- wrap plans ---------------------------------------------------------------------------------
def _splits_a_tie(fqn: str, ties: tuple[tuple[str, ...], ...]) -> bool:
    """Would wrapping module `fqn` on its own put tied parameters into two units?"""
    inside = [[n.startswith(fqn + ".") for n in names] for names in ties]
    return any(any(flags) and not all(flags) for flags in inside)


@lru_cache(maxsize=1024)
def _custom_wrappable(spec: ModelSpec) -> tuple[str, ...]:
    """A user's model: each module class (every module of that class is one unit: torchtitan's
    and accelerate's plans) and each module by FQN, except containers and what would split
    tied parameters between units."""
    from fsdp_verify.models.custom import info

    model = info(spec)
    containers = {"ModuleList", "ModuleDict", "Sequential"}
    fqns = [n for n, c in model.classes.items() if n and c not in containers and not _splits_a_tie(n, model.tied)]
    by_class: dict[str, list[str]] = {}
    for n, c in model.classes.items():
        if n:
            by_class.setdefault(c, []).append(n)
    classes = [
        c
        for c, names in by_class.items()
        if c not in containers and all(n in fqns for n in names) and c not in model.classes.get("", "")
    ]
    return tuple(classes) + tuple(fqns)


@lru_cache(maxsize=1024)
def _wrappable(spec: ModelSpec) -> tuple[str, ...]:
    """Modules whose forward runs (so FSDP2's hooks fire): not the root, not a ModuleList."""
    if spec.is_custom:
        return _custom_wrappable(spec)
    with torch.device("meta"):
        model = _construct(spec)
    out = []
    for name, module in model.named_modules():
        if name.startswith("moe.experts"):
            continue  # a routed expert's forward runs on some ranks only: never a unit (Case._validate_wrap)
        if name and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            if spec.tie_embeddings and name in ("tok_embeddings", "output"):
                continue  # tied: both must stay with the root in one unit
            out.append(name)
    return tuple(out)


def _order(units: Iterable[str]) -> tuple[str, ...]:
    """Children before parents (deepest first), then the root."""
    return tuple(sorted(units, key=lambda n: (-n.count("."), n))) + ("",)


def _runs_in(name: str, spec: ModelSpec, precision: PrecisionSpec | None) -> bool:
    """Can the built-in model run with `name` as its own unit under `precision`? Two limits of the
    models, not of any engine (found by running FSDP2 on generated plans):
    * MLP, cast_forward_inputs=False: MLPBlock casts its input to its Linear's weight dtype, which a
      separately wrapped Linear has only after its own pre-forward (still the fp32 shard before):
      the Linear then gets fp32 input and bf16 weights.
    * Transformer, output_dtype other than the param dtype: a unit's fp32 output that meets a bf16
      tensor in a matmul or attention outside any unit fails. Blocks, attention, feed-forward,
      dropouts, wo, w2, the embeddings and the output layer feed the residual stream or the loss
      (dtype-tolerant); q/k/v, w1/w3 and the norms feed matmuls directly.
    """
    if precision is None or precision.param_dtype in (None, "fp32") or spec.is_custom:
        return True  # a custom model's cases keep cast_forward_inputs on and no output_dtype
    leaf = name.rsplit(".", 1)[-1]
    if spec.kind == "mlp":
        return precision.cast_forward_inputs or leaf != "linear"
    if precision.output_dtype not in (None, precision.param_dtype):
        return leaf not in ("wq", "wk", "wv", "w1", "w3", "attention_norm", "ffn_norm", "norm")
    return True


def wrap_plans(
    spec: ModelSpec, max_units: int = 8, precision: PrecisionSpec | None = None
) -> SearchStrategy[tuple[str, ...]]:
    """Up to `max_units` of the wrappable modules (nested plans included), then the root; shrinks
    towards root only. The cap keeps a case cheap: every unit adds collectives per step. With
    `precision`, only units the model can run with under it (`_runs_in`)."""
    candidates = [name for name in _wrappable(spec) if _runs_in(name, spec, precision)]
    if not candidates:
        return st.just(("",))
    if spec.is_custom:  # class names among the entries: the Case orders the expanded plan
        return st.lists(st.sampled_from(candidates), unique=True, max_size=max_units).map(
            lambda units: tuple(units) + ("",)
        )
    return st.lists(st.sampled_from(candidates), unique=True, max_size=max_units).map(_order)


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
        return st.builds(PrecisionSpec, **{k: _pinned(pins, k, v) for k, v in defaults.items()})

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
            amsgrad = _pinned(pins, "amsgrad", draw_amsgrad)

        def betas(uses_max: bool) -> SearchStrategy[tuple[float, float]]:
            return _pinned(
                pins, "betas", st.sampled_from(((0.9, 0.999), (0.9, 0.5))) if uses_max else st.just((0.9, 0.999))
            )

        return amsgrad.flatmap(
            lambda uses_max: st.builds(
                OptimSpec,
                name=st.just(name),
                lr=_pinned(pins, "lr", st.sampled_from(LEARNING_RATES)),
                momentum=_pinned(
                    pins, "momentum", st.sampled_from((0.9, 0.0)) if name in ("sgd", "rmsprop") else st.just(0.9)
                ),
                weight_decay=_pinned(pins, "weight_decay", decay[name]),
                betas=betas(uses_max),
                eps=_pinned(pins, "eps", st.just(1e-8)),
                amsgrad=st.just(uses_max),
                schedule=_pinned(pins, "schedule", st.sampled_from((None, *SCHEDULES))),
                schedule_factor=_pinned(pins, "schedule_factor", st.sampled_from((0.5, 0.9))),
            )
        )

    return _pinned(pins, "name", st.sampled_from(OPTIMIZERS)).flatmap(build)


def sync_values(model: ModelSpec, precision: PrecisionSpec) -> SearchStrategy[bool]:
    """Reduce every micro-batch, or only the last. Routed experts under a reduce dtype other than
    param_dtype reduce every micro-batch: FSDP2 cannot accumulate them without sync (an expert
    first reached in the last micro-batch brings a param_dtype gradient among the reduce_dtype
    accumulated ones; tests/upstream/test_fsdp2_no_sync_param_used_only_in_last_microbatch.py)."""
    low = precision.param_dtype not in (None, "fp32")
    if model.experts and low and precision.reduce_dtype not in (None, precision.param_dtype):
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
        init_scale=_pinned(pins, "init_scale", st.integers(10, 26).map(lambda k: 2.0**k)),
        growth_factor=_pinned(pins, "growth_factor", st.sampled_from((2.0, 4.0))),
        backoff_factor=_pinned(pins, "backoff_factor", st.sampled_from((0.5, 0.125))),
        growth_interval=_pinned(pins, "growth_interval", st.integers(1, 3)),
    )


def data_specs(batch_multiple: int = 1, model_kind: str = "mlp", **pins: Any) -> SearchStrategy[DataSpec]:
    """Global batches of 1-2 samples per rank per micro-batch (`batch_multiple` = world size x
    micro-batches). Cancellation data (seed 000's large, nearly cancelling values) only for MLPs;
    variable-length padded sequences only for token models."""
    kinds = ("normal", "cancellation") if model_kind == "mlp" else ("normal",)
    return st.builds(
        DataSpec,
        batch_size=_pinned(pins, "batch_size", st.integers(1, 2).map(lambda k: k * batch_multiple)),
        kind=_pinned(pins, "kind", st.sampled_from(kinds)),
        scale=_pinned(pins, "scale", st.sampled_from((1.0, 0.01, 100.0))),
        padded=_pinned(pins, "padded", st.just(False) if model_kind == "mlp" else st.booleans()),
    )


def ignored_draws(model: ModelSpec) -> SearchStrategy[tuple[str, ...]]:
    """None ignored (shrinks there), one parameter, or one module's parameters (a whole unit,
    or part of one) for `ignored`; never all of them (Case refuses that)."""
    from fsdp_verify.models import is_ignored, parameter_names

    names = parameter_names(model)
    modules = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    choices = [(p,) for p in [*names, *modules] if not all(is_ignored((p,), n) for n in names)]
    return st.one_of(st.just(()), st.sampled_from(choices)) if choices else st.just(())


def reshard_values(world_size: int) -> SearchStrategy[bool | int]:
    """True, False, or an int FSDP2 accepts: a non-trivial divisor of the shard dimension (FSDP2's
    `_get_post_forward_mesh_info` rejects non-divisors and turns 1 and the full size into
    False and True; `fully_shard`'s docstring asks for a divisor excluding 1 and the size)."""
    divisors = [d for d in range(2, world_size) if world_size % d == 0]
    return st.one_of(st.booleans(), st.sampled_from(divisors)) if divisors else st.booleans()


def hsdp_meshes(world_size: int, shard_multiple: int = 1) -> SearchStrategy[tuple[int, int] | None]:
    """None (1-D) or a 2-D mesh (replicate, shard) for every factoring of the world size, the
    degenerate ones included: (1, W) (FSDP2 all-reduces over one replica), (W, 1) (pure
    replication, no all-gather) and (1, 1) at one rank; `cases(hsdp=True)` draws it for an engine
    that takes 2-D meshes (verify/engines/capabilities.py). Shrinks towards None. With
    `shard_multiple` (a pinned int reshard_after_forward), only meshes whose shard dimension it
    divides; the world size must be a multiple of it."""
    shapes = [(r, world_size // r) for r in range(1, world_size + 1) if world_size % r == 0]
    return st.sampled_from([None, *(m for m in shapes if m[1] % shard_multiple == 0)])


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
        return draw(_pinned(pins, name, default))

    world = field("world_size", st.sampled_from(world_sizes))
    # The tp degree (docs/tensor-parallel.md): drawn only where asked (`tps`), so a seed's draws
    # without it stay what they were; the data-parallel ranks are then world / tp.
    tp = draw(st.sampled_from([t for t in tps if world % t == 0])) if tps != (1,) else 1
    dp = world // tp
    model = field("model", models(model_kinds, **_sub(pins, "model")))
    # A resume may change the degree to any of `tps` (`resumes`): the model splits over each.
    split = math.lcm(*tps) if resume else tp
    if split > 1:
        model = tp_divisible(model, split, _sub(pins, "model"))
    precision = field("precision", precision_specs(precisions, **_sub(pins, "precision")))
    wrap = field("wrap", wrap_plans(model, precision=precision))
    steps = field("steps", st.integers(1, 3))
    microbatches = field("microbatches", st.integers(1, 4))
    optim = field("optim", optim_specs(**_sub(pins, "optim")))
    data = field("data", data_specs(dp * microbatches, model.kind, **_sub(pins, "data")))
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
            loss_scale_specs(**_sub(pins, "loss_scaling")) if precision.param_dtype == "fp16" else st.just(None),
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
        values["clip_norm"] = _tp_clip(values)
    try:
        case = Case(**values)
    except CaseError:
        # Only pins can make a drawn case invalid (e.g. a pinned batch size the drawn world size
        # does not divide): discard the draw, Hypothesis draws another.
        assume(False)
        raise
    if "model.frozen" in pins or ("model" in pins and not isinstance(pins["model"], SearchStrategy)):
        return _with_compile(draw, case, pins, compile_rate)  # the frozen set (or the whole model) is the user's
    # Frozen parameters mixed into the units (a whole frozen unit, a unit half frozen, the root's),
    # drawn last so that a seed's earlier draws stay what they were.
    model = _with_frozen_in_units(model, draw(frozen_in_units(model, case.wrap_plan)))
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
    return _with_compile(draw, case, pins, compile_rate)


def compile_scopes(case: Case, rate: float, engine_scopes: tuple[str, ...] | None = None) -> SearchStrategy[str | None]:
    """None, or a compile scope with probability `rate` (the profile's: `profiles.COMPILE_RATES`):
    "units" where the plan has a unit besides the root, else "model"; for an engine that compiles
    only some scopes (`Capabilities.compile_scopes`: torchtitan's "blocks"), those the plan allows.
    "blocks" is otherwise drawn where asked (`--compile units model blocks`), so that a seed draws
    what it drew before. None where the case cannot be compiled (verify/dims/together.py: Case
    refuses them). Shrinks to None."""
    if rate <= 0 or not_modelled_beside(case, "compile") is not None:
        return st.just(None)
    scopes = ("units", "model") if len(case.wrap_plan) > 1 else ("model",)
    if engine_scopes is not None:
        has_block = any(units.is_block(u) for u in case.wrap_plan)
        scopes = tuple(s for s in (*scopes, "blocks") if s in engine_scopes and (s != "blocks" or has_block))
        if not scopes:
            return st.just(None)
    hundredths = round(100 * min(rate, 1.0))
    return st.integers(0, 99).flatmap(lambda k: st.sampled_from(scopes) if k >= 100 - hundredths else st.none())


def fullgraph_takes(case: Case) -> bool:
    """Whether fullgraph=True can hold: no unit's FSDP2 hooks (outside any graph) inside a
    compiled module (Case refuses the rest)."""
    from fsdp_verify.case import fullgraph_breaks

    return fullgraph_breaks(case) is None


# Compile backends drawn unless pinned (see `_with_compile`): Dynamo alone and Dynamo with
# AOTAutograd. Inductor where asked (`--compile-backend inductor`; the slow tests run it): a
# case of new shapes compiles new kernels, seconds each (docs/compile.md, Cost).
DRAWN_BACKENDS = ("eager", "aot_eager")


def _with_compile(draw: Callable, case: Case, pins: dict[str, Any], rate: float | None) -> Case:
    """`case` with torch.compile drawn last (docs/compile.md), so that a seed's earlier draws stay
    what they were, and nothing drawn at all where the rate is 0 or the engine does not take it
    (`_knob_pins` pinned it off): a seed then draws what it drew before."""
    from fsdp_verify.checks.compiler import redraws_dropout
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(case.engine)
    rate = profile_compile_rate() if rate is None else rate
    scope = draw(_pinned(pins, "compile", compile_scopes(case, rate, capabilities.compile_scopes)))
    if scope is None:
        return case
    try:  # a pinned scope the drawn case cannot take ("units" with the root alone) is discarded
        with_scope = case.with_(compile=scope)
        takes = fullgraph_takes(with_scope)
        fullgraph_choices = st.booleans() if takes else st.just(False)
        if capabilities.compile_fullgraph is not None:  # the engine's way (torchtitan: always fullgraph)
            if capabilities.compile_fullgraph and not takes:
                assume("compile" not in pins)
                return case
            fullgraph_choices = st.just(capabilities.compile_fullgraph)
        fullgraph = draw(_pinned(pins, "compile_fullgraph", fullgraph_choices))
        # Unpinned, among DRAWN_BACKENDS. Never the ingredients of a known
        # PyTorch bug (verify/checks/compiler.py `redraws_dropout`): then nothing is compiled, and
        # where the scope is pinned (`--compile units`) the draw is discarded instead.
        backends = [b for b in DRAWN_BACKENDS if not redraws_dropout(with_scope.with_(compile_backend=b))]
        if "compile_backend" not in pins and not backends:
            assume("compile" not in pins)
            return case
        backend = draw(_pinned(pins, "compile_backend", st.sampled_from(backends)))
        compiled = with_scope.with_(compile_fullgraph=fullgraph, compile_backend=backend)
        # a pinned eager backend: the bug's other ingredients are not drawn beside it unless pinned too
        asked = "activation_checkpointing" in pins and ("model.dropout" in pins or "dropout" in pins)
        assume(asked or not redraws_dropout(compiled))
        return compiled
    except CaseError:
        assume(False)
        raise


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

    pins = keyword_pins(pins, _valid_pin_names())
    model_kinds, custom_model, pins = _model_keywords(model_kinds, custom_model, pins)
    _check_pins(pins)
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
    _check_loss_scaling_pins(precisions, pins)
    if custom_model is not None:
        pins = _custom_pins(custom_model, pins)
    hsdp = hsdp and _takes_2d_meshes(engine, pins)
    tps, world_sizes, pins = _tp_draws(engine, world_sizes, precisions, pins)
    world_sizes = _reshard_int_worlds(engine, world_sizes, pins)
    pins = _knob_pins(engine, pins)
    from fsdp_verify.engines import engine_capabilities

    rate = compile_rate  # None: the profile loaded when the case is drawn (`_with_compile`)
    if engine == "fsdp1":
        pins = {"precision.output_dtype": None, **pins}  # FSDP1 has no output_dtype
        drawn = _cases(engine, tuple(sorted(world_sizes)), precisions, model_kinds, pins, hsdp, rate).filter(
            fsdp1_modelled
        )
    else:
        drawn = _cases(engine, tuple(sorted(world_sizes)), precisions, model_kinds, pins, hsdp, rate, tps, resume)
        if tps != (1,):
            drawn = drawn.map(_sequence_parallel_norms_trainable)
    drawn = drawn.flatmap(lambda case: grouped_experts(case, pins))
    if "model.frozen" not in pins:
        drawn = drawn.map(_routing_never_decides_what_requires_grad)
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


@st.composite
def resumes(
    draw: Callable,
    case: Case,
    world_sizes: tuple[int, ...],
    hsdp: bool = False,
    tps: tuple[int, ...] = (1,),
    pins: dict[str, Any] | None = None,
) -> Case:
    """`case` with a checkpoint and resume (docs/resume.md): saved after a drawn step (two steps
    at least), resumed on a drawn world size and mesh, and from FSDP1 on FSDP2 or FSDP1. The
    global batch becomes a multiple of both runs' data-parallel ranks (times the micro-batches)
    where the drawn one is not: one batch the same for both runs. Where tp is asked (`tps`, the
    degrees drawn among), the tp degree the run resumes with too, among those dividing the drawn
    world size (the model splits over each: `_cases`); a clip the resumed plan cannot take
    (parameters off its tp mesh) is dropped. Where expert parallelism was asked (`pins`: `--ep`,
    `resume_ep`), grouped experts resume on a drawn ep degree (`_resumed_ep`); a drawn pipeline
    on a drawn pipeline degree (`_resumed_pp`). A user's step takes no resume: not drawn."""
    from fsdp_verify.engines import refuse_untakeable

    assume(case.step is None)
    steps = max(case.steps, 2)
    after = draw(st.integers(1, steps - 1))
    world = draw(st.sampled_from(world_sizes))
    # Drawn only where tp is asked, so a seed's draws without it stay what they were.
    tp = draw(st.sampled_from([t for t in tps if world % t == 0])) if tps != (1,) else 1
    pp = draw(_resumed_pp(case, pins or {}, world // tp))  # the stages divide a tp rank's ranks
    stage_ranks = world // tp // (case.pp if pp is None else pp)  # the data-parallel part of the mesh
    mesh = draw(hsdp_meshes(stage_ranks)) if hsdp else None
    engine = draw(st.sampled_from((None, "fsdp2"))) if case.engine == "fsdp1" else None
    batch = case.data.batch_size
    ranks = world // tp  # the resumed run's data-parallel ranks times its stages (a pipeline's batch is whole)
    if batch % (ranks * case.microbatches):
        batch = math.lcm(case.world_size // case.tp, ranks) * case.microbatches
    changes = dict(
        steps=steps,
        resume_after=after,
        resume_world_size=world,
        resume_mesh_shape=mesh,
        resume_engine=engine,
        resume_tp=tp if tp != case.tp else None,
        resume_ep=draw(_resumed_ep(case, pins or {}, mesh[-1] if mesh else stage_ranks)),
        resume_pp=pp,
        **{"data.batch_size": batch},
    )
    try:
        try:
            resumed = case.with_(**changes)
        except CaseError as e:
            if e.field_path != "clip_norm" or case.clip_norm is None:
                raise
            resumed = case.with_(clip_norm=None, **changes)
    except CaseError:
        assume(False)
        raise
    assume(resumed.engine != "fsdp1" or fsdp1_modelled(resumed))  # the saving run's checkpoint
    resumed_run = resumed.after_resume()
    assume(resumed_run.engine != "fsdp1" or fsdp1_modelled(resumed_run))
    try:
        refuse_untakeable(resumed_run)  # e.g. an int reshard_after_forward the new shard group does not divide
    except CaseError:
        assume(False)
    return resumed


def _resumed_ep(case: Case, pins: dict[str, Any], shard: int) -> SearchStrategy[int | None]:
    """The ep degree a resume of grouped experts takes on the resumed shard dimension `shard`:
    only where ep was asked (a pin of `ep` or `resume_ep`; an engine that does not take `ep` has it
    pinned to 1 by `_knob_pins`, so a plain plug-in is never drawn one), any degree that divides
    the experts and `shard` (or 1: every expert on every rank), or the pin; None (as before)
    elsewhere. The Case refuses a pinned one the resumed run cannot take: not this draw."""
    if case.model.grouped_experts is None or not _asked(pins, {"ep": 1, "resume_ep": None}):
        return st.none()
    return _pinned(pins, "resume_ep", _one_or_more(_ep_degrees(case, case.model, shard)))


def _resumed_pp(case: Case, pins: dict[str, Any], world: int) -> SearchStrategy[int | None]:
    """The pipeline degree a pipelined case resumes with on `world` ranks (those of one tp rank,
    beside tp): where a pipeline was
    drawn (so asked, for an engine that takes `pp`), any degree that divides `world` and that the
    schedule, the blocks and the micro-batches fit (or 1: no stages), or the pin; None (as
    before) elsewhere. A resume into stages from a case without them is `check --resume-pp`'s."""
    if case.pp == 1 or case.model.is_custom:  # a user's split: asked for its own stage count only
        assume(pins.get("resume_pp") in (None, 1, case.pp))
        return st.none()
    blocks = case.model.n_blocks
    degrees = [
        d
        for d in range(2, world + 1)
        if world % d == 0 and _schedule_fits(case.pp_schedule, d, blocks, case.microbatches)
    ]
    return _pinned(pins, "resume_pp", _one_or_more(degrees))


def _one_or_more(degrees: list[int]) -> SearchStrategy[int]:
    """A resumed degree: 1 half the time, one of `degrees` (above 1) the other half, where any
    fits (the resumed world sizes 1 and 3 take none above 1: without this, 1 drew most resumes)."""
    if not degrees:
        return st.just(1)
    # a coin, not `one_of`: one_of's branch drew 1 in all but 6 of a 60-case seed's resumes
    return st.booleans().flatmap(lambda above: st.sampled_from(degrees) if above else st.just(1))


_MODEL_EXPECTED = (
    "'mlp', 'transformer', a model factory 'pkg.module:NAME' or 'path/to/file.py:NAME' (as `check --model`"
    " takes it), a ModelSpec or a strategy of ModelSpecs"
)
_FACTORY_KEYWORDS = ("model_kwargs", "init_fn", "output_fn", "shrinkable")


def _model_keywords(
    model_kinds: tuple[str, ...], custom_model: Any, pins: dict[str, Any]
) -> tuple[tuple[str, ...], ModelSpec | None, dict[str, Any]]:
    """`model=` and a factory's keywords as the command line takes them: a built-in kind restricts
    `model_kinds`, a factory's import string (or a custom ModelSpec) becomes `custom_model`. A value
    of another type is a TypeError naming the argument, not an AttributeError inside a draw."""
    import json

    from fsdp_verify.models.spec import is_import_path

    pins = dict(pins)
    extras = {k: pins.pop(k) for k in _FACTORY_KEYWORDS if k in pins}
    model = pins.get("model")
    if custom_model is not None and not (isinstance(custom_model, ModelSpec) and custom_model.is_custom):
        raise TypeError(f"custom_model: expected a ModelSpec with kind='custom', got {custom_model!r}")
    if isinstance(model, str):
        del pins["model"]
        if model in ("mlp", "transformer"):
            model_kinds = (model,)
        elif is_import_path(model):
            custom_model = ModelSpec(kind="custom", factory=model)
        else:
            raise TypeError(f"model: expected {_MODEL_EXPECTED}, got {model!r}")
    elif isinstance(model, ModelSpec):
        if model.is_custom:
            custom_model = pins.pop("model")
    elif "model" in pins and not isinstance(model, SearchStrategy):
        raise TypeError(f"model: expected {_MODEL_EXPECTED}, got {type(model).__name__} {model!r}")
    if extras:
        if custom_model is None:
            raise TypeError(f"{', '.join(extras)}: only with a user's model (model='pkg.module:NAME')")
        changes = {k.removeprefix("model_"): v for k, v in extras.items()}
        if isinstance(changes.get("kwargs"), str):
            try:
                changes["kwargs"] = json.loads(changes["kwargs"])
            except json.JSONDecodeError as e:
                raise TypeError(
                    f"model_kwargs: expected a dict or a JSON object, got {extras['model_kwargs']!r} ({e})"
                ) from None
        if isinstance(changes.get("shrinkable"), (str, list)):
            from fsdp_verify.commands.case_flags import names

            raw = changes["shrinkable"]
            changes["shrinkable"] = names(raw) if isinstance(raw, str) else tuple(raw)
        custom_model = replace(custom_model, **changes)
    return model_kinds, custom_model, pins


GROUPED_FIELDS = ("model.top_k", "model.capacity_factor", "model.aux_loss", "model.router_bias")
# What asks for each composition's draw: a pin of one of these fields to anything but its value
# when off (a strategy counts as asking). Unasked, the composition draws nothing at all, so a
# seed draws the cases it drew before it existed (as tp and compile: drawn where asked).
ASKS_GROUPED = {
    "ep": 1,
    "model.top_k": None,
    "model.capacity_factor": None,
    "model.aux_loss": 0.0,
    "model.router_bias": 0.0,
}
ASKS_PIPELINE = {"pp": 1, "pp_schedule": None, "pp_split": None, "pp_scale_grads": True}


def _asked(pins: dict[str, Any], asks: dict[str, Any]) -> bool:
    """Whether a pin asks for a composition (`ASKS_GROUPED`, `ASKS_PIPELINE`)."""
    return any(
        name in pins and (isinstance(pins[name], SearchStrategy) or pins[name] != off) for name, off in asks.items()
    )


def group_candidates(case: Case) -> list[tuple[str, ...]]:
    """Units of the plan that one `fully_shard([...])` could cover instead (verify/units.py):
    runs of two or more sibling units next to each other in the model's order (an MLP's blocks,
    a Transformer's `norm` and `output`), and, with tied embeddings, torchtitan's
    `[tok_embeddings, norm, output]` (its tied unit) where the root holds them."""
    from fsdp_verify.models import module_classes

    order = {name: i for i, name in enumerate(module_classes(case.model))}
    plain = sorted((u for u in case.wrap_plan if u and not units.is_group(u)), key=lambda u: order.get(u, -1))
    out: list[tuple[str, ...]] = []
    for i, first in enumerate(plain):
        parent = first.rpartition(".")[0]
        run = [first]
        for later in plain[i + 1 :]:
            between = [
                n for n in order if order[run[-1]] < order[n] < order[later] and not units.is_ancestor(run[-1], n)
            ]
            if later.rpartition(".")[0] != parent or between:
                break
            run.append(later)
            out.append(tuple(run))
    if case.model.kind == "transformer" and case.model.tie_embeddings and "norm" in order:
        root_holds = units.owner_of_module(case.wrap_plan, "tok_embeddings") == ""
        if root_holds:
            out.append(
                ("tok_embeddings", "norm", "output") if "norm" not in case.wrap_plan else ("tok_embeddings", "output")
            )
    return out


@st.composite
def unit_groups(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case` with one unit over several modules in a third of the draws where the plan has
    candidates (`group_candidates`), for an engine that takes `groups`; drawn after everything
    else, so that a seed's earlier draws stay what they were. Not beside ep or prefetch (the
    Case refuses those), nor where the plan was pinned; under pp a group across two stages is
    refused by the Case, and the draw keeps the plan as it was."""
    if "wrap" in pins or case.ep > 1 or case.prefetch is not None:
        return case
    candidates = group_candidates(case)
    if not candidates or draw(st.integers(0, 2)) != 0:
        return case
    chosen = draw(st.sampled_from(candidates))
    last = max(i for i, u in enumerate(case.wrap_plan) if u in chosen) if set(chosen) <= set(case.wrap_plan) else None
    plan = []
    for i, u in enumerate(case.wrap_plan):  # the group where its last member stood: children still first
        if u == "" and last is None or i == last:
            plan.append(units.group(chosen))
        if u not in chosen:
            plan.append(u)
    try:
        return case.with_(wrap=tuple(plan))
    except CaseError:
        return case


@st.composite
def grouped_experts(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case`'s routed experts as grouped experts (verify/models/moe.py: top-k, capacity, the
    load-balancing loss, the router bias) and sharded over an ep dim (docs/expert-parallel.md),
    drawn after everything else and only where asked (`ASKS_GROUPED`: `--ep`, `--top-k`, ...),
    so that a seed's draws stay what they were. Only where routed experts were drawn, so only for an engine that takes them (`experts`); an ep degree
    only for one that takes `ep` (`_knob_pins` pins it to 1 otherwise). Beside ep > 1, what the
    reference does not model there yet is drawn off (a clip, Shard(1) placements, offload)."""
    model = case.model
    if not _asked(pins, ASKS_GROUPED):
        return case
    if not model.experts or model.kind != "mlp" or case.resume_after is not None:
        assume(all(pins.get(name) in (None, 0, 0.0) for name in GROUPED_FIELDS) and pins.get("ep", 1) == 1)
        return case
    top_k = draw(_pinned(pins, "model.top_k", st.one_of(st.none(), st.integers(1, min(2, model.experts)))))
    if top_k is not None and "model.experts" not in pins:
        # four experts too: what ep degrees of 2 and 4 divide (the loop's draw offers 2 and 3)
        model = replace(model, experts=draw(st.sampled_from(sorted({model.experts, 4}))))
    if top_k is None:
        assume(all(pins.get(name) in (None, 0, 0.0) for name in GROUPED_FIELDS[1:]) and pins.get("ep", 1) == 1)
        return case
    # The aux loss's gradient is added unscaled (DeepSeek's AddAuxiliaryLoss): Case refuses it
    # beside a loss divided by the world size or multiplied by a loss scale.
    aux_takes = case.grad_reduction == "avg" and case.loss_scaling is None
    grouped = replace(
        model,
        top_k=top_k,
        capacity_factor=draw(_pinned(pins, "model.capacity_factor", st.sampled_from((None, 0.5, 1.0, 1.5)))),
        aux_loss=draw(_pinned(pins, "model.aux_loss", st.sampled_from((0.0, 0.01, 0.1) if aux_takes else (0.0,)))),
        # a checkpointed forward would count its assignments twice (Case refuses it)
        router_bias=draw(
            _pinned(
                pins, "model.router_bias", st.sampled_from((0.0,) if case.activation_checkpointing else (0.0, 0.01))
            )
        ),
        # the per-expert loop's parameter names mean nothing to the grouped experts
        frozen=tuple(f for f in model.frozen if not f.startswith("moe.experts.")),
    )
    # ep > 1 turns off what is not modelled beside it, unless a pin asked for it
    pinned_on = pinned_beside("ep", case, pins)
    degrees = [] if pinned_on else _ep_degrees(case, grouped)  # half the draws parallel where any fits; shrinks to 1
    ep = draw(_pinned(pins, "ep", st.one_of(st.just(1), st.sampled_from(degrees)) if degrees else st.just(1)))
    changes: dict[str, Any] = {"model": grouped, "ep": ep}
    if not grouped.frozen:
        changes["unfreeze_step"] = None
    if ep > 1:
        changes.update(drawn_off("ep"))
        if case.wrap is not None and "moe.experts" not in case.wrap_plan:
            changes["wrap"] = _order(set(case.wrap_plan[:-1]) | {"moe.experts"})
    try:
        return case.with_(**changes)
    except CaseError:
        assume(False)
        raise


def _ep_degrees(case: Case, model: ModelSpec, shard: int | None = None) -> list[int]:
    """Every degree above 1 that divides the experts and the shard dim (the case's, or `shard`);
    not the whole shard dim under an fp16 reduction (Case refuses it: FSDP2 divides twice over a
    group of one)."""
    shard = shard or case.mesh[-1]
    fp16 = (case.precision.reduce_dtype or case.precision.param_dtype) == "fp16"
    return [d for d in range(2, shard + 1) if shard % d == 0 and model.experts % d == 0 and not (fp16 and d == shard)]


@st.composite
def pipelines(draw: Callable, case: Case, pins: dict[str, Any]) -> Case:
    """`case` cut into pipeline stages (docs/pipeline-parallel.md), drawn after everything else
    and only where asked (`ASKS_PIPELINE`: `--pp`, ...), so that a seed's draws stay what they
    were: a third of the draws where a degree
    divides the world size and the model has a block a stage, for an engine that takes `pp`
    (`_knob_pins` pins it to 1 otherwise). The data-parallel mesh is drawn again for the ranks a
    stage has; what the reference does not model beside a pipeline is drawn off (Case refuses
    it: verify/engines/pipeline_parallel.py), unless a pin asked for it, and the stages reduce
    once a step (sync on the last micro-batch only)."""
    from fsdp_verify.engines.pipeline_parallel import SCHEDULES

    if not _asked(pins, ASKS_PIPELINE):
        return case
    blocks = case.model.n_blocks if not case.model.is_custom or "pp_split" in pins else 0
    ranks = case.world_size // case.tp  # beside tp (drawn before), the stages divide a tp rank's ranks
    degrees = [d for d in range(2, ranks + 1) if ranks % d == 0 and blocks >= d]
    pinned_on = pinned_beside("pp", case, pins)
    # A pinned mesh pins the world size to its product (`cases`): no room for stages beside it.
    # A case drawn expert-parallel stays so (verify/dims/together.py).
    if pinned_on or "mesh_shape" in pins or beside_another("pp", case):
        degrees = []
    pp = draw(
        _pinned(pins, "pp", st.one_of(st.just(1), st.just(1), st.sampled_from(degrees)) if degrees else st.just(1))
    )
    if pp == 1:
        # A pipeline's own pins ask for one, unless the degrees asked for include 1 (`--pp 1 2`
        # beside a framework's pipeline fields): then a draw of 1 has no pipeline, its fields off.
        if not isinstance(pins.get("pp"), SearchStrategy):
            assume(pins.get("pp_schedule") in (None, "1f1b") and pins.get("pp_split") is None)
            assume(pins.get("pp_scale_grads") in (None, True))
        return case
    assume(ranks % pp == 0 and blocks >= pp)  # a pinned degree this draw cannot take
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(case.engine)  # an engine that builds its own schedule: its scaling
    fitting = [name for name in SCHEDULES if _schedule_fits(name, pp, blocks, case.microbatches)]
    assume(fitting)
    schedule = draw(_pinned(pins, "pp_schedule", st.sampled_from(fitting)))
    scales = st.booleans() if capabilities.pp_scale_grads is None else st.just(capabilities.pp_scale_grads)
    scale_grads = draw(_pinned(pins, "pp_scale_grads", scales))
    dp = ranks // pp
    mesh = draw(hsdp_meshes(dp)) if case.mesh_shape is not None else None
    shard = mesh[-1] if mesh else dp
    rsf = case.reshard_after_forward
    # an int the stage's smaller shard group does not divide: True below; a pinned one: not this draw
    assume("reshard_after_forward" not in pins or isinstance(rsf, bool) or shard % rsf == 0)
    model = replace(
        case.model,
        experts=0,
        top_k=None,
        capacity_factor=None,
        aux_loss=0.0,
        router_bias=0.0,
        dropout=0.0,
        frozen=tuple(f for f in case.model.frozen if not f.startswith("moe")),
    )
    from fsdp_verify.models import is_frozen

    if all(is_frozen(model, n) for n in _param_names(model)):  # the routed experts were what trained
        model = replace(model, frozen=())
    changes: dict[str, Any] = {
        "pp": pp,
        "pp_schedule": schedule,
        "pp_scale_grads": scale_grads,
        "pp_split": draw(_pinned(pins, "pp_split", st.just(case.pp_split))),  # a user's (a framework's) split
        "mesh_shape": mesh,
        "model": model,
        "sync_every_microbatch": False,
        # an int the stage's smaller shard group does not divide (not pinned: see above): True
        "reshard_after_forward": rsf if isinstance(rsf, bool) or shard % rsf == 0 else True,
        **drawn_off("pp", case),
    }
    if not model.frozen:
        changes["unfreeze_step"] = None
    if case.wrap is not None:  # units of the routed experts gone with them
        changes["wrap"] = tuple(u for u in case.wrap_plan if not u.startswith("moe")) or ("",)
    try:
        return case.with_(**changes)
    except CaseError:
        assume(False)
        raise


def _schedule_fits(schedule: str, pp: int, blocks: int, microbatches: int) -> bool:
    """Whether `schedule` over `pp` stages a rank's worth fits the model's blocks and the
    micro-batches (the Case refuses it otherwise: verify/engines/pipeline_parallel.py)."""
    from fsdp_verify.engines.pipeline_parallel import stages_per_rank

    m = microbatches
    return (
        blocks >= pp * stages_per_rank(schedule)
        and (schedule == "gpipe" or m >= pp)
        and (schedule != "interleaved1f1b" or m % max(1, m // pp) == 0)
    )


# ---- tensor parallelism (docs/tensor-parallel.md) -----------------------------------------------
def _parallel_pins(parallelism: str) -> dict[str, Any]:
    """What the strategies draw that is not modelled beside `parallelism` (verify/dims/together.py,
    the one table), each field pinned to its value when off."""
    return drawn_off(parallelism)


def _tp_draws(
    engine: str, world_sizes: tuple[int, ...], precisions: tuple[str, ...], pins: dict[str, Any]
) -> tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]:
    """The tp degrees to draw among (the `tp` pin: one, or a list; (1,) when not asked), the world
    sizes some of them divide, and the pins with what tensor parallelism is not drawn beside
    pinned off. An engine that does not declare `tp` asked for it is refused, naming the field."""
    from fsdp_verify.engines import engine_capabilities
    from fsdp_verify.engines.capabilities import not_declared

    value = pins.pop("tp", 1)
    if isinstance(value, SearchStrategy):
        elements = getattr(value, "elements", None)  # st.sampled_from: what a list of degrees pins
        if elements is None:
            raise PinError("tp: expected a degree or a list of degrees to draw among, got a strategy")
        tps = tuple(elements)
    else:
        tps = (value,)
    if tps == (1,):
        return tps, world_sizes, pins
    if "tp" not in engine_capabilities(engine).taken():
        raise PinError(f"tp: expected 1: {not_declared(engine, 'tp')}, got {max(tps)}")
    kept = tuple(w for w in world_sizes if any(w % t == 0 for t in tps))
    if not kept:
        raise PinError(f"tp: degrees {tps} divide no world size in world_sizes {tuple(world_sizes)} (world = dp x tp)")
    if "fp16" in precisions:
        raise PinError("precisions: fp16 cases are drawn with loss scaling, which is not modelled beside tp")
    off = _parallel_pins("tp")
    for name, value in off.items():
        given = pins.get(name, value)
        if not isinstance(given, SearchStrategy) and given != value:
            raise PinError(
                f"{name}: expected {value!r} with tp (not modelled beside tensor parallelism), got {given!r}"
            )
    return tps, kept, {**pins, **off}


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def tp_divisible(model: ModelSpec, tp: int, pins: dict[str, Any]) -> ModelSpec:
    """`model` with every dimension its plan splits rounded up to a multiple of `tp` (the fields
    pinned stay as pinned: the case then refuses a pin that does not divide): the Transformer's
    heads (the dimension follows them), vocabulary, feed-forward width and sequence; the MLP's widths
    between a colwise layer and the next; a user's model's sequence (a plan of theirs may split it)."""
    if model.is_custom:
        return model if "seq_len" in pins else replace(model, seq_len=_round_up(model.seq_len, tp))
    if model.kind == "mlp":
        if "widths" in pins:
            return model
        widths = list(model.widths)
        for i in range(0, len(widths) - 1, 2):  # layer i is colwise: its output splits
            widths[i + 1] = _round_up(widths[i + 1], tp)
        return replace(model, widths=tuple(widths))
    changes: dict[str, Any] = {}
    if "n_heads" not in pins and "dim" not in pins:
        heads = _round_up(model.n_heads, tp)
        changes.update(n_heads=heads, dim=heads * (model.dim // model.n_heads))
    for name in ("vocab_size", "ffn_hidden", "seq_len"):  # the sequence: for sequence parallelism
        if name not in pins:
            changes[name] = _round_up(getattr(model, name), tp)
    return replace(model, **changes)


@st.composite
def tp_styles(
    draw: Callable, model: ModelSpec, precision: PrecisionSpec, pins: dict[str, Any], tp: int
) -> dict[str, Any]:
    """Sequence parallelism (the built-in Transformer's plan) and loss parallelism (a token
    model's cross-entropy), each on or off. Not sequence parallelism where FSDP2 sums its norms'
    partial gradients over tp in param_dtype while reduce_dtype is wider (pytorch/pytorch#190626,
    torch 2.13: tests/upstream/test_fsdp2_tp_reduce_dtype.py, a strict xfail; `check` catches it).
    A pinned sequence parallelism draws that wider reduce_dtype only where it is pinned too (the
    zoo's `tp_grad_all_reduce_in_bf16`): a sweep asking for `--sequence-parallel true` with bf16
    drew the bug (seed 20271202, e9c6f2b3196f) and cried it as a false alarm. A user's plan with
    SequenceParallel modules of its own (torchtitan's) is not drawn with that reduce_dtype either."""
    transformer = model.kind == "transformer" and pins.get("tp_plan") is None
    low = precision.param_dtype not in (None, "fp32") and precision.reduce_dtype not in (None, precision.param_dtype)
    sp = draw(_pinned(pins, "sequence_parallel", st.booleans() if transformer and not low else st.just(False)))
    assume(not (sp and low) or "precision.reduce_dtype" in pins)
    lp = draw(
        _pinned(
            pins, "loss_parallel", st.booleans() if model.kind != "mlp" and pins.get("loss") is None else st.just(False)
        )
    )
    # a user's plan (a model of their own has no built-in one): as pinned
    plan = draw(_pinned(pins, "tp_plan", st.just(None)))
    if plan is not None and low:
        from fsdp_verify.engines.tensor_parallel import sequence_parallel_modules

        assume(not sequence_parallel_modules(model, tp, plan, False, lp))
    return {"sequence_parallel": sp, "loss_parallel": lp, "tp_plan": plan}


def _routing_never_decides_what_requires_grad(case: Case) -> Case:
    """`case` with the routed experts' gate trainable where the routing would decide whether the
    layer after the experts gets an input that requires grad (`routing_decides_requires_grad`:
    torch 2.13's FSDP2 then orders its reduce-scatters by the routing,
    tests/upstream/test_fsdp2_unused_params_reduce_order.py, a strict xfail; `check` catches it as
    a rank crash and names it): not drawn (sweep seed 5011 drew it, 1 of 100). A trainable gate
    scales every reached expert's output, so that input always requires grad."""
    from fsdp_verify.engines.routed_reduction import routing_decides_requires_grad
    from fsdp_verify.models import is_frozen, parameter_names

    model = case.model
    if not routing_decides_requires_grad(model):
        return case
    names = parameter_names(model)  # by name: a prefix may cover the gate
    frozen = tuple(n for n in names if is_frozen(model, n) and not n.startswith("moe.gate."))
    return case.with_(model=replace(model, frozen=frozen))


def _sequence_parallel_norms_trainable(case: Case) -> Case:
    """`case` with its norms trainable under sequence parallelism: torch 2.13's SequenceParallel
    makes a frozen parameter trainable (tests/upstream/test_sequence_parallel_unfreezes_params.py,
    a strict xfail; `check` catches it), so a frozen norm there is not drawn."""
    from fsdp_verify.models import is_frozen, parameter_names

    if not case.sequence_parallel or not case.model.frozen:
        return case
    names = parameter_names(case.model)
    frozen = tuple(n for n in names if is_frozen(case.model, n) and not n.endswith("norm.weight"))
    if len(frozen) == sum(is_frozen(case.model, n) for n in names):
        return case
    unfreeze = case.unfreeze_step if frozen else None
    return case.with_(model=replace(case.model, frozen=frozen), unfreeze_step=unfreeze)


def _tp_clip(values: dict[str, Any]) -> float | None:
    """The drawn clip, unless the Case refuses it beside the drawn tp (then none)."""
    if values["clip_norm"] is None:
        return None
    try:
        Case(**values)
    except CaseError as e:
        if e.field_path == "clip_norm":
            return None
    return values["clip_norm"]


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


def _takes_2d_meshes(engine: str, pins: dict[str, Any]) -> bool:
    """Whether the engine declares it takes 2-D meshes; a pinned mesh it cannot take is refused
    now, naming the field (verify/engines/capabilities.py)."""
    from fsdp_verify.engines import engine_capabilities

    capabilities = engine_capabilities(engine)
    mesh = pins.get("mesh_shape")
    if mesh is not None and not isinstance(mesh, SearchStrategy) and len(mesh) not in capabilities.mesh_dims:
        raise PinError(f"mesh_shape: expected {capabilities.accepts()} (what engine {engine!r} takes), got {mesh!r}")
    return 2 in capabilities.mesh_dims


def _custom_pins(spec: ModelSpec, pins: dict[str, Any]) -> dict[str, Any]:
    """A user's model: the model strategy is `_custom`; its batches are token sequences (padded
    or not); eager init unless it has an init_fn; no output_dtype and inputs cast to param_dtype
    (FSDP2's defaults): a user model need not run every dtype mix the built-ins were fitted to
    (`_runs_in`), and a case it cannot run would be the model's limit, not the engine's."""
    Case(model=spec)  # validates it now (a factory that does not import fails here, naming the field)
    own = {
        "model": _custom(spec, _sub(pins, "model")),
        "precision.output_dtype": None,
        "precision.cast_forward_inputs": True,
        "data.kind": "normal",
        "data.scale": 1.0,
    }
    if spec.init_fn is None:
        own["init"] = "eager"
    # A pinned `model.frozen` stays too: `_cases` draws no more frozen parameters beside it.
    return {**own, **{k: v for k, v in pins.items() if not k.startswith("model.") or k == "model.frozen"}}


def _units_frozen_whole(case: Case) -> set[str]:
    """The units of the plan ("" the root) that own parameters, every one of them frozen."""
    from fsdp_verify.models import is_frozen, parameter_names
    from fsdp_verify.units import owner_of_module

    own: dict[str, list[str]] = {}
    for n in parameter_names(case.model):
        own.setdefault(owner_of_module(case.wrap_plan, n.rpartition(".")[0]) or "", []).append(n)
    return {u for u, names in own.items() if all(is_frozen(case.model, n) for n in names)}


def _root_unit_frozen_whole(case: Case) -> bool:
    """Whether the root unit owns parameters and every one of them is frozen."""
    return "" in _units_frozen_whole(case)


def fsdp1_modelled(case: Case) -> bool:
    """False for the FSDP1 behaviour the reference does not model and the cases FSDP1 cannot run
    (strict xfails in tests/test_engine_fsdp1.py, docs/engines.md "FSDP1"): a no-sync case whose bf16
    compute differs from an fp32 reduce_dtype (FSDP1 accumulates in param_dtype); and under
    NO_SHARD (a shard group of one: world size 1 or a (W, 1) mesh) a frozen tied weight with
    nested units and a second forward, of the next micro-batch or the next step (FSDP1's own
    assertion `as_params=True type(prim_param)=Tensor` there), or a no-sync micro-batch in a
    low-precision param_dtype (FSDP1 assigns the bf16 accumulated gradient's views to the fp32
    parameters in the next forward and torch 2.13 refuses, grad_dtype: seen with tied embeddings,
    every such case left out); and under NO_SHARD, a parameter unfrozen mid-run where FSDP1 loses
    its gradient, two PyTorch bugs: with no-sync micro-batches it drops the accumulated gradient
    (tests/upstream/test_fsdp1_no_shard_no_sync_unfrozen_param.py), and a root unit whose own
    parameters were all frozen through a forward never trains again (its original parameters stay
    unregistered, the gradient lands on a plain view the optimizer does not hold: regression
    4e6cbe2adeff, tests/upstream/test_fsdp1_no_shard_unfrozen_root_unit.py). Other NO_SHARD
    unfreezes are drawn. And under NO_SHARD, a checkpoint of a model whose root unit's own
    parameters are all frozen: the same unregistered parameters make `state_dict()` assert
    (tests/upstream/test_fsdp1_no_shard_frozen_root_state_dict.py, regression 6623a1f52a02), and
    so does a checkpoint with a non-root unit frozen whole (regression 27731e33e8e1: `moe`, its
    gate a unit of its own; fuzz seed 20270213), so every NO_SHARD resume with a unit frozen whole
    is left out."""
    p = case.precision
    if case.mesh[-1] == 1 and case.unfreeze_step is not None:
        no_sync = case.microbatches > 1 and not case.sync_every_microbatch
        if no_sync or _root_unit_frozen_whole(case):
            return False
    if case.mesh[-1] == 1 and case.resume_after is not None and _units_frozen_whole(case):
        return False
    low_params = p.param_dtype not in (None, "fp32")
    if case.mesh[-1] == 1 and low_params and case.microbatches > 1 and not case.sync_every_microbatch:
        return False
    m = case.model
    frozen_tie = (
        m.kind == "transformer"
        and m.tie_embeddings
        and any(n.startswith(f) for f in m.frozen for n in ("tok_embeddings.weight", "output.weight"))
    )
    second_forward = case.microbatches > 1 or case.steps > 1
    if case.mesh[-1] == 1 and second_forward and frozen_tie and len(case.wrap_plan) > 1:
        return False
    return case.sync_every_microbatch or p.param_dtype in (None, "fp32") or p.reduce_dtype in (None, p.param_dtype)
