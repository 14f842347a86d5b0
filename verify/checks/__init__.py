"""Checks: judgements that are not one record against its twin (parameter ownership, the
precision contract, RNG determinism). Each is `check(case, ref, got) -> list[Finding]`, reading
what probes (verify/probes/) put into the traces. Add a module and list its function here."""

from __future__ import annotations

from collections.abc import Callable

from verify.case import Case
from verify.comparators import Finding
from verify.trace import Trace

Check = Callable[[Case, Trace, Trace], list[Finding]]

CHECKS: list[Check] = []


def _register_builtin() -> None:
    from verify.checks.ownership import check_ownership
    from verify.checks.rng import check_rng
    from verify.checks.shared_state import check_buffers_across_ranks, check_frozen_params

    CHECKS.extend([check_ownership, check_rng, check_buffers_across_ranks, check_frozen_params])
    from verify.checks.precision import check_precision

    CHECKS.append(check_precision)


_register_builtin()


def run_checks(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    findings: list[Finding] = []
    for check in CHECKS:
        findings.extend(check(case, ref, got))
    return findings
