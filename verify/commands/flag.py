"""One row of the flag table (`Flag`: a Case field's flag, its parser and how the draws offer
it) and the parsers that read a flag's text into a field's value. The table itself is
verify/commands/case_flags.py; a dimension package (verify/dims/) brings its own rows. Free of
torch."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fsdp_verify import dtypes

_NONE = ("none", "null", "off")
_MISSING = object()


# ---- value parsers: text -> the field's value (argparse `type=`) --------------------------------
def _fail(expected: str, text: str) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")


def boolean(text: str) -> bool:
    key = text.strip().lower()
    if key in ("true", "yes", "on", "1"):
        return True
    if key in ("false", "no", "off", "0"):
        return False
    raise _fail("true or false", text)


def number(text: str) -> int | float:
    """An int where the text is one (as a Case file's JSON keeps it, so its hash), else a float."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        return float(text)
    except ValueError:
        raise _fail("a number", text) from None


def integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise _fail("an integer", text) from None


def _items(text: str) -> list[str]:
    return [s for s in text.replace(",", " ").split() if s]


def _tuple_of(parse: Callable[[str], Any], what: str) -> Callable[[str], tuple]:
    def parse_tuple(text: str) -> tuple:
        try:
            return tuple(parse(item) for item in _items(text))
        except argparse.ArgumentTypeError:
            raise _fail(what, text) from None

    parse_tuple.__name__ = what
    return parse_tuple


integers = _tuple_of(integer, "integers separated by commas (e.g. 16,33,8)")
numbers = _tuple_of(number, "numbers separated by commas (e.g. 0.9,0.999)")


def names(text: str) -> tuple[str, ...]:
    """`a,b` or `a b` -> ("a", "b"); `none` -> ()."""
    return () if text.strip().lower() in _NONE else tuple(_items(text))


def or_none(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse`, and `none`/`null`/`off` for None (a case file's value set back to the default)."""

    def parse_or_none(text: str) -> Any:
        return None if text.strip().lower() in _NONE else parse(text)

    parse_or_none.__name__ = getattr(parse, "__name__", "value")
    return parse_or_none


def dtype(text: str) -> str:
    try:
        return dtypes.canonical(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def reshard(text: str) -> bool | int:
    """`true`, `false` or a positive int K (FSDP2 reshards to groups of K after forward)."""
    key = text.strip().lower()
    if key in ("true", "false"):
        return key == "true"
    try:
        return int(key)
    except ValueError:
        raise _fail("true, false or a positive int", text) from None


def mesh(text: str) -> tuple[int, ...] | None:
    return or_none(_tuple_of(integer, "SHARD or REPLICATE,SHARD (e.g. 2,2)"))(text)


def text(value: Any) -> str:
    """The flag spelling of a field value; `parse(text(v)) == v`, JSON type included."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, (tuple, list)):
        return ",".join(text(v) for v in value) if value else "none"
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(",", ":"))
    return str(value)


# ---- a row of the table -------------------------------------------------------------------------
@dataclass(frozen=True)
class Flag:
    """One Case field's flag. `const`: the flag alone sets the field to it (a switch). `draw`:
    how fuzz/sweep offer it: "pin" (values to pin or draw among), "fixed" (one value, as `check`
    takes it) or None (spelled otherwise there, e.g. `--world-sizes`, or meaningless in a draw).
    `special`: applied by `case_from_args` itself (fields that depend on each other)."""

    flag: str
    field: str
    group: str
    help: str
    parse: Callable[[str], Any] = str
    metavar: str | None = None
    const: Any = _MISSING
    draw: str | None = "pin"
    special: bool = False
    covers: tuple[str, ...] = ()  # further fields this flag sets (--model: kind and factory)
    invert: bool = False  # the field holds the flag's negation (--sync-last: sync_every_microbatch)

    @property
    def dest(self) -> str:
        return self.flag[2:].replace("-", "_")

    def value(self, given: Any) -> Any:
        """The field's value for the flag's value."""
        return (not given) if self.invert else given

    def tokens(self, field_value: Any) -> list[str]:
        """The flag and its text for a field value (the flag alone where that is its const)."""
        given = self.value(field_value)
        if self.const is not _MISSING and _same(given, self.const):
            return [self.flag]
        return [self.flag, text(given)]


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON holds them (1 is not 1.0, True is not 1): what a case's hash sees."""
    return json.dumps(a, sort_keys=True, default=list) == json.dumps(b, sort_keys=True, default=list)
