"""Tensor parallelism's draw step: the tp degree (its pins), a model whose widths tp divides, the
plan's styles, and what sequence parallelism asks of the rest (beside reference/tensor_parallel.py,
its emulation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

from hypothesis import assume
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case, CaseError, ModelSpec
from fsdp_verify.case_specs import PrecisionSpec
from fsdp_verify.dims.together import drawn_off
from fsdp_verify.properties.pins import PinError, pinned


def _parallel_pins(parallelism: str) -> dict[str, Any]:
    """What the strategies draw that is not modelled beside `parallelism` (verify/dims/together.py,
    the one table), each field pinned to its value when off."""
    return drawn_off(parallelism)


def tp_draws(
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
    sp = draw(pinned(pins, "sequence_parallel", st.booleans() if transformer and not low else st.just(False)))
    assume(not (sp and low) or "precision.reduce_dtype" in pins)
    lp = draw(
        pinned(
            pins, "loss_parallel", st.booleans() if model.kind != "mlp" and pins.get("loss") is None else st.just(False)
        )
    )
    # a user's plan (a model of their own has no built-in one): as pinned
    plan = draw(pinned(pins, "tp_plan", st.just(None)))
    if plan is not None and low:
        from fsdp_verify.engines.tensor_parallel import sequence_parallel_modules

        assume(not sequence_parallel_modules(model, tp, plan, False, lp))
    return {"sequence_parallel": sp, "loss_parallel": lp, "tp_plan": plan}


def sequence_parallel_norms_trainable(case: Case) -> Case:
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


def tp_clip(values: dict[str, Any]) -> float | None:
    """The drawn clip, unless the Case refuses it beside the drawn tp (then none)."""
    if values["clip_norm"] is None:
        return None
    try:
        Case(**values)
    except CaseError as e:
        if e.field_path == "clip_norm":
            return None
    return values["clip_norm"]
