"""The one report format (`report.json` of check, fuzz, sweep, selftest and compare): its version, the JSON
Schema shipped beside this module, and loading a report with a clear error naming the bad field.
Readers (merge, diff, trend) refuse a report of another schema_version rather than guess."""

from __future__ import annotations

import json
import math
from functools import cache
from pathlib import Path
from typing import Any

# A field added as optional (a case row's `zoom`, `cause`, `hint`, `replay`; a report's `causes` and
# their `example`, `engine_correct`, `warnings`,
# fuzz's `first_failure`) keeps the version: a reader of version 1 that does not know it is
# unaffected, and this release's readers derive it from a report that lacks it (causes.causes_of).
# A field removed, renamed or made required is a new version.
SCHEMA_VERSION = 1
SCHEMA_PATH = Path(__file__).with_name("report.schema.json")
KINDS = ("check", "fuzz", "sweep", "selftest", "compare")


class ReportError(ValueError):
    """A report that is missing, unreadable or not of this schema: the message names the file and field."""


@cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def validate(report: dict[str, Any], where: str = "report") -> None:
    """Raise ReportError naming the first field that breaks the schema."""
    import jsonschema

    if report.get("schema_version") != SCHEMA_VERSION:
        raise ReportError(
            f"{where}: schema_version: expected {SCHEMA_VERSION}, got {report.get('schema_version')!r}"
            " (a report from another fsdp-verify release)"
        )
    errors = sorted(jsonschema.Draft202012Validator(schema()).iter_errors(report), key=lambda e: list(e.path))
    if errors:
        e = errors[0]
        field = ".".join(str(p) for p in e.absolute_path) or "<top level>"
        raise ReportError(f"{where}: {field}: {e.message}")


def ratio(value: float | None) -> float | str | None:
    """A ratio as JSON allows: inf (a contract or exact record that failed) becomes "inf"."""
    if value is None:
        return None
    return "inf" if math.isinf(value) else float(value)


def as_float(value: float | str | None) -> float | None:
    """The inverse of `ratio`."""
    if value is None:
        return None
    return math.inf if value == "inf" else float(value)


def load(path: str | Path) -> dict[str, Any]:
    """A report.json (or a directory holding one), validated."""
    p = Path(path)
    if p.is_dir():
        p = p / "report.json"
    if not p.is_file():
        raise ReportError(f"{path}: no report.json there")
    try:
        report = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ReportError(f"{p}: not valid JSON: {e}") from None
    if not isinstance(report, dict):
        raise ReportError(f"{p}: expected a JSON object")
    validate(report, str(p))
    return report


def dump(report: dict[str, Any], path: str | Path) -> Path:
    """Validate, then write: no reader ever sees a report this release would refuse."""
    validate(report, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, allow_nan=False) + "\n")
    return path
