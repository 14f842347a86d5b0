"""`fsdp-verify compare RUN_REF RUN_SHARDED`: two runs recorded by `fsdp_verify.recorder.Recorder`
(a user's single-GPU script and its sharded twin) compared step by step: the data check, then
every record held to a derived tolerance (verify/recorder/rules.py); the first divergence printed,
report.json and report.html written. A sharded run that is not (parameters plain on every rank,
replicas parting between ranks: verify/recorder/sharding.py) is NOT SHARDED, never EQUIVALENT.
Exit 0 equivalent, 1 divergence or not sharded, 2 bad input (the message names the run and the
field)."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from fsdp_verify.commands.options import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("reference", type=Path, metavar="RUN_REF", help="the run of the trusted single-process script")
    p.add_argument("sharded", type=Path, metavar="RUN_SHARDED", help="the run of its sharded twin")
    p.add_argument(
        "--calibration",
        type=Path,
        metavar="RUN",
        help="the reference script rerun with FSDP_VERIFY_PERTURB=1: judges the records after the first optimizer step",
    )
    p.add_argument(
        "--out", type=Path, metavar="DIR", default=Path("compare-report"), help="report.json and report.html"
    )


def run(args: argparse.Namespace) -> int:
    from safetensors import SafetensorError
    from tqdm import tqdm

    from fsdp_verify.recorder import text
    from fsdp_verify.recorder.judge import compare_runs
    from fsdp_verify.recorder.store import RunError
    from fsdp_verify.reports.compare_report import build, write

    start = time.perf_counter()
    bar = tqdm(desc="compare", unit="step", disable=None, file=sys.stderr)
    try:
        result = compare_runs(args.reference, args.sharded, args.calibration, progress=lambda _: bar.update())
    except (RunError, SafetensorError, OSError) as e:
        print(f"fsdp-verify compare: bad input: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    finally:
        bar.close()
    summary = text.summary(result)
    table, rules = text.table(result), text.rules(result)
    print(table)
    print()
    print("rules:")
    print(rules)
    for note in result.notes:
        print(f"note: {note}")
    print()
    print(summary)
    argv = ["fsdp-verify", "compare", str(args.reference), str(args.sharded)]
    if args.calibration:
        argv += ["--calibration", str(args.calibration)]
    report = build(result, time.perf_counter() - start, summary, argv)
    json_path, _ = write(report, args.out, table, rules)
    print(f"wrote {json_path} and {json_path.with_name('report.html')}")
    return EXIT_OK if result.ok else EXIT_DIVERGED
