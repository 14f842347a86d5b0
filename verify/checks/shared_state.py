"""Shared-state checks: state every rank holds whole must agree. Buffers (RoPE frequencies, norm
statistics) must be the same on every rank (rank 0's copy is compared with the reference by
BuffersComparator; the other ranks only by these hashes). Frozen parameters (the model spec's
`frozen` prefixes) must never move: equal after every step to their initial values."""

from __future__ import annotations

import torch

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace


def check_buffers_across_ranks(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    findings = []
    for step, per_buffer in sorted(got.meta.get("buffer_hashes", {}).items(), key=lambda kv: int(kv[0])):
        for name, hashes in per_buffer.items():
            # under pp a rank may hold only its stages' buffers: "" where it holds none of this one
            holders = [r for r, h in enumerate(hashes) if h or case.pp == 1]
            first = holders[0] if holders else 0
            others = [r for r in holders if hashes[r] != hashes[first]]
            if others:
                whom = "rank 0" if first == 0 else f"rank {first} (the first holding it)"
                message = f"rank(s) {others} hold another {name!r} than {whom} (buffers are never synchronised)"
                findings.append(Finding(int(step), "buffers", name, False, "mismatch", "BufferRanksCheck", message))
    return findings


def frozen_names(case: Case, names: list[str]) -> list[str]:
    return [n for n in names if any(n == f or n.startswith(f + ".") for f in case.model.frozen)]


def check_frozen_params(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    """First step at which each frozen parameter received a gradient, and first step at which it
    moved away from its initial value, over the steps it is frozen (all, or those before the
    case's `unfreeze_step`)."""
    if not case.model.frozen:
        return []
    findings = []
    last = got.steps if case.unfreeze_step is None else min(got.steps, case.unfreeze_step - 1)
    initial = {n: t for (s, p, n), t in got.records.items() if s == 0 and p == "init"}
    for name in frozen_names(case, sorted(initial)):
        with_grad = sorted(s for (s, p, n) in got.records if p == "grads" and n == name and s <= last)
        if with_grad:
            message = "frozen (requires_grad=False) but the engine produced a gradient for it"
            findings.append(Finding(with_grad[0], "grads", name, False, "mismatch", "FrozenParamsCheck", message))
        for step in range(1, last + 1):
            now = got.records.get((step, "params", name))
            if now is not None and not torch.equal(now, initial[name]):
                moved = (now.double() - initial[name].double()).abs().max().item()
                message = f"frozen (requires_grad=False) but moved by up to {moved:.3g} since initialisation"
                findings.append(Finding(step, "params", name, False, "mismatch", "FrozenParamsCheck", message))
                break
    return findings
