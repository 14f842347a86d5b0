"""`fsdp-verify comm`: the communication a case costs, for a design review. Runs the sharded side
of the case on the rank pool and prints, per unit and collective of the first step, the bytes
FSDP2's model implies (verify/checks/comm.py) against the bytes each rank issued, then the totals
per step, kind, dtype and group, then the contract's verdict (exit 1 on a finding)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

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
from fsdp_verify.validation import CaseError


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_case_arguments(p)
    p.add_argument(
        "--json", type=Path, metavar="PATH", help="write expected and measured collectives as JSON here " + JSON_HELP
    )
    add_timeout(p)


def table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def describe(case) -> str:
    mesh = f"mesh {case.mesh}" if len(case.mesh) == 2 else f"world size {case.world_size}"
    return (
        f"{case.engine} on {case.model.kind}, {mesh}, {case.precision.describe()},"
        f" reshard_after_forward={case.reshard_after_forward}, {case.microbatches} micro-batch(es),"
        f" clip {case.clip_norm},{' ' + case.loss_scaling.describe() + ',' if case.loss_scaling else ''}"
        f" {case.steps} steps (case {case.hash})"
    )


def run_sharded(args: argparse.Namespace):
    """The case and its sharded trace, or an exit code."""
    from fsdp_verify.engines import EngineLoadError, resolve_case_engine
    from fsdp_verify.sharded.pool import RankFailure, get_pool

    try:
        case = case_from_args(args)
        resolve_case_engine(case)
    except (CaseError, OSError, EngineLoadError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return None, EXIT_BAD_INPUT
    try:
        return case, get_pool(case.world_size, args.timeout).run(case, args.timeout)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return None, EXIT_INFRA


def report(case, got) -> tuple[list[str], list]:
    from fsdp_verify.checks.comm import check_comm, expected_collectives, match, measured_collectives
    from fsdp_verify.checks.tp_comm import underivable
    from fsdp_verify.engines.contracts import case_contracts
    from fsdp_verify.trace import Trace

    contracts = case_contracts(case)
    ranks = measured_collectives(got) or [[]]
    expected = expected_collectives(case, got) if contracts.comm else []
    lines = [f"Communication: {describe(case)}"]
    lines.append(
        "bytes: per rank, the unsharded side (an all-gather's output, a reduce-scatter's input, an all-reduce's)"
    )
    if not contracts.comm:
        lines.append(f"contract: n/a for {case.engine} ({contracts.why}); measured only")
    elif case.parallel.tp > 1 and underivable(case):
        lines.append(f"contract over tp: n/a ({underivable(case)}); measured only")
    rows = [["micro-batch", "phase", "unit", "collective", "dtype", "group", "expected B", "measured B", ""]]
    for row in match([e for e in expected if e.step == 1], [g for g in ranks[0] if g.step == 1]):
        e, g = row.expected, row.measured
        c = e or g
        rows.append(
            [
                str(c.microbatch),
                c.phase,
                e.unit if e else "?",
                f"{c.kind}" if g is None or e is None or g.kind == e.kind else f"{e.kind} / {g.kind}",
                c.dtype if g is None or e is None or g.dtype == e.dtype else f"{e.dtype} / {g.dtype}",
                group_of(c),
                f"{e.bytes:,}" if e else "-",
                f"{g.bytes:,}" if g else "-",
                "" if not contracts.comm else ("ok" if row.ok else "DIFFERS"),
            ]
        )
    lines += ["", "step 1, rank 0 (expected / measured where they differ):"] + table(rows)
    totals = [["step", "collective", "dtype", "group", "expected B", "measured B (rank 0)"]]
    want = Counter()
    for e in expected:
        want[(e.step, e.kind, e.dtype, group_of(e))] += e.bytes
    got_bytes = Counter()
    for g in ranks[0]:
        got_bytes[(g.step, g.kind, g.dtype, group_of(g))] += g.bytes
    for key in sorted(set(want) | set(got_bytes)):
        totals.append([str(key[0]), key[1], key[2], key[3], f"{want[key]:,}", f"{got_bytes[key]:,}"])
    lines += ["", "per step:"] + table(totals)
    same = all(
        [(g.step, g.microbatch, g.phase, g.kind, g.dtype, g.group, g.bytes) for g in r]
        == [(g.step, g.microbatch, g.phase, g.kind, g.dtype, g.group, g.bytes) for g in ranks[0]]
        for r in ranks
    )
    lines.append(f"ranks: {len(ranks)} measured; every rank issued what rank 0 did: {'yes' if same else 'NO'}")
    findings = check_comm(case, Trace("reference"), got)
    if findings:
        lines.append(f"CONTRACT BROKEN: {len(findings)} finding(s)")
        lines += [f"  step {f.step}: {f.message}" for f in findings]
    elif contracts.comm:
        tp = case.parallel.tp > 1 and not underivable(case)
        model = "FSDP2's model and the tp plan imply" if tp else "FSDP2's model implies"
        lines.append(f"contract holds: {len(expected)} collectives per rank, each as {model}")
    return lines, findings


def group_of(c) -> str:
    """A collective's group: its size, and in a tp case the mesh dim it spans."""
    return f"{c.group} ({c.over})" if c.over else str(c.group)


def run(args: argparse.Namespace) -> int:
    case, got = run_sharded(args)
    if case is None:
        return got
    lines, findings = report(case, got)
    print("\n".join(lines))
    if args.json:
        from fsdp_verify.checks.comm import expected_collectives, measured_collectives

        data = {
            "case_hash": case.hash,
            "case": case.to_dict(),
            "expected": [e.__dict__ for e in expected_collectives(case, got)],
            "measured": [[g.__dict__ for g in r] for r in measured_collectives(got) or []],
            "findings": [f.to_dict() for f in findings],
        }
        write_json(args.json, data, default=None)
    return EXIT_DIVERGED if findings else EXIT_OK
