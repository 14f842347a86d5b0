"""`fsdp-verify check`: one case (the built-in default or `--case FILE`), both sides, a verdict."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

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
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable verdict here")
    p.add_argument("--html", type=Path, metavar="PATH", help="write a page with a heat map and plot of the verdict")
    add_timeout(p)
    p.add_argument("--no-calibrate", action="store_true", help="hold records to the bound only (no calibration runs)")
    p.add_argument("--save-case", type=Path, metavar="PATH", help="write the resolved case JSON here")


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.engines import EngineLoadError, resolve_engine
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure
    from fsdp_verify.sharded.torchrun import check_in_place, launched_by_torchrun

    try:
        case = case_from_args(args)
        resolve_engine(case.engine)  # fail fast, before any rank starts
    except (CaseError, OSError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineLoadError as e:
        print(f"fsdp-verify: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.save_case:
        case.save(args.save_case)
    try:
        if launched_by_torchrun():
            verdict, ok = check_in_place(case, calibrate=not args.no_calibrate)
            if verdict is None:  # ranks other than 0 exit with rank 0's verdict, reported there
                return EXIT_OK if ok else EXIT_DIVERGED
        else:
            verdict = check_case(case, timeout_s=args.timeout, calibrate=not args.no_calibrate)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return EXIT_INFRA
    print(verdict.table())
    print()
    print(verdict.summary())
    if args.json:
        verdict.save_json(args.json)
    if args.html:
        from fsdp_verify.reports.verdict_page import save_html

        save_html(verdict, args.html)
    return EXIT_OK if verdict.ok else EXIT_DIVERGED
