"""The models a case trains (the built-in MLP and Transformer, a user's factory), their frozen
parameters and their wrap plans: the first things a case draws, which every later draw reads."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from functools import lru_cache
from typing import Any

import torch
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import nn

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.case_specs import PrecisionSpec
from fsdp_verify.models import _construct
from fsdp_verify.properties.pins import pinned, pins_under

MAX_WIDTH = 40


def _widths() -> SearchStrategy[int]:
    """1..MAX_WIDTH: primes, uneven splits over 2-4 ranks and one-element rows all occur. A plain
    integer range (no one_of with a list of favourites) keeps shrinking short."""
    return st.integers(1, MAX_WIDTH)


# ---- models -------------------------------------------------------------------------------------
@lru_cache(maxsize=1024)
def param_names(spec: ModelSpec) -> tuple[str, ...]:
    with torch.device("meta"):
        return tuple(name for name, _ in _construct(spec).named_parameters())


@st.composite
def _frozen(draw: Callable, spec: ModelSpec) -> tuple[str, ...]:
    """Up to two frozen parameters, never all of them (the optimizer needs something to train)."""
    names = param_names(spec)
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
    for name in param_names(spec):
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


def with_frozen_in_units(spec: ModelSpec, more: tuple[str, ...]) -> ModelSpec:
    """`spec` with `more` frozen too, unless that would freeze every parameter outside the routed
    experts (the optimizer needs something to train, and an expert may see no sample): then as
    it was."""
    from fsdp_verify.models import is_frozen

    frozen = spec.frozen + tuple(n for n in more if not is_frozen(spec, n))
    merged = replace(spec, frozen=frozen)
    # A routed expert may be reached by no sample: something outside the experts must train too.
    outside = [n for n in param_names(spec) if not n.startswith("moe.experts.")]
    if frozen == spec.frozen or all(is_frozen(merged, n) for n in outside):
        return spec
    return merged


@st.composite
def _mlp(draw: Callable, pins: dict[str, Any]) -> ModelSpec:
    widths = draw(pinned(pins, "widths", st.lists(_widths(), min_size=2, max_size=4).map(tuple)))
    dropout = draw(pinned(pins, "dropout", st.sampled_from((0.0, 0.1, 0.5))))
    # Routed experts: with 1-2 samples a rank and micro-batch, some expert is often reached by none.
    experts = draw(pinned(pins, "experts", st.sampled_from((0, 2, 3))))
    spec = ModelSpec(kind="mlp", widths=widths, dropout=dropout, experts=experts)
    frozen = draw(pinned(pins, "frozen", _frozen(spec)))
    return ModelSpec(kind="mlp", widths=widths, dropout=dropout, frozen=frozen, experts=experts)


@st.composite
def _transformer(draw: Callable, pins: dict[str, Any]) -> ModelSpec:
    n_heads = draw(pinned(pins, "n_heads", st.sampled_from((1, 2, 4))))
    head_dim = draw(st.sampled_from((2, 4, 6, 8)))  # RoPE rotates pairs: even
    values = {
        "vocab_size": draw(pinned(pins, "vocab_size", st.integers(2, 40))),
        "dim": draw(pinned(pins, "dim", st.just(n_heads * head_dim))),
        "n_layers": draw(pinned(pins, "n_layers", st.integers(1, 3))),
        "n_heads": n_heads,
        "ffn_hidden": draw(pinned(pins, "ffn_hidden", _widths())),
        "seq_len": draw(pinned(pins, "seq_len", st.integers(1, 8))),
        "tie_embeddings": draw(pinned(pins, "tie_embeddings", st.booleans())),
        "dropout": draw(pinned(pins, "dropout", st.sampled_from((0.0, 0.1)))),
    }
    spec = ModelSpec(kind="transformer", **values)
    frozen = draw(pinned(pins, "frozen", _frozen(spec)))
    return ModelSpec(kind="transformer", frozen=frozen, **values)


def models(kinds: Iterable[str] = ("mlp", "transformer"), **pins: Any) -> SearchStrategy[ModelSpec]:
    """ModelSpecs of the given kinds; `pins` by ModelSpec field name (`widths`, `dropout`, ...)."""
    kinds = tuple(kinds)
    kind_strategy = pinned(pins, "kind", st.sampled_from(kinds))
    rest = {k: v for k, v in pins.items() if k != "kind"}
    return kind_strategy.flatmap(lambda kind: _mlp(rest) if kind == "mlp" else _transformer(rest))


@st.composite
def _custom(draw: Callable, base: ModelSpec, pins: dict[str, Any]) -> ModelSpec:
    """A user's model as given (factory and kwargs fixed); drawn: the sequence length of its
    token batches and up to two frozen parameters."""
    seq_len = draw(pinned(pins, "seq_len", st.integers(1, 8)))
    spec = replace(base, seq_len=seq_len)
    return replace(spec, frozen=draw(pinned(pins, "frozen", _frozen(spec))))


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
            continue  # a routed expert's forward runs on some ranks only: never a unit (verify/case_rules.py `_wrap`)
        if name and not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            if spec.tie_embeddings and name in ("tok_embeddings", "output"):
                continue  # tied: both must stay with the root in one unit
            out.append(name)
    return tuple(out)


def ordered_units(units: Iterable[str]) -> tuple[str, ...]:
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


def experts_cannot_accumulate(model: ModelSpec, precision) -> bool:
    """Whether FSDP2 cannot accumulate `model`'s routed experts' gradients without reducing each
    micro-batch (a PyTorch bug: an expert first reached in the last micro-batch brings a param_dtype
    gradient among the reduce_dtype accumulated ones;
    tests/upstream/test_fsdp2_no_sync_param_used_only_in_last_microbatch.py): drawn reducing every
    micro-batch (`sync_values`), never pipelined (a stage accumulates: `pipelines`)."""
    low = precision.param_dtype not in (None, "fp32")
    return bool(model.experts) and low and precision.reduce_dtype not in (None, precision.param_dtype)


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
    return st.lists(st.sampled_from(candidates), unique=True, max_size=max_units).map(ordered_units)


def ignored_draws(model: ModelSpec) -> SearchStrategy[tuple[str, ...]]:
    """None ignored (shrinks there), one parameter, or one module's parameters (a whole unit,
    or part of one) for `ignored`; never all of them (Case refuses that)."""
    from fsdp_verify.models import is_ignored, parameter_names

    names = parameter_names(model)
    modules = sorted({n.rsplit(".", 1)[0] for n in names if "." in n})
    choices = [(p,) for p in [*names, *modules] if not all(is_ignored((p,), n) for n in names)]
    return st.one_of(st.just(()), st.sampled_from(choices)) if choices else st.just(())


_MODEL_EXPECTED = (
    "'mlp', 'transformer', a model factory 'pkg.module:NAME' or 'path/to/file.py:NAME' (as `check --model`"
    " takes it), a ModelSpec or a strategy of ModelSpecs"
)
_FACTORY_KEYWORDS = ("model_kwargs", "init_fn", "output_fn", "shrinkable")


def model_keywords(
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
            from fsdp_verify.commands.flag import names

            raw = changes["shrinkable"]
            changes["shrinkable"] = names(raw) if isinstance(raw, str) else tuple(raw)
        custom_model = replace(custom_model, **changes)
    return model_kinds, custom_model, pins


def custom_pins(spec: ModelSpec, pins: dict[str, Any]) -> dict[str, Any]:
    """A user's model: the model strategy is `_custom`; its batches are token sequences (padded
    or not); eager init unless it has an init_fn; no output_dtype and inputs cast to param_dtype
    (FSDP2's defaults): a user model need not run every dtype mix the built-ins were fitted to
    (`_runs_in`), and a case it cannot run would be the model's limit, not the engine's."""
    Case(model=spec)  # validates it now (a factory that does not import fails here, naming the field)
    own = {
        "model": _custom(spec, pins_under(pins, "model")),
        "precision.output_dtype": None,
        "precision.cast_forward_inputs": True,
        "data.kind": "normal",
        "data.scale": 1.0,
    }
    if spec.init_fn is None:
        own["init"] = "eager"
    # A pinned `model.frozen` stays too: `_cases` draws no more frozen parameters beside it.
    return {**own, **{k: v for k, v in pins.items() if not k.startswith("model.") or k == "model.frozen"}}
