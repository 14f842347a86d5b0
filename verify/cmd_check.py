"""`fsdp-verify check`: one case (the built-in default or `--case FILE`), both sides, a verdict."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verify.case import Case, CaseError, ModelSpec
from verify.cli import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INFRA, EXIT_OK


def add_case_arguments(p: argparse.ArgumentParser) -> None:
    """The Case overrides people change most; shared by every subcommand that builds a case."""
    p.add_argument("--case", type=Path, help="a Case JSON file (default: the built-in default case)")
    p.add_argument("--engine", help="fsdp2 | pkg.module:NAME | path/to/file.py:NAME")
    p.add_argument("--world-size", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--model", choices=("mlp", "transformer"))
    p.add_argument("--param-dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--reduce-dtype", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--seed", type=int)
    p.add_argument("--batch-size", type=int, help="global batch (default: rounded up to fit the world size)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_case_arguments(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable verdict here")
    p.add_argument("--html", type=Path, metavar="PATH", help="write a page with a heat map and plot of the verdict")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds a rank may go without finishing (default 120)")
    p.add_argument("--no-calibrate", action="store_true", help="hold records to the bound only (no calibration runs)")
    p.add_argument("--save-case", type=Path, metavar="PATH", help="write the resolved case JSON here")


def case_from_args(args: argparse.Namespace) -> Case:
    """The built-in default or --case, with the command-line overrides applied. Raises CaseError."""
    case = Case.load(args.case) if args.case else Case()
    changes: dict = {}
    if args.engine:
        changes["engine"] = args.engine
    if args.world_size is not None:
        changes["world_size"] = args.world_size
        changes["mesh_shape"] = None
    if args.steps is not None:
        changes["steps"] = args.steps
    if args.seed is not None:
        changes["seed"] = args.seed
    if args.model and args.model != case.model.kind:
        changes["model"] = ModelSpec(kind=args.model)
        changes["wrap"] = None
    if args.param_dtype:
        changes["precision.param_dtype"] = args.param_dtype
    if args.reduce_dtype:
        changes["precision.reduce_dtype"] = args.reduce_dtype
    world = changes.get("world_size", case.world_size)
    if args.batch_size is not None:
        changes["data.batch_size"] = args.batch_size
    elif not args.case and world is not None and isinstance(world, int) and world > 0:
        per = world * case.microbatches
        changes["data.batch_size"] = -(-case.data.batch_size // per) * per
    return case.with_(**changes) if changes else case


def run(args: argparse.Namespace) -> int:
    from verify.engines import EngineLoadError, resolve_engine
    from verify.pool import RankFailure
    from verify.runner import check_case, check_in_place, launched_by_torchrun

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
        from verify.verdict_html import save_html

        save_html(verdict, args.html)
    return EXIT_OK if verdict.ok else EXIT_DIVERGED
