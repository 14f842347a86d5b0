"""`fsdp-verify check`: one case (the built-in default or `--case FILE`), both sides, a verdict."""

from __future__ import annotations

import argparse
import sys
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
from fsdp_verify.verdict import json_default


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_case_arguments(p)
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable verdict here " + JSON_HELP)
    p.add_argument("--html", type=Path, metavar="PATH", help="write a page with a heat map and plot of the verdict")
    p.add_argument("--out", type=Path, metavar="DIR", help="write report.json and report.html (the one report format)")
    add_timeout(p)
    p.add_argument("--no-calibrate", action="store_true", help="hold records to the bound only (no calibration runs)")
    p.add_argument(
        "--zoom",
        action="store_true",
        help="on a divergence, rerun the step with module and op probes and name where the runs part (docs/zoom.md)",
    )
    p.add_argument("--save-case", type=Path, metavar="PATH", help="write the resolved case JSON here")
    p.add_argument(
        "--print-flags",
        action="store_true",
        help="print the command line that rebuilds the resolved case from flags alone (no --case), and exit",
    )


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.engines import EngineLoadError, resolve_case_engine
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure
    from fsdp_verify.sharded.torchrun import check_in_place, launched_by_torchrun, leave_in_place

    try:
        case = case_from_args(args)
        resolve_case_engine(case)  # fail fast, before any rank starts
    except (CaseError, OSError) as e:
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except EngineLoadError as e:
        print(f"fsdp-verify: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.save_case:
        case.save(args.save_case)
    if args.print_flags:
        print(check_command(case))
        return EXIT_OK
    try:
        if launched_by_torchrun():
            verdict, ok = check_in_place(case, calibrate=not args.no_calibrate)
            if verdict is None:  # ranks other than 0 exit with rank 0's verdict, reported there
                leave_in_place(EXIT_OK if ok else EXIT_DIVERGED)
        else:
            verdict = check_case(case, timeout_s=args.timeout, calibrate=not args.no_calibrate)
    except RankFailure as e:
        print(f"fsdp-verify: infrastructure failure: {e}", file=sys.stderr)
        return EXIT_INFRA
    except CaseError as e:  # the user's step failed on the reference (verify/training/user_step.py)
        print(f"fsdp-verify: bad case: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    print(verdict.table())
    print()
    if verdict.loss_scales:
        print(verdict.loss_scale_line())
    print(verdict.summary())
    if not verdict.ok:
        print(f"Rerun from flags: {check_command(verdict.case)}")
    if args.zoom and not verdict.ok and verdict.case.step is None:
        from fsdp_verify.commands.zoom import zoom_and_print

        try:
            zoom_and_print(verdict, args.out or Path("."), args.timeout, check_seconds=sum(verdict.seconds.values()))
        except RankFailure as e:
            print(f"fsdp-verify: infrastructure failure while zooming: {e}", file=sys.stderr)
            return EXIT_INFRA
    if args.json:
        write_json(args.json, verdict.to_dict(), default=json_default)
    if args.html:
        from fsdp_verify.reports.verdict_page import save_html

        save_html(verdict, args.html)
    if args.out:
        write_check_report(verdict, args.out)
    code = EXIT_OK if verdict.ok else EXIT_DIVERGED
    if launched_by_torchrun():
        leave_in_place(code)
    return code


def check_command(case) -> str:
    """`fsdp-verify check` with the flags that rebuild `case` (verify/commands/case_flags.py)."""
    import shlex

    from fsdp_verify.commands.case_flags import case_to_flags

    return shlex.join(["fsdp-verify", "check", *case_to_flags(case)])


def write_check_report(verdict, out: Path) -> None:
    """The one report format for one case; the page adds the verdict's steps x phases heat map."""
    from fsdp_verify.reports.page import render
    from fsdp_verify.reports.report import case_row, finish, write
    from fsdp_verify.reports.verdict_page import heat_map, ratio_plot

    row = case_row(verdict.case, verdict, sum(verdict.seconds.values()))
    failures = None
    if not verdict.ok:
        from fsdp_verify.repro.files import replay_command

        path = verdict.case.save(out / f"case-{verdict.case.hash}.json")
        failures = [
            {
                "case_hash": verdict.case.hash,
                "summary": verdict.summary(),
                "first_divergence": row["first_divergence"],
                **({"zoom": verdict.zoom.chain()} if verdict.zoom is not None else {}),
                "replay": replay_command(path),
                "case": verdict.case.to_dict(),
            }
        ]
    report = finish("check", [row], seconds=row["seconds"], engine=verdict.case.engine, failures=failures)
    _, html_path = write(report, out)
    from fsdp_verify.reports.zoom_page import zoom_section

    extra = f"<h2>Steps x phases</h2>{heat_map(verdict)}<h2>Worst ratio per phase</h2>{ratio_plot(verdict)}"
    extra += zoom_section(row.get("zoom"))
    html_path.write_text(render(report, extra))
