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
    findings = _reshards_not_applied(case, got)
    for knob, evidence in got.meta.get("knobs_not_applied", []):
        field = TAKEABLE[knob].field if knob in TAKEABLE else knob
        message = (
            f"engine {case.engine!r} did not apply `{field}`"
            f"{f' ({TAKEABLE[knob].applies})' if knob in TAKEABLE else ''}, which it declares it takes:"
            f" {evidence} (the run stopped before its first step)"
        )
        findings.append(Finding(0, "build", f"<{field}>", False, "not applied", COMPARATOR, message))
    return findings


def _reshards_not_applied(case: Case, got: Trace) -> list[Finding]:
    """`reshard_after_forward` is the stable contract's: a unit the engine built otherwise (read
    from FSDP2's states, verify/engines/fsdp2_ownership.py `built_reshards`) is named, unless the
    engine declares it decides each unit's (`Capabilities.reshard_per_unit`: a framework's own
    policy). Read from rank 0's record, no collective: the run goes on, and the contracts judge
    each unit as built."""
    from fsdp_verify.engines import engine_capabilities
    from fsdp_verify.engines.fsdp2_ownership import BUILT_RESHARDS

    built = got.meta.get(BUILT_RESHARDS) or {}
    if not built or engine_capabilities(case.engine).reshard_per_unit:
        return []
    if case.ep > 1 or case.pp > 1:
        # the experts' unit shards over its own group, where an int the group does not divide is
        # applied as True (ShardSpec.unit_kwargs); a pipeline's stages are units of their own
        return []
    shard = case.mesh[-1]
    asked = _normal(case.reshard_after_forward, shard)
    for unit in case.wrap_plan:
        if unit in built and _normal(built[unit], shard) != asked:
            message = (
                f"engine {case.engine!r} did not apply `reshard_after_forward`: unit {unit or '<root>'!r} was built"
                f" with {built[unit]!r}, the case asks {case.reshard_after_forward!r} of every unit (an engine that"
                " sets it per unit declares `Capabilities(reshard_per_unit=True)`)"
            )
            return [Finding(0, "build", "<reshard_after_forward>", False, "not applied", COMPARATOR, message)]
    return []


def _normal(rsf: bool | int, shard: int) -> bool | int:
    """FSDP2's reading: an int of the shard size is True, an int 1 is False."""
    if rsf is True or rsf is False:
        return rsf
    return True if rsf == shard else False if rsf == 1 else int(rsf)


def knobs_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    asked = [k.field for k in TAKEABLE.values() if k.asked(case)]
    return f"the engine applied {', '.join(f'`{a}`' for a in asked)}" if asked else None
