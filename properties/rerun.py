"""Rerun determinism: the sharded side of one Case, run twice, must record the same bits.

Everything a run does follows from its Case, so two runs on the same pool must agree on every
record (and on the probes' metadata) bit for bit: not within a tolerance, byte for byte. A record
that differs means state leaked between runs (a module-level counter, a cache, an unseeded
generator) or a nondeterministic reduction; the finding names the first such record.
"""

from __future__ import annotations

import json

import torch

from fsdp_verify.case import Case
from fsdp_verify.compare.finding import Finding
from fsdp_verify.properties.failure import PropertyFailed
from fsdp_verify.sharded.pool import RankFailure, RankPool, get_pool
from fsdp_verify.trace import Trace, sort_key
from fsdp_verify.verdict import Verdict

COMPARATOR = "RerunDeterminism"

# trace.meta keys the probes write, by the phase whose records they describe
_META_PHASE = {"ownership": "ownership", "ties": "ownership", "optimizer_params": "ownership"}
_META_PHASE |= {"buffer_hashes": "buffers", "param_device_types": "rng"}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def compare_runs(first: Trace, second: Trace) -> list[Finding]:
    """One finding per record (ok when bit-identical) and per differing metadata key, in
    execution order."""
    findings: list[Finding] = []
    for key in sorted(set(first.records) | set(second.records), key=sort_key):
        step, phase, name = key
        if key not in first.records or key not in second.records:
            which = "first" if key not in first.records else "second"
            findings.append(
                Finding(step, phase, name, False, "missing", COMPARATOR, f"the {which} run has no such record")
            )
            continue
        a, b = first.records[key], second.records[key]
        if _same_bits(a, b):
            findings.append(Finding(step, phase, name, True, "deviation", COMPARATOR, mode="exact"))
            continue
        message = "the rerun of the same case recorded other bits"
        if a.shape == b.shape and a.dtype == b.dtype and a.is_floating_point():
            message += f" (max abs difference {(a.double() - b.double()).abs().max().item():.3g})"
        findings.append(Finding(step, phase, name, False, "mismatch", COMPARATOR, message))
    for key in sorted(set(first.meta) | set(second.meta)):
        a, b = first.meta.get(key), second.meta.get(key)
        if json.dumps(a, sort_keys=True) != json.dumps(b, sort_keys=True):
            message = f"the rerun of the same case recorded another trace.meta[{key!r}]"
            findings.append(
                Finding(0, _META_PHASE.get(key, "init"), f"meta:{key}", False, "mismatch", COMPARATOR, message)
            )
    return findings


def rerun_is_bitwise_identical(case: Case, pool: RankPool | None = None) -> list[Finding]:
    """Runs the sharded side of `case` twice; returns the findings for records that differ,
    first divergence first (empty when the reruns are identical)."""
    pool = pool or get_pool(case.world_size)
    first, second = pool.run(case), pool.run(case)
    return sorted((f for f in compare_runs(first, second) if not f.ok), key=lambda f: sort_key(f.key))


def rerun_property(case: Case, *, pool: RankPool | None = None, **_options) -> Verdict:
    """The named property: a Verdict over every record when the reruns agree, else
    PropertyFailed naming the first record that differs."""
    pool = pool or get_pool(case.world_size)
    try:
        first, second = pool.run(case), pool.run(case)
    except RankFailure as e:
        failure = e
    else:
        failure = None
    if failure is not None:  # outside the except: one bug to Hypothesis (see properties.py)
        raise PropertyFailed("rerun-is-bitwise-identical", case, failure=failure)
    verdict = Verdict(case, compare_runs(first, second))
    if not verdict.ok:
        raise PropertyFailed("rerun-is-bitwise-identical", case, verdict)
    return verdict
