"""`fsdp-verify shrink CASE.json`: reduce a failing case to a minimal one that fails the same way
(see verify/repro/shrink.py) and write it as a repro file.

Exit codes: 1 the case fails (the shrunk case is written), 0 it does not fail (nothing to shrink),
2 bad input, 3 the case's failure is a rank crash, error or hang (the shrunk case is written; it
fails that same way), or the rank pool cannot start.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_verify.commands.options import (
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_INFRA,
    EXIT_OK,
    add_timeout,
    engine_name,
    load_case,
)
from fsdp_verify.repro.shrink import DEFAULT_MAX_RUNS
from fsdp_verify.trust import add_trust_argument
from fsdp_verify.validation import CaseError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", type=Path, metavar="CASE.json", help="the failing case (a Case JSON)")
    p.add_argument(
        "--out",
        type=Path,
        metavar="PATH",
        help="where to write the shrunk case (default: case-<hash>.json next to CASE.json)",
    )
    p.add_argument("--engine", type=engine_name, help="shrink against this engine instead of the case's")
    p.add_argument(
        "--max-runs", type=int, default=DEFAULT_MAX_RUNS, help=f"candidate runs at most (default {DEFAULT_MAX_RUNS})"
    )
    add_timeout(p)
    add_trust_argument(p)


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.engines import EngineLoadError, resolve_case_engine
    from fsdp_verify.repro.files import replay_command, write_repro
    from fsdp_verify.repro.shrink import describe, shrink
    from fsdp_verify.sharded.pool import RankFailure

    if args.max_runs < 0:
        print(f"fsdp-verify: --max-runs: expected a non-negative integer, got {args.max_runs}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        case = load_case(args.case, args.engine, args)
        resolve_case_engine(case)
    except (CaseError, OSError, EngineLoadError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT

    def progress(message: str) -> None:
        print(f"shrink: {message}", file=sys.stderr, flush=True)

    progress(f"from {describe(case)}")
    try:
        result = shrink(case, max_runs=args.max_runs, timeout_s=args.timeout, progress=progress)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return EXIT_INFRA
    if not result.fails:
        print(f"EQUIVALENT: the case does not fail, nothing to shrink ({describe(case)}).")
        return EXIT_OK
    path = result.case.save(args.out) if args.out else write_repro(result.case, args.case.parent)
    print(f"Shrunk in {result.runs} runs ({len(result.kept)} reductions kept", end="")
    print("; budget spent, it may shrink further)." if result.budget_exhausted else ", a fixed point).")
    print(f"  from: {describe(result.original)}")
    print(f"  to:   {describe(result.case)}")
    print(f"Fails the same way: {result.outcome.signature}.")
    if result.outcome.verdict is not None:
        print(result.outcome.verdict.summary())
    else:
        print(f"Infrastructure failure: {result.outcome.failure}")
    print(f"Wrote {path}")
    print(f"Replay: {replay_command(path)}{' --trust-code' if args.trust_code else ''}")  # the choice made here
    return EXIT_DIVERGED if result.outcome.verdict is not None else EXIT_INFRA
