"""Checks: judgements that are not one record against its twin (parameter ownership, the
precision contract, RNG determinism, state every rank must share). Each is `check(case, ref, got)
-> list[Finding]`, reading what probes (verify/probes/) put into the traces.

A check that finds nothing wrong still says what it verified: one passing Finding of kind
"check" (or "skipped" when the run gave it nothing to read), so a passing verdict shows that
ownership, precision and RNG were checked, not only that nothing complained. To add a check, write
its module and list it in CHECKS with the phase it reports in and a one-line summary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from fsdp_verify.case import Case
from fsdp_verify.checks.build import build_summary, check_build
from fsdp_verify.checks.checkpointing import checkpointing_notes
from fsdp_verify.checks.comm import check_comm, comm_summary
from fsdp_verify.checks.compile import check_compile, compile_summary
from fsdp_verify.checks.knobs import check_knobs, knobs_summary
from fsdp_verify.checks.memory import check_memory, memory_summary
from fsdp_verify.checks.ownership import check_ownership
from fsdp_verify.checks.precision import check_precision, precision_summary
from fsdp_verify.checks.rng import check_rng, rng_summary
from fsdp_verify.checks.shared_state import check_buffers_across_ranks, check_frozen_params
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace


@dataclass(frozen=True)
class Check:
    name: str  # the comparator name its findings carry
    phase: str
    run: Callable[[Case, Trace, Trace], list[Finding]]
    # What a pass means for this run, or None when the run recorded nothing for it to read.
    summary: Callable[[Case, Trace, Trace], str | None] = lambda case, ref, got: None
    # An optional check that had nothing to read says nothing (a model without buffers); the
    # others say they were skipped, and the table shows "n/a".
    optional: bool = False
    # Why the case is not held to this check (a contract its engine or the case puts out of
    # the model, verify/engines/contracts.py), said where it is skipped; None: nothing recorded.
    off: Callable[[Case, Trace], str | None] = lambda case, got: None


def _contract_off(kind: str) -> Callable[[Case, Trace], str | None]:
    def why(case: Case, got: Trace) -> str | None:
        from fsdp_verify.engines.contracts import case_contracts

        contracts = case_contracts(case, got)
        return f"not held to it: {contracts.why}" if not getattr(contracts, kind) and contracts.why else None

    return why


def _ownership_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    raw = got.meta.get("ownership")
    if raw is None:
        return None
    n = len(raw.get("params", {}))
    return f"{n} parameters, each owned once by the unit the wrap plan implies, its shards covering it"


def _buffers_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    hashes = got.meta.get("buffer_hashes", {})
    names = {n for per in hashes.values() for n in per}
    return f"{len(names)} buffers equal on every rank" if names else None


def _frozen_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    if not case.model.frozen:
        return None
    until = f" until step {case.unfreeze_step}" if case.unfreeze_step is not None else ""
    return f"parameters under {list(case.model.frozen)} got no gradient and never moved{until}"


CHECKS: list[Check] = [
    Check("ModelBuildCheck", "build", check_build, build_summary, optional=True),
    Check("ActivationCheckpointing", "build", checkpointing_notes, optional=True),
    Check("KnobsApplied", "build", check_knobs, knobs_summary, optional=True),
    Check("OwnershipCheck", "ownership", check_ownership, _ownership_summary),
    Check("PrecisionContract", "precision", check_precision, precision_summary),
    Check("RngCheck", "rng", check_rng, rng_summary),
    Check("BufferRanksCheck", "buffers", check_buffers_across_ranks, _buffers_summary, optional=True),
    Check("FrozenParamsCheck", "params", check_frozen_params, _frozen_summary, optional=True),
    Check("CommContract", "comm", check_comm, comm_summary, off=_contract_off("comm")),
    Check("MemoryContract", "memory", check_memory, memory_summary, off=_contract_off("memory")),
    Check("CompileReport", "compile", check_compile, compile_summary, optional=True),
]


def run_checks(case: Case, ref: Trace, got: Trace, phases: tuple[str, ...] | None = None) -> list[Finding]:
    """Every check's findings (`phases`: only the checks reporting in those)."""
    findings: list[Finding] = []
    for check in CHECKS:
        if phases is not None and check.phase not in phases:
            continue
        found = check.run(case, ref, got)
        findings.extend(found)
        if any(not f.ok for f in found):
            continue
        summary = check.summary(case, ref, got)
        if summary is None and check.optional:
            continue
        kind = "check" if summary is not None else "skipped"
        message = (
            summary if summary is not None else check.off(case, got) or "nothing recorded for this check in this run"
        )
        findings.append(Finding(0, check.phase, f"<{check.name}>", True, kind, check.name, message))
    return findings
