"""`fsdp-verify memory`: what each rank holds for a case, for a design review. Runs the sharded
side on the rank pool and prints, per rank, the sharded parameters, gradients and optimizer state
against what FSDP2's plan allows (verify/checks/memory.py), the unsharded parameters alive at
each boundary of the first step against what the plan allows there, the peak, and how many
times less than one device holds (seed 004's "3.9x less per rank at 8 ranks"). Exit 1 on a
finding."""

from __future__ import annotations

import argparse
from pathlib import Path

from fsdp_verify.commands.comm import describe, run_sharded, table
from fsdp_verify.commands.json_out import HELP as JSON_HELP
from fsdp_verify.commands.json_out import write_json
from fsdp_verify.commands.options import EXIT_DIVERGED, EXIT_OK, add_case_arguments, add_timeout


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_case_arguments(p)
    p.add_argument(
        "--json", type=Path, metavar="PATH", help="write the budget, the measurements and findings here " + JSON_HELP
    )
    add_timeout(p)


def report(case, got) -> tuple[list[str], list]:
    from fsdp_verify.checks.memory import budget, check_memory, judged_boundaries
    from fsdp_verify.engines.contracts import case_contracts
    from fsdp_verify.trace import Trace

    contracts = case_contracts(case)
    ranks = got.meta.get("memory", {}).get("ranks", [])
    b = budget(case, got)
    lines = [f"Memory: {describe(case)}"]
    lines.append(f"bytes per rank; sharded over a shard group of {b.shard}; optimizer {case.optim.name}")
    if not contracts.memory:
        lines.append(f"contract: n/a for {case.engine} ({contracts.why}); FSDP2's plan shown for comparison")
    last = str(case.steps)
    rows = [["", "plan allows"] + [f"rank {r}" for r in range(len(ranks))]]
    rows.append(["sharded params", f"= {b.sharded:,}"] + [f"{r['sharded']:,}" for r in ranks])
    rows.append([f"grads (step {last})", f"<= {b.grads:,}"] + [f"{r['grads'].get(last, 0):,}" for r in ranks])
    rows.append([f"optimizer state (step {last})", f"<= {b.optim:,}"] + [f"{r['optim'].get(last, 0):,}" for r in ranks])
    lines += ["", "persistent state:"] + table(rows)
    if getattr(case, "offload", False):  # CPUOffloadPolicy: where the sharded state is held
        from fsdp_verify.checks.memory import OFFLOADED

        rows = [["held on (offload: the CPU)", "plan"] + [f"rank {r}" for r in range(len(ranks))]]
        for what, label in OFFLOADED.items():
            rows.append([label, "cpu"] + [",".join(r.get("where", {}).get(what, [])) or "-" for r in ranks])
        lines += [""] + table(rows)
    judged = [judged_boundaries(case, b, r) for r in ranks]
    rows = [["boundary (step 1)", "micro-batch", "unsharded allowed"] + [f"rank {r}" for r in range(len(ranks))]]
    for i, (step, m, where, _held, _shapes, allowed, _unit) in enumerate(judged[0] if judged else []):
        if step == 1:
            rows.append([where, str(m), f"{allowed:,}"] + [f"{j[i][3]:,}" for j in judged])
    lines += ["", "unsharded parameters alive (full-shape Parameters the module holds beyond its shards):"] + table(
        rows
    )
    peak_allowed = b.per_rank + max((j[5] for j in judged[0]), default=0) if judged else b.per_rank
    peak = [
        r["sharded"]
        + max(r["grads"].values(), default=0)
        + max(r["optim"].values(), default=0)
        + max((x[3] for x in j), default=0)
        for r, j in zip(ranks, judged)
    ]
    lines += [
        "",
        f"peak (sharded state + the largest unsharded total at a boundary, after each unit's reshard; activations not counted on CPU):"
        f" plan {peak_allowed:,} B, measured {', '.join(f'{p:,}' for p in peak)} B",
        f"one device would hold {b.single_device(case):,} B (params, grads, optimizer state unsharded);"
        f" each rank {b.per_rank:,} B: {b.single_device(case) / b.per_rank:.2f}x less per rank at"
        f" {b.shard * getattr(case, 'tp', 1)} ranks{' (shard x tp)' if getattr(case, 'tp', 1) > 1 else ''}",
    ]
    findings = check_memory(case, Trace("reference"), got)
    if findings:
        lines.append(f"CONTRACT BROKEN: {len(findings)} finding(s)")
        lines += [f"  step {f.step}: {f.message}" for f in findings]
    elif contracts.memory:
        lines.append("contract holds: sharded state as planned, nothing unsharded beyond what the plan allows")
    return lines, findings


def run(args: argparse.Namespace) -> int:
    case, got = run_sharded(args)
    if case is None:
        return got
    lines, findings = report(case, got)
    print("\n".join(lines))
    if args.json:
        data = {
            "case_hash": case.hash,
            "case": case.to_dict(),
            "memory": got.meta.get("memory"),
            "findings": [f.to_dict() for f in findings],
        }
        write_json(args.json, data, default=None)
    return EXIT_DIVERGED if findings else EXIT_OK
