"""`fsdp-verify zoom CASE`: check a case, then run its first diverging step again with per-module
and per-operation probes and name the module and the op where the two runs part
(verify/zoom/locate.py). Exit codes as `check`: 0 equivalent (and the zoom names nothing),
1 diverged, 2 bad input, 3 infrastructure failure."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fsdp_verify.commands.json_out import HELP as JSON_HELP
from fsdp_verify.commands.json_out import write_json
from fsdp_verify.commands.options import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_INFRA, EXIT_OK, add_timeout
from fsdp_verify.validation import CaseError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", type=Path, help="a case file (a fuzz or shrink repro, or `check --save-case`)")
    p.add_argument("--step", type=int, help="the step to zoom into (default: the first divergence's)")
    p.add_argument("--out", type=Path, metavar="DIR", default=Path("."), help="where the op's safetensors go")
    p.add_argument(
        "--json", type=Path, metavar="PATH", help="write the zoom (with the verdict) as JSON here " + JSON_HELP
    )
    p.add_argument("--trust-code", action="store_true", help="import the code the case file names")
    add_timeout(p)


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.case import Case
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure

    try:
        case = Case.load(args.case, trust_code=args.trust_code)
    except (CaseError, OSError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        t = time.perf_counter()
        verdict = check_case(case, timeout_s=args.timeout)
        seconds = time.perf_counter() - t
        print(verdict.summary())
        result = zoom_and_print(verdict, args.out, args.timeout, step=args.step, check_seconds=seconds)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return EXIT_INFRA
    except CaseError as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        write_json(args.json, {"verdict": verdict.to_dict(), "zoom": result.to_dict()})
    return EXIT_OK if verdict.ok and not result.named else EXIT_DIVERGED


def zoom_and_print(verdict, out: Path | None, timeout_s=None, step=None, check_seconds: float | None = None):
    """Zoom after a verdict (`check --zoom`, `fuzz` after shrinking, `zoom`) and print the chain."""
    from fsdp_verify.zoom.locate import zoom

    t = time.perf_counter()
    result = zoom(verdict.case, verdict, step=step, timeout_s=timeout_s, out_dir=out)
    cost = time.perf_counter() - t
    print(f"Zoom: {result.chain()}")
    if result.named:
        print(f"  module: {result.why}")
        if result.op_inputs_agree is not None:
            print(f"  op inputs {'agree' if result.op_inputs_agree else 'already part'} (within the bound)")
        if result.saved:
            print(f"  the op's inputs and outputs (reference and rank {result.rank}): {result.saved}")
    against = f" (the check: {check_seconds:.2f} s)" if check_seconds is not None else ""
    print(f"  zoom took {cost:.2f} s{against}")
    verdict.zoom = result
    return result
