"""Pins: the fields a draw is asked to fix (a value) or to draw from a strategy of the caller's,
checked before any draw; `PinError` names a pin no draw can honour. Shared by every draw module of
this package."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy

from fsdp_verify.case import Case, ModelSpec, check_field_value
from fsdp_verify.case_specs import DataSpec, LossScaleSpec, OptimSpec, PrecisionSpec
from fsdp_verify.dims import registry


class PinError(ValueError):
    """A pin names no field of a Case."""


def valid_pin_names() -> set[str]:
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


def check_pin_names(pins: dict[str, Any]) -> None:
    unknown = sorted(set(pins) - valid_pin_names())
    if unknown:
        raise PinError(f"pins: {unknown[0]!r} is no field of a Case (e.g. 'steps', 'optim.name', 'model.dropout')")


def check_loss_scaling_pins(precisions: tuple[str, ...], pins: dict[str, Any]) -> None:
    """`loss_scaling.*` pins: fixed values validated now (CaseError naming the field, not a
    Hypothesis health check after every draw failed), and only where fp16 cases are drawn."""
    fixed = {k: v for k, v in pins_under(pins, "loss_scaling").items() if not isinstance(v, SearchStrategy)}
    if (pins.get("loss_scaling") is not None or pins_under(pins, "loss_scaling")) and "fp16" not in precisions:
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


def pinned(pins: dict[str, Any], name: str, default: SearchStrategy) -> SearchStrategy:
    """The strategy for field `name`: the pin (a strategy, or a value to fix) or the default."""
    if name not in pins:
        return default
    value = pins[name]
    return value if isinstance(value, SearchStrategy) else st.just(value)


def pins_under(pins: dict[str, Any], head: str) -> dict[str, Any]:
    """The pins under `head.` with the prefix removed."""
    return {k.split(".", 1)[1]: v for k, v in pins.items() if k.startswith(head + ".")}


def one_or_more(degrees: list[int]) -> SearchStrategy[int]:
    """A resumed degree: 1 half the time, one of `degrees` (above 1) the other half, where any
    fits (the resumed world sizes 1 and 3 take none above 1: without this, 1 drew most resumes)."""
    if not degrees:
        return st.just(1)
    # a coin, not `one_of`: one_of's branch drew 1 in all but 6 of a 60-case seed's resumes
    return st.booleans().flatmap(lambda above: st.sampled_from(degrees) if above else st.just(1))


def asked(pins: dict[str, Any], asks: dict[str, Any]) -> bool:
    """Whether a pin asks for a composition (`ASKS_GROUPED`, `ASKS_PIPELINE`)."""
    return any(
        name in pins and (isinstance(pins[name], SearchStrategy) or pins[name] != off) for name, off in asks.items()
    )
