"""Every Case field as a command-line flag, in one table (`FLAGS`): `check` (and every command that
builds one case) takes each as an override of `--case FILE`, `fuzz`/`sweep` take most as draw
options (one value pins the field, several are drawn among), the case strategies and the pytest
plugin take them as keywords (`fsdp_cases(optimizer=["adam", "sgd"], sync_last=True)`), and
`case_to_flags(case)` prints a case as the flags that rebuild it, hash for hash. A Case field
without a flag here fails tests/test_case_flags.py. Free of torch: pytest parses its options
with it."""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fsdp_verify.case import Case

from fsdp_verify.commands.dimension_flags import DIMENSION_FLAGS
from fsdp_verify.commands.flag import (
    _MISSING,
    Flag,
    _same,
    text,
)
from fsdp_verify.commands.run_flags import RUN_FLAGS

FLAGS: tuple[Flag, ...] = RUN_FLAGS + DIMENSION_FLAGS


def _packages_flags() -> tuple[Flag, ...]:
    """The registered dimension packages' rows (verify/dims/registry.py), after the table's own."""
    from fsdp_verify.dims.registry import packages

    return tuple(f for package in packages() for f in package.flags)


FLAGS = FLAGS + _packages_flags()
BY_FLAG = {f.flag: f for f in FLAGS}
BY_DEST = {f.dest: f for f in FLAGS}
GROUPS = tuple(dict.fromkeys(f.group for f in FLAGS))


def flag_of(field: str) -> str | None:
    """The flag that sets Case field `field` (dotted for nested specs), or None."""
    for f in FLAGS:
        if field == f.field or field in f.covers:
            return f.flag
    return None


def _engine_type(text: str) -> str:
    from fsdp_verify.engines import canonical_engine  # on use: the engines import torch

    return canonical_engine(text)


def _argparse_type(f: Flag) -> Callable[[str], Any]:
    return _engine_type if f.flag == "--engine" else f.parse


# ---- check: one value per flag ------------------------------------------------------------------
def add_flags(p: argparse.ArgumentParser, groups: dict[str, Any] | None = None) -> None:
    """Every flag of the table, by argument group, each defaulting to None (not given)."""
    groups = groups if groups is not None else {}
    for f in FLAGS:
        group = groups.get(f.group) or groups.setdefault(f.group, p.add_argument_group(f.group))
        kwargs: dict[str, Any] = {"dest": f.dest, "metavar": f.metavar, "help": f.help, "default": None}
        if f.flag == "--wrap":
            kwargs["nargs"] = "+"
        else:
            kwargs["type"] = _argparse_type(f)
        if f.const is not _MISSING:
            kwargs.update(nargs="?", const=f.const)
        group.add_argument(f.flag, **kwargs)


def given(args: argparse.Namespace) -> dict[str, Any]:
    """The table's flags the command line gave: field path -> the field's value."""
    return {f.field: f.value(getattr(args, f.dest)) for f in FLAGS if getattr(args, f.dest, None) is not None}


def name_flag(error: Exception, fields_given: dict[str, Any]) -> Exception:
    """A CaseError about a field a flag set, with the flag named after it: `optim.lr: expected a
    positive learning rate, got -1 (from --lr)`."""
    path = getattr(error, "field_path", None)
    flag = flag_of(path) if path in fields_given else None
    if flag is not None:
        error.args = (f"{error} (from {flag})",)
    return error


# ---- a case as flags ----------------------------------------------------------------------------


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def case_to_flags(case: Case) -> list[str]:
    """The flags that rebuild `case` from the built-in default (`check` with no `--case`): every
    field that differs from it, and only those. `case_from_args(parse(flags)) == case`, hash for
    hash (tests/test_case_flags.py draws the cases)."""
    from fsdp_verify.case import Case
    from fsdp_verify.case_specs import LossScaleSpec
    from fsdp_verify.models import ModelSpec

    default = Case()
    m = case.model
    out: list[str] = []
    if m.is_custom:
        base = ModelSpec(kind="custom", factory=m.factory)
        out += ["--model", m.factory]
    elif m.kind != default.model.kind:
        base = ModelSpec(kind=m.kind)
        out += ["--model", m.kind]
    else:
        base = default.model
    for f in FLAGS:
        if f.field.startswith("model.") and f.flag != "--model":
            name = f.field.split(".", 1)[1]
            if not _same(getattr(m, name), getattr(base, name)):
                out += f.tokens(getattr(m, name))
    if case.mesh_shape is not None:
        out += ["--mesh-shape", text(case.mesh_shape)]
    elif case.world_size != default.world_size:
        out += ["--world-size", text(case.world_size)]
    if case.wrap is not None:
        entries = [e for e in case.wrap if e != ""]
        out += ["--wrap", *(entries or ["root"])]
    for f in FLAGS:
        if f.field.startswith(("model.", "loss_scaling")) or f.field in ("world_size", "mesh_shape", "wrap"):
            continue
        value = _get(case, f.field)
        if not _same(value, _get(default, f.field)):
            out += f.tokens(value)
    if case.loss_scaling is not None:
        out.append("--loss-scaling")
        for f in FLAGS:
            if f.field.startswith("loss_scaling."):
                name = f.field.split(".", 1)[1]
                if not _same(getattr(case.loss_scaling, name), getattr(LossScaleSpec(), name)):
                    out += f.tokens(getattr(case.loss_scaling, name))
    return out


# ---- fuzz and sweep: values to pin or draw among ------------------------------------------------
def add_draw_flags(p: argparse.ArgumentParser) -> None:
    """The table's "pin" flags, each taking one value (pinned) or several (drawn among)."""
    groups: dict[str, Any] = {}
    for f in FLAGS:
        if f.draw != "pin":
            continue
        group = groups.get(f.group) or groups.setdefault(f.group, p.add_argument_group(f"draw: {f.group}"))
        switch = f.const is not _MISSING
        group.add_argument(
            f.flag,
            dest=f.dest,
            type=f.parse,
            nargs="*" if switch else "+",
            default=None,
            metavar=f.metavar,
            help=re.sub(r" \(default[^)]*\)", "", f.help)  # a draw's default is drawn
            + "; several values: drawn among them"
            + ("; alone: pinned on" if switch else ""),
        )


def _distinct(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        if not any(_same(v, w) for w in out):
            out.append(v)
    return out


def _pin(field: str, values: list[Any]) -> Any:
    """One value (pinned) or a strategy drawing among several, each checked as a pin first."""
    from hypothesis import strategies as st

    from fsdp_verify.case import check_field_value

    values = _distinct(values)
    for value in values:
        check_field_value(field, value)
    return values[0] if len(values) == 1 else st.sampled_from(values)


def draw_pins(args: argparse.Namespace) -> dict[str, Any]:
    """The draw flags given: field path -> a value (one given) or a strategy (several)."""
    pins: dict[str, Any] = {}
    for f in FLAGS:
        if f.draw != "pin":
            continue
        values = getattr(args, f.dest, None)
        if values is not None:
            pins[f.field] = _pin(f.field, [f.value(v) for v in values or [f.const]])
    return pins


def draw_flag_texts(args: argparse.Namespace) -> list[str]:
    """The draw flags given, as typed (`--optimizer adam sgd`): for a report's record of its draw."""
    out = []
    for f in FLAGS:
        values = getattr(args, f.dest, None) if f.draw == "pin" else None
        if values is not None:
            out.append(" ".join([f.flag, *(text(v) for v in values)]))
    return out


_TUPLE_VALUED = {"model.widths", "model.frozen", "ignored", "model.shrinkable", "optim.betas", "mesh_shape", "wrap"}
_NAME_TUPLES = {"model.frozen", "ignored", "model.shrinkable", "wrap"}


def keyword_pins(keywords: dict[str, Any], field_names: set[str]) -> dict[str, Any]:
    """The strategies' keywords with flag names (`optimizer`, `sync_last`, `lr`) turned into pins
    of their fields. A string is read as the flag reads it (`mesh_shape="2,2"`, `"bfloat16"`); a
    list draws among its items (for a tuple-valued field a list of plain items is one value); a
    strategy is drawn from; anything else pins. A Case field name that no flag spells alike
    (`data`, `optim.name`) keeps its meaning; other keys are left for the caller to name."""
    from hypothesis.strategies import SearchStrategy

    out: dict[str, Any] = {}
    for key, value in keywords.items():
        f = BY_DEST.get(key)
        if f is None or f.draw != "pin" or (key in field_names and f.field != key):
            out[key] = value
            continue

        def read(v: Any, f: Flag = f) -> Any:
            if isinstance(v, str):
                return f.value(f.parse(v))
            return f.value(tuple(v) if isinstance(v, list) else v)

        if isinstance(value, SearchStrategy):
            out[f.field] = value
        elif isinstance(value, list) and not _one_tuple(f.field, value):
            if not value:
                raise TypeError(f"{key}: expected a value or a non-empty list of values to draw among, got []")
            out[f.field] = _pin(f.field, [read(v) for v in value])
        else:
            out[f.field] = tuple(value) if isinstance(value, list) else read(value)
    return out


def _one_tuple(field: str, value: list) -> bool:
    """Is list `value` one value of a tuple-valued field (`frozen=["a", "b"]`, `betas=[0.9, 0.99]`)
    rather than values to draw among (`mesh_shape=[(2, 2), "1,4"]`)?"""
    if field not in _TUPLE_VALUED:
        return False
    if field in _NAME_TUPLES:
        return all(isinstance(v, str) for v in value)
    return all(not isinstance(v, (list, tuple, str)) and v is not None for v in value)
