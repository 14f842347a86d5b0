"""The resource contracts over a sweep's draw: the same cases `fsdp-verify sweep --cases N --seed S
[--hsdp]` runs, on the correct FSDP2 engine, tallied by what the communication and memory
contracts said on each (ran and held, skipped, or a finding), by world size, precision and mesh.
A sweep row keeps ratios, not the checks' kinds; this shows the contracts ran on every case and
raised nothing. Numbers only: calibration is off (the contracts do not use it).

    python bench/contracts.py --cases 300 --seed 1414 --hsdp
"""

from __future__ import annotations

import argparse
import collections
import time

from fsdp_verify.commands.options import strategy_from_args
from fsdp_verify.commands.sweep import add_arguments
from fsdp_verify.properties.draw import draw_cases
from fsdp_verify.runner import check_case

CONTRACTS = ("CommContract", "MemoryContract")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)  # the sweep's options, so the draw is the sweep's
    for action in parser._actions:
        if action.dest == "out":
            action.required = False  # nothing is written
    args = parser.parse_args()
    cases = draw_cases(strategy_from_args(args, hsdp=args.hsdp), args.cases, args.seed)
    tally: collections.Counter = collections.Counter()
    groups: collections.Counter = collections.Counter()
    findings = []
    t0 = time.perf_counter()
    for case in cases:
        verdict = check_case(case, calibrate=False)
        kinds = {
            f.comparator: ("finding" if not f.ok else f.kind) for f in verdict.findings if f.comparator in CONTRACTS
        }
        for name in CONTRACTS:
            tally[(name, kinds.get(name, "absent"))] += 1
        mesh = "x".join(map(str, case.mesh))
        groups[(case.world_size, mesh, case.precision.param_dtype or "fp32")] += 1
        findings += [(case.hash, f.message) for f in verdict.findings if f.comparator in CONTRACTS and not f.ok]
    print(f"{len(cases)} cases (seed {args.seed}, hsdp {args.hsdp}) in {time.perf_counter() - t0:.0f} s")
    for (name, kind), n in sorted(tally.items()):
        print(f"  {name:15s} {kind:8s} {n}")
    print("  cases by (world size, mesh, param dtype):", dict(sorted(groups.items())))
    for case_hash, message in findings:
        print(f"  FINDING case {case_hash}: {message}")
    return 1 if findings else 0


if __name__ == "__main__":
    raise SystemExit(main())
