"""Knobs check: the engine applied each engine-side knob the case asks for and it declares (read
by the knobs probe, verify/probes/knobs.py, right after sharding). One not applied is named as
such, at step 0, before anything it would have broken."""

from __future__ import annotations

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.engines.capabilities import TAKEABLE
from fsdp_verify.trace import Trace

COMPARATOR = "KnobsApplied"


def check_knobs(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    findings = []
    for knob, evidence in got.meta.get("knobs_not_applied", []):
        field = TAKEABLE[knob].field if knob in TAKEABLE else knob
        message = (
            f"engine {case.engine!r} did not apply `{field}`"
            f"{f' ({TAKEABLE[knob].applies})' if knob in TAKEABLE else ''}, which it declares it takes:"
            f" {evidence} (the run stopped before its first step)"
        )
        findings.append(Finding(0, "build", f"<{field}>", False, "not applied", COMPARATOR, message))
    return findings


def knobs_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    asked = [k.field for k in TAKEABLE.values() if k.asked(case)]
    return f"the engine applied {', '.join(f'`{a}`' for a in asked)}" if asked else None
