"""RNG check: each rank's generator fingerprints against the reference's replay of that rank's
stream, exactly. Ranks whose fingerprints all agree with each other (world size > 1) drew the same
random numbers: the same dropout mask on every rank. Also a non-failing warning when the engine's
parameters live on another device type than the reference's initial draws (CPU): CPU and CUDA
generators give different values for one seed (seed 004, finding 1)."""

from __future__ import annotations

import torch

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.trace import Trace

COMPARATOR = "RngCheck"


def check_rng(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    findings = _device_warning(got.meta.get("param_device_types"))
    for key in ref.keys_sorted():
        step, phase, name = key
        if phase != "rng":
            continue
        if key not in got.records:
            findings.append(
                Finding(step, phase, name, False, "missing", COMPARATOR, "the sharded run has no such record")
            )
            continue
        want, have = ref.records[key], got.records[key]
        if torch.equal(want, have):
            continue
        ranks = [r for r in range(len(want)) if r >= len(have) or want[r] != have[r]]
        where = name.replace(".", " of micro-batch ").replace("_", " ")
        message = f"rank(s) {ranks} hold another random state {where} than the reference's replay of their stream"
        if len(have) > 1 and len(set(have.tolist())) == 1:
            message += "; every rank holds the same state: ranks draw the same dropout mask"
        findings.append(Finding(step, phase, name, False, "mismatch", COMPARATOR, message))
    return findings


def rng_summary(case: Case, ref: Trace, got: Trace) -> str | None:
    n = sum(1 for (_, phase, _) in ref.records if phase == "rng")
    if n == 0:
        return None
    return f"{n} generator fingerprints ({case.world_size} ranks each) equal to the reference's replay of each stream"


def _device_warning(devices: list[str] | None) -> list[Finding]:
    if not devices or devices == ["cpu"]:
        return []
    message = (
        f"the engine's parameters live on {', '.join(devices)} while the reference draws initial values and "
        "dropout masks on the CPU: CPU and CUDA generators differ for one seed, so values drawn on the "
        "device after sharding cannot match"
    )
    return [Finding(0, "rng", "device_type", True, "warning", COMPARATOR, message)]
