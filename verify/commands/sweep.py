"""`fsdp-verify sweep`: the nightly sweep. Draws --cases generated cases for --seed, runs those of
its --shard on --engine, and streams one row per case to OUT/rows.jsonl as it finishes (a runner
that dies loses nothing; rerun the same command and it resumes, skipping cases whose rows are
there). Writes OUT/report.json and report.html (the one report format), every failing case and its
verdict under OUT/failures/, and the passing case nearest its tolerance as
OUT/closest_pass.case.json. A failure is a failure: a false alarm only where the engine is known
correct (built in, or --engine-is-correct) and reading it shows the toolkit's model at fault. The
ranks' library warnings go to the report, each once with its count, and one terminal line. Exit 0
every case passed, 1 a failure (a rank failure counts), 2 bad input, 130 Ctrl-C (after writing the
report of the rows so far, marked interrupted; rerun to resume)."""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from contextlib import nullcontext
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
    engine_correct,
    engine_name,
    strategy_from_args,
)
from fsdp_verify.library_warnings import Tally, collecting, warnings_line


def shard_spec(text: str) -> tuple[int, int]:
    """`I/N` with 1 <= I <= N."""
    head, sep, tail = text.partition("/")
    try:
        i, n = int(head), int(tail)
    except ValueError:
        i = n = 0
    if not sep or n < 1 or not 1 <= i <= n:
        raise argparse.ArgumentTypeError(f"expected I/N with 1 <= I <= N (e.g. 1/4), got {text!r}")
    return i, n


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--cases", type=int, default=100, help="cases drawn for the whole sweep (default 100; nightly 1000+)"
    )
    p.add_argument("--seed", type=int, default=0, help="the draw's seed: the same seed draws the same cases")
    p.add_argument("--engine", type=engine_name, default=None, help=ENGINE_HELP + " (default: fsdp2, or --framework's)")
    add_engine_is_correct(p)
    p.add_argument("--shard", type=shard_spec, default=(1, 1), metavar="I/N", help="run case k iff k %% N == I-1")
    add_draw_arguments(p)
    p.add_argument(
        "--hsdp",
        action="store_true",
        help="also draw 2-D meshes (replicate, shard), every factoring of the world size: (1, W), (W, 1) and"
        " (1, 1) too, for an engine that takes them",
    )
    p.add_argument("--out", type=Path, required=True, help="directory for rows.jsonl, the report and the failing cases")
    p.add_argument(
        "--zoo", type=Path, help="a `selftest --json` file or selftest report.json to show beside the ratios"
    )
    add_timeout(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _bad(message: str) -> int:
    print(f"fsdp-verify: {message}", file=sys.stderr)
    return EXIT_BAD_INPUT


def read_rows(path: Path) -> list[dict]:
    """Rows streamed so far; a last line cut off mid-write (the runner died) is dropped."""
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def load_zoo(path: Path) -> list[dict]:
    from fsdp_verify.reports.report import zoo_rows
    from fsdp_verify.reports.schema import ReportError, load

    data = json.loads(path.read_text())
    if isinstance(data, list):
        return zoo_rows(data)
    if isinstance(data, dict) and data.get("zoo") is not None:
        return load(path)["zoo"]
    raise ReportError(f"--zoo {path}: expected a `selftest --json` list or a report.json with a zoo")


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.commands.interrupt import finishing_after_interrupt, noticing_interrupts
    from fsdp_verify.engines import EngineLoadError
    from fsdp_verify.properties.draw import draw_cases, in_shard
    from fsdp_verify.properties.pins import PinError
    from fsdp_verify.reports.schema import ReportError
    from fsdp_verify.validation import CaseError

    if args.cases < 1:
        return _bad(f"--cases: expected a positive integer, got {args.cases}")
    try:
        zoo = load_zoo(args.zoo) if args.zoo else None
    except (OSError, json.JSONDecodeError, ReportError, KeyError) as e:
        return _bad(f"--zoo: {e}")
    try:
        strategy = strategy_from_args(args, hsdp=args.hsdp)
    except (EngineLoadError, PinError, CaseError, OSError) as e:
        return _bad(str(e))
    drawn = draw_cases(strategy, args.cases, args.seed)
    mine = [(k, c) for k, c in enumerate(drawn) if in_shard(k, args.shard)]
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    rows_path = out / "rows.jsonl"
    done = {r["index"]: r for r in read_rows(rows_path)}
    for k, row in done.items():
        if k >= len(drawn) or drawn[k].hash != row["case_hash"]:
            return _bad(
                f"--out {out}: rows.jsonl holds case {k} = {row['case_hash']}, which this sweep's draw does not"
                " (another --seed, --engine or draw option): use a fresh --out"
            )
    interrupted = False
    warned = Tally()  # the ranks' and this process's library warnings (verify/library_warnings.py)
    try:
        with collecting(warned), noticing_interrupts():
            rows, elapsed = _sweep(args, mine, done, rows_path)
    except KeyboardInterrupt:  # Ctrl-C: the report of the rows streamed so far (the case running is lost)
        interrupted = True
        ours = {k for k, _ in mine}
        rows = list({r["index"]: r for r in read_rows(rows_path) if r["index"] in ours}.values())
        elapsed = sum(r["seconds"] for r in rows)
    with finishing_after_interrupt() if interrupted else nullcontext():
        return _report(args, rows, elapsed, zoo, interrupted, warned)


def _report(args, rows: list[dict], elapsed: float, zoo, interrupted: bool, warned) -> int:
    from fsdp_verify.commands.case_flags import draw_flag_texts
    from fsdp_verify.reports.report import finish, write

    shard = f"{args.shard[0]}/{args.shard[1]}"
    report = finish(
        "sweep",
        sorted(rows, key=lambda r: r["index"]),
        seconds=elapsed,
        engine=args.engine,
        seed=args.seed,
        shard=shard,
        zoo=zoo,
        planned_cases=args.cases,
        draw={
            "world_sizes": args.world_sizes,
            "precisions": args.precisions,
            "models": [args.model] if args.model else args.models,
            "hsdp": args.hsdp,
            "pins": args.pin,
            **({"flags": flags} if (flags := draw_flag_texts(args)) else {}),
        },
        interrupted=interrupted,
        engine_correct=engine_correct(args.engine, args.engine_is_correct),
        warnings=warned.entries(),
    )
    _, html_path = write(report, args.out)
    print(summary(report))
    print(f"Report: {html_path}")
    if interrupted:
        return EXIT_INTERRUPTED
    return EXIT_OK if report["ok"] else EXIT_DIVERGED


def _sweep(args, mine, done: dict, rows_path: Path) -> tuple[list[dict], float]:
    """Run the shard's cases not yet in rows.jsonl; the rows of all of them, and the case time."""
    from tqdm import tqdm

    from fsdp_verify.commands.interrupt import raise_if_interrupted
    from fsdp_verify.reports.report import case_row
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure, get_pool

    failed = args.out / "failures"
    rows = [done[k] for k, _ in mine if k in done]
    closest = max((r["worst_ratio"] for r in rows if r["ok"] and isinstance(r["worst_ratio"], float)), default=0.0)
    todo = [(k, c) for k, c in mine if k not in done]
    bar = tqdm(
        total=len(mine),
        initial=len(mine) - len(todo),
        desc=f"sweep {args.shard[0]}/{args.shard[1]}",
        unit="case",
        file=sys.stderr,
        dynamic_ncols=True,
        disable=args.no_progress,
    )
    with rows_path.open("a") as stream, bar:
        for k, case in todo:
            start = time.perf_counter()
            try:
                verdict = check_case(case, pool=get_pool(case.world_size, args.timeout), timeout_s=args.timeout)
            except RankFailure as e:
                row = case_row(case, None, time.perf_counter() - start, index=k, error=str(e))
                row["replay"] = _save(failed, case, {"rank_failure": str(e)})
            except Exception as e:  # this process's (the reference, the checks): the case fails, the sweep goes on
                error = f"this process raised {type(e).__name__}: {e}"
                failed_in = "failure in this process (the reference or the checks)"
                row = case_row(case, None, time.perf_counter() - start, index=k, error=error, failed_in=failed_in)
                row["replay"] = _save(failed, case, {"error": error, "traceback": traceback.format_exc()})
            else:
                row = case_row(case, verdict, time.perf_counter() - start, index=k)
                if not verdict.ok:
                    row["replay"] = _save(failed, case, verdict.to_dict())
                elif isinstance(row["worst_ratio"], float) and row["worst_ratio"] > closest:
                    closest = row["worst_ratio"]  # the near miss, kept to replay
                    case.save(args.out / "closest_pass.case.json")
            rows.append(row)
            stream.write(json.dumps(row) + "\n")
            stream.flush()
            bar.update(1)
            bar.set_postfix_str(
                "all passed" if all(r["ok"] for r in rows) else f"{sum(not r['ok'] for r in rows)} FAILED"
            )
            raise_if_interrupted()  # a Ctrl-C swallowed in a gc callback during the case (verify/commands/interrupt.py)
    return rows, sum(r["seconds"] for r in rows)


def _save(directory: Path, case, verdict: dict) -> str:
    """A failing case and its verdict under OUT/failures/; the command that replays the case."""
    from fsdp_verify.repro.files import replay_command

    directory.mkdir(parents=True, exist_ok=True)
    path = case.save(directory / f"{case.hash}.case.json")
    (directory / f"{case.hash}.verdict.json").write_text(json.dumps(verdict, indent=2, default=str) + "\n")
    return replay_command(path)


def summary(report: dict) -> str:
    """The terminal text of a sweep report (also of a merged one)."""
    from collections import Counter

    from fsdp_verify.commands.options import correct_engine_note
    from fsdp_verify.reports.causes import causes_of
    from fsdp_verify.reports.causes import text as causes_text
    from fsdp_verify.reports.schema import as_float

    rows = report["cases"]
    n = len(rows)
    failed = [r for r in rows if not r["ok"]]
    causes = causes_of(report)
    ratios = sorted(as_float(r["worst_ratio"]) for r in rows if r["ok"] and r["worst_ratio"] is not None)
    shard = f" (shard {report['shard']})" if report.get("shard") and report["shard"] != "1/1" else ""
    lines = [
        f"{n} cases{shard} in {report['seconds']:.0f} s of case time ({report['seconds'] / max(n, 1):.2f} s/case)",
        "by world size: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["world_size"] for r in rows).items())),
        "by precision: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["precision"] for r in rows).items())),
        f"failures: {len(failed)}" + (f" ({_causes_count(causes)})\n{causes_text(causes, rows)}" if failed else ""),
    ]
    note = correct_engine_note(report["engine"], report.get("engine_correct")) if failed else None
    if note:
        lines.append(note)
    if report.get("interrupted"):
        lines.insert(0, f"INTERRUPTED (Ctrl-C) after {n} cases{shard}: the same command resumes where their rows end")
    from fsdp_verify.reports.report import loss_scale_line

    scaled = loss_scale_line([r["loss_scale"] for r in rows if r.get("loss_scale")])
    if scaled:
        lines.append(scaled)
    if ratios:
        from fsdp_verify.reports.report import p99

        lines.append(
            f"worst deviation/tolerance per passing case: median {ratios[len(ratios) // 2]:.3g},"
            f" p99 {p99(ratios):.3g}, max {ratios[-1]:.3g}"
        )
    finite = [as_float(z["ratio"]) for z in report["zoo"] or [] if z["caught"] and z["ratio"] not in (None, "inf")]
    if finite:
        lines.append(
            f"side by side: worst ratio on the correct engine {ratios[-1] if ratios else 0:.3g}"
            f" vs smallest ratio on a caught bug {min(finite):.3g}"
        )
    said = warnings_line(report.get("warnings"))
    if said:
        lines.append(said)
    return "\n".join(lines)


def _causes_count(causes: list[dict]) -> str:
    return f"{len(causes)} cause{'' if len(causes) == 1 else 's'}"
