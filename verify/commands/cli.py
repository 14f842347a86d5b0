"""`fsdp-verify`: the command line. Each subcommand lives in its own module exposing
`add_arguments(parser)` and `run(args) -> int`; this file only dispatches.

Exit codes (all subcommands): 0 equivalent / passed, 1 divergence found, 2 bad input or usage,
3 infrastructure failure (a rank crashed or hung), 125 (repro only) cannot run at this revision,
130 (fuzz, sweep) stopped by Ctrl-C after writing the report of what ran.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from fsdp_verify import __version__
from fsdp_verify.commands.json_out import to_stderr
from fsdp_verify.commands.options import EXIT_BAD_INPUT
from fsdp_verify.sharded.allocator import keep_freed_memory

# (name, module, one-line help). A module provides add_arguments(parser) and run(args) -> int.
SUBCOMMANDS: list[tuple[str, str, str]] = [
    ("check", "fsdp_verify.commands.check", "run one case on the reference and the engine, report where they part"),
    (
        "zoom",
        "fsdp_verify.commands.zoom",
        "rerun a diverging step with probes: name the module and the op where the runs part",
    ),
    (
        "ownership",
        "fsdp_verify.commands.ownership",
        "print which shard unit owns each parameter and check it is a partition",
    ),
    ("comm", "fsdp_verify.commands.comm", "print a case's collectives per unit and step against FSDP2's model"),
    (
        "memory",
        "fsdp_verify.commands.memory",
        "print what each rank holds (sharded state, unsharded params) against the plan",
    ),
    ("shrink", "fsdp_verify.commands.shrink", "reduce a failing case to a minimal one that fails the same way"),
    ("repro", "fsdp_verify.commands.repro", "replay a repro file; exit 0 / 1 / 125 for `git bisect run`"),
    ("selftest", "fsdp_verify.commands.selftest", "run the bug zoo: every injected bug must be caught (exit 1 if not)"),
    (
        "fuzz",
        "fsdp_verify.commands.fuzz",
        "generate cases, check a property on each; shrink a failure to a minimal repro",
    ),
    (
        "sweep",
        "fsdp_verify.commands.sweep",
        "the nightly sweep: generated cases, sharded, resumable; failures grouped by cause",
    ),
    (
        "compare",
        "fsdp_verify.commands.compare",
        "compare two recorded runs (your script and its sharded twin) step by step; the data check",
    ),
    (
        "gate",
        "fsdp_verify.commands.gate",
        "the same cases under two or more torch releases, each in its own venv; what got worse",
    ),
    ("report", "fsdp_verify.commands.report", "merge shards' reports, diff two nights, a trend page over nights"),
]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # usage errors exit 2, as bad input does
        self.print_usage(sys.stderr)
        print(f"{self.prog}: error: {message}", file=sys.stderr)
        raise SystemExit(EXIT_BAD_INPUT)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="fsdp-verify", description="Differential testing of sharded data-parallel training.")
    # The installed distribution's version (fsdp_verify.__version__ reads the package metadata).
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, module, help_text in SUBCOMMANDS:
        p = sub.add_parser(name, help=help_text, description=help_text)
        mod = importlib.import_module(module)
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


# Commands that read reports or make environments run on any torch; the others run cases.
RUN_ON_ANY_TORCH = {"report", "gate"}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command not in RUN_ON_ANY_TORCH:
        from fsdp_verify.torch_support import RECORDER, part_off_note, parts_off, unsupported_torch

        why = unsupported_torch()
        if why:
            print(f"fsdp-verify: {why}", file=sys.stderr)
            return EXIT_BAD_INPUT
        for part in parts_off():  # the run goes on without it (the Recorder is the user's script's)
            if part != RECORDER:
                print(f"fsdp-verify: note: {part_off_note(part)}", file=sys.stderr)
    keep_freed_memory()  # the reference's records reuse the last case's pages (verify/sharded/allocator.py)
    with to_stderr(args):  # `--json -`: the JSON alone on standard output (verify/commands/json_out.py)
        return args._run(args)


if __name__ == "__main__":
    raise SystemExit(main())
