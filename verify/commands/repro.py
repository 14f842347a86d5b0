"""`fsdp-verify repro CASE.json`: replay a repro file with exit codes `git bisect run` understands.

    0    the engine agrees with the reference (good revision)
    1    it still diverges, or a rank crashes, raises or hangs running it (bad revision: an engine
         that cannot train the case is broken at this revision)
    125  the case cannot be run at this revision (skip): the case file is missing or holds a field
         or value this revision does not know, the engine does not import, the rank pool cannot
         start, the reference trainer itself fails, or the command line is not understood

Never 2 or 3: `git bisect run` would read those as "bad".
"""

from __future__ import annotations

import argparse
import shlex
import sys
import traceback
from pathlib import Path

from fsdp_verify.commands.json_out import HELP as JSON_HELP
from fsdp_verify.commands.json_out import write_json
from fsdp_verify.commands.options import ENGINE_HELP, EXIT_DIVERGED, EXIT_OK, add_timeout, engine_name, load_case
from fsdp_verify.trust import UntrustedCode, add_trust_argument
from fsdp_verify.validation import CaseError
from fsdp_verify.verdict import json_default

EXIT_CANNOT_RUN = 125  # `git bisect run`'s "skip this revision"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("case", type=Path, metavar="CASE.json", help="the repro file (a Case JSON)")
    p.add_argument("--engine", type=engine_name, help=f"run this engine instead of the case's ({ENGINE_HELP})")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the machine-readable verdict here " + JSON_HELP)
    add_timeout(p)
    add_trust_argument(p)

    def usage_error(message: str) -> None:  # a flag this revision lacks: skip it, do not call it bad
        p.print_usage(sys.stderr)
        print(f"{p.prog}: error: {message} (exit 125: cannot run at this revision)", file=sys.stderr)
        raise SystemExit(EXIT_CANNOT_RUN)

    p.error = usage_error


def run(args: argparse.Namespace) -> int:
    try:
        return _repro(args)
    except Exception:  # the toolkit itself broke at this revision: not the engine's fault
        traceback.print_exc()
        return _cannot_run("the toolkit failed (traceback above)")


def _cannot_run(why: str) -> int:
    print(f"fsdp-verify repro: cannot run the case at this revision: {why} (exit 125: skip)", file=sys.stderr)
    return EXIT_CANNOT_RUN


def _repro(args: argparse.Namespace) -> int:
    from fsdp_verify.engines import EngineLoadError, resolve_case_engine
    from fsdp_verify.repro.files import replay_command
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure

    try:
        case = load_case(args.case, args.engine, args)
        resolve_case_engine(case)  # an engine that does not import here is a skip, before any rank starts
    except UntrustedCode as e:  # not this revision's fault, yet never "bad": skip, having run nothing
        print(f"fsdp-verify repro: {e}\n(exit 125: skip; nothing was imported)", file=sys.stderr)
        return EXIT_CANNOT_RUN
    except (CaseError, OSError, EngineLoadError) as e:
        return _cannot_run(str(e))
    try:
        verdict = check_case(case, timeout_s=args.timeout)
    except RankFailure as e:
        if e.kind == "start":
            return _cannot_run(f"the rank pool did not start: {e}")
        print(f"fsdp-verify repro: the engine fails to run the case: {e}", file=sys.stderr)
        print("exit 1: bad (a rank crash, error or hang counts as a broken engine)", file=sys.stderr)
        return EXIT_DIVERGED
    print(verdict.summary())
    if args.json:
        write_json(args.json, verdict.to_dict(), default=json_default)
    if verdict.ok:
        print("exit 0: the engine agrees with the reference (good)")
        return EXIT_OK
    again = replay_command(args.case) + (f" --engine {shlex.quote(args.engine)}" if args.engine else "")
    again += " --trust-code" if args.trust_code else ""  # the choice made here, echoed
    print(f"exit 1: still diverges (bad). Replay: {again}")
    return EXIT_DIVERGED
