"""Ownership check: the engine's map from parameter to shard unit must be a partition.

Every parameter the reference trains is owned exactly once, by the unit the wrap plan implies (the
innermost wrapped ancestor); nothing is unmanaged; each replica's ranks hold exactly the
parameter's elements between them, with equal padded shards; tied parameters stay one parameter;
and the optimizer steps exactly the tensors the sharded module computes with. Seed 004 lost a week
to a parameter flattened into two FlatParameters: here that is one finding naming both owners.
All findings sit at step 0, phase "ownership", which the first divergence searches first.
"""

from __future__ import annotations

import functools
import math

import torch

from fsdp_verify.case import Case, ModelSpec
from fsdp_verify.compare.finding import Finding
from fsdp_verify.engines.ownership import OwnershipMap
from fsdp_verify.engines.tensor_parallel import split_parameters
from fsdp_verify.models import _construct, is_ignored, module_names
from fsdp_verify.trace import Trace
from fsdp_verify.units import members, owner_of_module

COMPARATOR = "OwnershipCheck"


def _fail(name: str, kind: str, message: str) -> Finding:
    return Finding(0, "ownership", name, False, kind, COMPARATOR, message)


def expected_ties(case: Case) -> list[list[str]]:
    """Names sharing one tensor in the unsharded model."""
    return [list(names) for names in _structure(case.model)[1]]


def expected_params(case: Case) -> list[str]:
    """The parameters the reference trains, tied weights once under their first name."""
    return list(_structure(case.model)[0])


@functools.lru_cache(maxsize=64)
def _structure(spec: ModelSpec) -> tuple[tuple[str, ...], tuple[tuple[str, ...], ...], dict[str, tuple[int, ...]]]:
    """(parameter names, groups of tied names, shapes) of a model spec, from one meta-device
    build (no memory), kept per spec: building even on meta costs a medium Transformer tens of ms
    a case."""
    with torch.device("meta"):
        model = _construct(spec)
    by_tensor: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        by_tensor.setdefault(id(p), []).append(name)
    params = tuple(name for name, _ in model.named_parameters())
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    return params, tuple(tuple(names) for names in by_tensor.values() if len(names) > 1), shapes


def check_ownership(case: Case, ref: Trace, got: Trace) -> list[Finding]:
    """The map first, then ties, then the optimizer: for one parameter with several violations,
    the most fundamental one is reported first (the verdict's sort keeps this order)."""
    ties = expected_ties(case)
    raw = got.meta.get("ownership")  # None: the engine cannot say who owns what
    findings = check_map(case, OwnershipMap.from_json(raw), expected_params(case), ties) if raw is not None else []
    # Under pipeline parallelism a tie across stages is two tensors by design, one on each stage,
    # their gradients summed by the pipeline: a sum left out shows in the gradients.
    findings += _check_ties(ties, got.meta.get("ties")) if case.parallel.pp == 1 else []
    return findings + _check_optimizer(got.meta.get("optimizer_params"))


def check_map(case: Case, ownership: OwnershipMap, expected: list[str], ties: list[list[str]]) -> list[Finding]:
    """`expected`: the parameters the reference trains (tied weights once, under their first name)."""
    findings: list[Finding] = []
    aliases = {alias: names[0] for names in ties for alias in names[1:]}
    plan = case.wrap_plan
    # Units named by modules (FSDP2's, a group's members joined by '+'), not by FlatParameters:
    # each parameter's is held to the plan's
    modules = module_names(case.model)
    module_units = all(m in modules for o in ownership.params.values() for u in o.units for m in members(u))
    ignored = getattr(case, "ignored", ())
    for name in ownership.unmanaged:
        if is_ignored(ignored, name):
            continue  # fully_shard's ignored_params: unmanaged by design (the loop reduces it)
        findings.append(_fail(name, "unmanaged", "no shard unit owns it: it stays replicated and is never reduced"))
    for name in ownership.params:
        if is_ignored(ignored, name):
            findings.append(
                _fail(name, "ignored", "in the case's `ignored`, but a shard unit owns it (sharded, reduced)")
            )
    for name in expected:
        if name not in ownership.params and name not in ownership.unmanaged:
            findings.append(_fail(name, "missing", "absent from the engine's ownership map"))
    for name, own in ownership.params.items():
        if name not in expected:
            canonical = aliases.get(name)
            why = (
                f"tied to {canonical!r} in the model, but the engine owns it as a separate parameter"
                if canonical
                else "not a parameter of the reference model"
            )
            findings.append(_fail(name, "unexpected", why))
        if len(own.units) != 1:
            owners = " and ".join(repr(u) for u in own.units) or "no unit"
            findings.append(
                _fail(name, "ownership", f"owned by {len(own.units)} units: {owners} (must be exactly one)")
            )
            continue
        module = name.rsplit(".", 1)[0] if "." in name else ""
        want = owner_of_module(plan, module)
        if module_units and own.units[0] != want:
            findings.append(
                _fail(name, "ownership", f"owned by {own.units[0]!r}, but the wrap plan puts it in {want!r}")
            )
        # the parameter's own shape (an engine may state a tensor-parallel shard's)
        shape = _structure(case.model)[2].get(name, own.shape)
        findings.extend(_check_coverage(case, name, shape, own.local_numel, own.padding))
    return findings


def _check_coverage(
    case: Case, name: str, shape: tuple[int, ...], local: tuple[int, ...], padding: tuple[int, ...]
) -> list[Finding]:
    """Within each replica, the ranks' local pieces add up to the parameter exactly, and every
    rank's piece plus its padding is the same size (the padded chunk all-gathered). Under tensor
    parallelism a replica is its shard group's ranks times the tp ranks (rank (s, t) = s * tp + t):
    a parameter the plan splits is held once by all of them together (2-D shards, the data-
    parallel one a `_StridedShard` of the tp one), any other once by each tp rank's shard group."""
    shard, tp = case.mesh[-1], case.parallel.tp
    numel = math.prod(shape)
    if len(local) != case.world_size:
        return [_fail(name, "ownership", f"local sizes for {len(local)} ranks, expected {case.world_size}")]
    split = tp > 1 and name in split_parameters(case)
    out = []
    for start in range(0, case.world_size, shard * tp):
        groups = (
            [range(start, start + shard * tp)]
            if split
            else [range(start + t, start + shard * tp, tp) for t in range(tp)]
        )
        for ranks in groups:
            out += _check_group(name, numel, local, padding, ranks)
    return out


def _check_group(
    name: str, numel: int, local: tuple[int, ...], padding: tuple[int, ...], ranks: range
) -> list[Finding]:
    out = []
    held = sum(local[r] for r in ranks)
    if held != numel:
        sizes = ", ".join(f"rank {r}: {local[r]}" for r in ranks)
        where = f"ranks {ranks[0]}..{ranks[-1]}" if ranks.step == 1 else f"ranks {', '.join(map(str, ranks))}"
        out.append(_fail(name, "ownership", f"{where} hold {held} of its {numel} elements ({sizes})"))
    if padding:
        padded = {local[r] + padding[r] for r in ranks}
        if len(padded) > 1:
            out.append(_fail(name, "ownership", f"padded shard sizes differ across ranks: {sorted(padded)}"))
    return out


def _check_ties(expected: list[list[str]], seen: list[list[str]] | None) -> list[Finding]:
    """Each group of tied names must still resolve to one tensor in the sharded module."""
    if seen is None:
        return []
    seen_sets = [set(g) for g in seen]
    out = []
    for names in expected:
        if not any(set(names) <= g for g in seen_sets):
            out.append(
                _fail(
                    names[0],
                    "tie",
                    f"tied to {', '.join(repr(n) for n in names[1:])} in the model, but after sharding they are "
                    "separate tensors (the tie was broken: each copy trains on its own gradient)",
                )
            )
    return out


def _check_optimizer(per_rank: list[dict] | None) -> list[Finding]:
    if per_rank is None:
        return []
    out = []
    for rank, seen in enumerate(per_rank):
        for name in seen.get("stale", []):
            out.append(
                _fail(
                    name,
                    "optimizer",
                    f"rank {rank}'s optimizer steps a tensor for it that is not a parameter of the sharded module "
                    "(a stale pre-sharding parameter, or a copy the module does not compute with)",
                )
            )
        for name in seen.get("not_stepped", []):
            out.append(_fail(name, "optimizer", f"rank {rank}'s optimizer does not hold it"))
        if seen.get("foreign", 0):
            out.append(
                _fail(
                    "<optimizer>",
                    "optimizer",
                    f"rank {rank}'s optimizer holds {seen['foreign']} tensors the engine does not expose as parameters",
                )
            )
        if out:
            break  # one rank's story is enough; ranks agree unless the engine is rank-dependent
    return out
