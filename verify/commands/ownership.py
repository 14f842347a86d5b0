"""`fsdp-verify ownership`: who owns each parameter, for a person to read. Runs the sharded side
of the case for one step on the rank pool, then prints, per shard unit, the parameters it owns,
their shapes and each rank's shard size (and padding), followed by the ownership check's verdict
(a partition: every parameter owned once, by the unit the wrap plan implies)."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from fsdp_verify.case import Case
from fsdp_verify.checks.ownership import check_ownership, expected_params
from fsdp_verify.commands.json_out import HELP as JSON_HELP
from fsdp_verify.commands.json_out import write_json
from fsdp_verify.commands.options import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_INFRA,
    EXIT_OK,
    add_case_arguments,
    add_timeout,
    case_from_args,
)
from fsdp_verify.compare.finding import Finding
from fsdp_verify.engines.ownership import OwnershipMap
from fsdp_verify.trace import Trace
from fsdp_verify.validation import CaseError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_case_arguments(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="write the map and the findings as JSON here " + JSON_HELP)
    add_timeout(p)


def by_unit(ownership: OwnershipMap) -> dict[str, list[str]]:
    """Unit -> the parameters it holds, in model order (a parameter held twice is listed twice)."""
    units: dict[str, list[str]] = {}
    for name, own in ownership.params.items():
        for unit in own.units:
            units.setdefault(unit, []).append(name)
    return units


def report(case: Case, ownership: OwnershipMap, findings: list[Finding]) -> str:
    ranks = range(case.world_size)
    header = ["parameter", "shape"] + [f"rank {r}" for r in ranks] + ["padding"]
    lines = [f"Ownership: {case.engine} on {case.model.kind}, world size {case.world_size} (case {case.hash})"]
    lines.append("rank r: elements of the parameter rank r holds, padding excluded; padding: per rank, in rank order")
    plan = {u: i for i, u in enumerate(case.wrap_plan)}
    units = sorted(by_unit(ownership).items(), key=lambda kv: plan.get(kv[0], len(plan)))
    for unit, names in units:
        numel = sum(math.prod(ownership.params[n].shape) for n in names)
        lines += ["", f"unit {unit or '<root>'!r}: {len(names)} parameters, {numel} elements"]
        rows = [header]
        for name in names:
            own = ownership.params[name]
            also = [u for u in own.units if u != unit]
            rows.append(
                [
                    name + (f"  (ALSO IN {', '.join(repr(u) for u in also)})" if also else ""),
                    "x".join(map(str, own.shape)),
                ]
                + [str(n) for n in own.local_numel]
                + ["/".join(map(str, own.padding)) if own.padding else "?"]
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines += ["", f"unmanaged: {', '.join(ownership.unmanaged) if ownership.unmanaged else 'none'}"]
    if findings:
        lines.append(f"NOT A PARTITION: {len(findings)} violation(s)")
        lines += [f"  {f.name!r}: {f.message}" for f in findings]
    else:
        lines.append(
            "partition: every parameter owned exactly once, by the unit the wrap plan implies; shards cover it"
        )
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.engines import EngineLoadError, resolve_case_engine
    from fsdp_verify.sharded.pool import RankFailure, get_pool

    try:
        case = case_from_args(args).with_(steps=1)
        resolve_case_engine(case)
    except (CaseError, OSError, EngineLoadError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        got = get_pool(case.world_size, args.timeout).run(case, args.timeout)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return EXIT_INFRA
    raw = got.meta.get("ownership")
    if raw is None:
        print(f"fsdp-verify: engine {case.engine!r} exposes no ownership map (its EngineView.ownership() is None)")
        return EXIT_BAD_INPUT
    ownership = OwnershipMap.from_json(raw)
    order = {name: i for i, name in enumerate(expected_params(case))}  # the trace's JSON sorted the keys
    ownership.params = dict(sorted(ownership.params.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0])))
    findings = check_ownership(case, Trace("reference"), got)
    print(report(case, ownership, findings))
    if args.json:
        data = {
            "case_hash": case.hash,
            "case": case.to_dict(),
            "ownership": raw,
            "units": by_unit(ownership),
            "findings": [f.to_dict() for f in findings],
        }
        write_json(args.json, data)
    return EXIT_DIVERGED if findings else EXIT_OK
