"""`fsdp-verify fuzz`: the property search outside pytest, for nightly jobs and for people who
don't live in pytest. Generates Cases with Hypothesis, checks a named property on each, and on a
failure saves that first failing Case into --out at once (first-failure-HASH.json) and says so,
then shrinks it (for at most --shrink-seconds), writes the shrunk Case file into --out and exits 1
(0 when all pass). Always writes report.json and report.html into --out. Every run has a seed
(drawn when --seed is not given), printed first and recorded in the report, so the run can be
repeated; Ctrl-C writes the report of the cases run so far and exits 130. A failure is a failure
(a false alarm only where the engine is known correct: built in, or --engine-is-correct); the
ranks' library warnings go to the report, each once with its count, and one terminal line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fsdp_verify.commands.options import (
    ENGINE_HELP,
    EXIT_BAD_INPUT,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    add_draw_arguments,
    add_engine_is_correct,
    add_timeout,
    engine_name,
    strategy_from_args,
)
from fsdp_verify.library_warnings import Tally, collecting


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", type=engine_name, default=None, help=ENGINE_HELP + " (default: fsdp2, or --framework's)")
    add_engine_is_correct(p)
    p.add_argument("--max-examples", type=int, default=None, help="cases to generate (default: the profile's)")
    add_draw_arguments(p)
    p.add_argument(
        "--hsdp", action="store_true", help="also draw HSDP meshes (replicate, shard) where the world size allows"
    )
    p.add_argument("--property", default="sharded-equals-reference", help="named property (default %(default)s)")
    p.add_argument(
        "--profile",
        choices=("ci", "nightly", "dev"),
        default=None,
        help="Hypothesis profile (default: ci if the CI variable is set, else dev)",
    )
    p.add_argument(
        "--seed",
        type=int,
        default=None,
        help="Hypothesis seed, to rerun one search exactly (no example database then); default: drawn"
        " (0 under the ci profile) and printed",
    )
    p.add_argument(
        "--shrink-seconds",
        type=float,
        default=None,
        metavar="S",
        help="stop shrinking S seconds after the first failure, reporting the smallest failing case found"
        " by then (default: the profile's: ci 60, dev 120, nightly 900)",
    )
    add_timeout(p)
    p.add_argument(
        "--out",
        type=Path,
        required=True,
        help="directory for the report, the first failing Case file (written at once) and the shrunk one",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.commands.interrupt import noticing_interrupts, raise_if_interrupted
    from fsdp_verify.engines import EngineLoadError
    from fsdp_verify.properties.pins import PinError
    from fsdp_verify.properties.properties import PROPERTIES
    from fsdp_verify.properties.search import SearchInterrupted, fresh_seed, search
    from fsdp_verify.sharded.pool import get_pool
    from fsdp_verify.validation import CaseError

    if args.property not in PROPERTIES:
        return _bad(f"--property: expected one of {sorted(PROPERTIES)}, got {args.property!r}")
    if args.max_examples is not None and args.max_examples < 1:
        return _bad(f"--max-examples: expected a positive integer, got {args.max_examples}")
    if args.shrink_seconds is not None and not args.shrink_seconds >= 0:
        return _bad(f"--shrink-seconds: expected a number of seconds >= 0, got {args.shrink_seconds}")
    try:
        strategy = strategy_from_args(args, hsdp=args.hsdp)
    except (EngineLoadError, PinError, CaseError, OSError) as e:
        return _bad(str(e))

    prop = PROPERTIES[args.property]
    seed = args.seed if args.seed is not None else fresh_seed(args.profile)
    print(f"seed {seed}: repeat with --seed {seed}", flush=True)
    bar = _progress(args)
    failures_seen = 0

    def check(case):
        return prop(case, pool=get_pool(case.world_size, args.timeout), timeout_s=args.timeout)

    def on_example(example) -> None:
        nonlocal failures_seen
        failures_seen += not example.ok
        if bar is not None:
            bar.update(1)
            bar.set_postfix_str(f"shrinking ({failures_seen} failing)" if failures_seen else "all passed so far")
        raise_if_interrupted()  # a Ctrl-C swallowed in a gc callback during the case (verify/commands/interrupt.py)

    def on_first_failure(failure, seconds: float) -> None:
        say = bar.write if bar is not None else print
        for line in first_failure_lines(failure, seconds, args):
            say(line)
        sys.stdout.flush()

    warned = Tally()  # the ranks' and this process's library warnings (verify/library_warnings.py)
    try:
        with collecting(warned), noticing_interrupts():
            result = search(
                check,
                strategy,
                profile=args.profile,
                max_examples=args.max_examples,
                seed=seed,
                replay=args.seed is not None,
                on_example=on_example,
                on_first_failure=on_first_failure,
                shrink_seconds=args.shrink_seconds,
            )
    except SearchInterrupted as stop:  # Ctrl-C: the report of the cases that ran
        result = stop.result
    if bar is not None:
        bar.close()
    if result.interrupted:
        from fsdp_verify.commands.interrupt import finishing_after_interrupt

        with finishing_after_interrupt():
            _finish(args, result, warned)
        return EXIT_INTERRUPTED
    return _finish(args, result, warned)


def first_failure_lines(failure, seconds: float, args: argparse.Namespace) -> list[str]:
    """The first failure, said and saved the moment it is seen: a run stopped while it shrinks
    (Ctrl-C, a CI timeout) keeps it."""
    from fsdp_verify.properties.fail_fast import first_failure_file
    from fsdp_verify.properties.profiles import default_profile, shrink_seconds
    from fsdp_verify.repro.files import replay_command

    path = first_failure_file(failure, args.out)
    profile = args.profile or default_profile()
    budget = args.shrink_seconds if args.shrink_seconds is not None else shrink_seconds(profile)
    limit = f"at most {budget:g} s" if budget is not None else "without a time limit"
    return [
        f"First failure, {seconds:.1f} s in: {failure.first_divergence} (case {failure.case.hash})",
        f"  saved: {path}",
        f"  replay: {replay_command(path)}",
        f"  shrinking it, {limit} (--shrink-seconds; profile {profile}); Ctrl-C keeps this case",
    ]


def _finish(args: argparse.Namespace, result, warned: Tally) -> int:
    """Write the report and say what ran; the exit code (of a run that was not interrupted)."""
    from fsdp_verify.commands.case_flags import draw_flag_texts
    from fsdp_verify.commands.options import correct_engine_note, engine_correct
    from fsdp_verify.reports.report import loss_scale_line, loss_scale_tally
    from fsdp_verify.reports.search_report import closest_pass, write_report
    from fsdp_verify.repro.files import replay_command

    if result.failure is not None:
        result.failure.write_repro(args.out)
    meta = {
        "engine": args.engine,
        "property": args.property,
        "profile": args.profile,
        "max_examples": args.max_examples,
        "world_sizes": args.world_sizes,
        "precisions": args.precisions,
        "hsdp": args.hsdp,
        "models": [args.model] if args.model else args.models,
        "seed": result.seed,
        "interrupted": result.interrupted,
        "engine_correct": engine_correct(args.engine, args.engine_is_correct),
        "warnings": warned.entries(),
        **({"flags": flags} if (flags := draw_flag_texts(args)) else {}),
    }
    json_path, html_path = write_report(result, args.out, meta)
    passed = sum(e.ok for e in result.examples)
    stopped = "Interrupted (Ctrl-C): " if result.interrupted else ""
    print(
        f"{stopped}{len(result.examples)} cases run, {passed} passed, in {result.seconds:.1f} s (seed {result.seed})."
        f" Report: {html_path}"
    )
    tallies = [
        loss_scale_tally(e.verdict.loss_scales)
        for e in result.examples
        if getattr(e, "verdict", None) and e.verdict.loss_scales
    ]
    if tallies:
        print(loss_scale_line(tallies))
    if warned.line():
        print(warned.line())
    near = closest_pass(result.examples)
    if near is not None:
        path = near.case.save(Path(args.out) / f"closest-pass-{near.case.hash}.json")
        worst = near.verdict.worst()
        print(f"Closest pass: {worst.ratio:.3g}x its tolerance at step {worst.step}, {worst.phase}, {worst.name!r};")
        print(f"  replay: {replay_command(path)}")
    if result.interrupted:
        print(f"The same cases again, to the end: --seed {result.seed}")
    if result.failure is None:
        return EXIT_OK
    if result.shrink_note:
        print(f"Note: {result.shrink_note}.")
    f = result.failure
    print(f.summary())
    print(f"First divergence: {f.first_divergence}")
    print(f"Shrunk case written to {f.repro_path}")
    print(f"Replay: {replay_command(f.repro_path)}")
    note = correct_engine_note(args.engine, meta["engine_correct"])
    if note:
        print(note)
    _zoom_shrunk(args, f)
    return EXIT_DIVERGED


def _zoom_shrunk(args: argparse.Namespace, failure) -> None:
    """The shrunk case's diverging step zoomed into (docs/zoom.md): the module and the op."""
    verdict = getattr(failure, "verdict", None)
    if verdict is None or verdict.ok or verdict.case.step is not None or getattr(args, "no_zoom", False):
        return
    from fsdp_verify.commands.zoom import zoom_and_print
    from fsdp_verify.sharded.pool import RankFailure
    from fsdp_verify.validation import CaseError

    try:
        zoom_and_print(verdict, Path(args.out) if getattr(args, "out", None) else None, getattr(args, "timeout", None))
    except CaseError as e:  # a case a zoom is not modelled beside (verify/dims/together.py): said so
        print(f"No zoom: {e}")
    except RankFailure as e:  # the zoom is extra: the shrunk case stands without it
        print(f"Zoom failed: {e}")


def _progress(args: argparse.Namespace):
    if args.no_progress:
        return None
    from tqdm import tqdm

    return tqdm(total=args.max_examples, desc="fuzz", unit="case", file=sys.stderr, dynamic_ncols=True)


def _bad(message: str) -> int:
    print(f"fsdp-verify: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT
