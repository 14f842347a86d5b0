"""CaseError and the small checks that raise it: every bad value is reported with the field that
holds it and what was expected there, so bad input fails with exit code 2 before a rank starts."""

from __future__ import annotations

from typing import Any


class CaseError(ValueError):
    """A Case field holds a value the toolkit cannot run; the message names the field."""

    def __init__(self, field_path: str, expected: str, got: Any):
        self.field_path = field_path
        self.expected, self.got = expected, got
        super().__init__(f"{field_path}: expected {expected}, got {got!r}")


def check(ok: bool, field_path: str, expected: str, got: Any) -> None:
    if not ok:
        raise CaseError(field_path, expected, got)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
