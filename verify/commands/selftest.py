"""`fsdp-verify selftest`: proves the toolkit's detection power on the bug zoo (verify/zoo/catalog.py).

For each injected bug, cases are drawn from the bug's pinned strategy (Hypothesis, derandomized:
the same cases every run) and checked against the reference until the bug is caught or the
budget is spent. Prints a matrix: bug, caught or not, by which comparator at which (step, phase,
name), after how many generated examples and seconds, and the caught finding's ratio of deviation
to tolerance. Exit 1 if any bug goes uncaught, or its mutant does not exist (yet).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from fsdp_verify.commands.options import EXIT_BAD_INPUT, EXIT_DIVERGED, EXIT_OK, add_timeout, add_world_sizes


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-examples", type=int, default=20, help="generated cases per bug before giving up (default 20)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the matrix as JSON here")
    p.add_argument("--out", type=Path, metavar="DIR", help="write report.json and report.html (the one report format)")
    p.add_argument("--bugs", nargs="+", metavar="NAME", help="only these zoo bugs (default: all)")
    add_world_sizes(p, None, "only cases of these world sizes (e.g. 2 in CI; default: each bug's own)")
    add_timeout(p)


@dataclass
class BugResult:
    bug: str
    engine: str
    status: str  # "caught" | "uncaught" | "missing" (no such mutant) | "error"
    examples: int = 0
    seconds: float = 0.0
    comparator: str = ""
    phase: str = ""
    step: int = -1
    name: str = ""
    kind: str = ""
    ratio: float | None = None  # the catching finding's deviation / tolerance (inf: no tolerance applies)
    min_failing_ratio: float | None = None  # smallest ratio of any failing deviation record
    expected_catcher: bool = False
    crashes: int = 0  # cases where a rank failed (not counted as caught)
    crash_detail: str = ""  # the first such failure
    detail: str = ""
    case: dict | None = None  # the catching case, to replay with `fsdp-verify check --case`

    @property
    def caught(self) -> bool:
        return self.status == "caught"


class _Caught(BaseException):
    """Stops the Hypothesis loop at the first catching case (BaseException: not a test failure,
    so Hypothesis neither shrinks nor replays it)."""

    def __init__(self, verdict):
        self.verdict = verdict


def hunt(bug, max_examples: int, world_sizes: tuple[int, ...] | None = None, timeout_s: float = 120.0, bar=None):
    """Draw cases for `bug` until one catches it; a BugResult either way."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import HypothesisException

    from fsdp_verify.engines import EngineLoadError, resolve_engine
    from fsdp_verify.runner import check_case
    from fsdp_verify.sharded.pool import RankFailure, get_pool

    result = BugResult(bug.name, bug.engine, "uncaught")
    try:
        resolve_engine(bug.engine)
    except EngineLoadError as e:
        result.status, result.detail = "missing", str(e)
        return result
    try:
        strategy = bug.strategy(world_sizes)
    except (ValueError, ImportError) as e:
        result.status, result.detail = "error", str(e)
        return result

    t0 = time.perf_counter()

    @settings(
        derandomize=True,
        database=None,
        max_examples=max_examples,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
        print_blob=False,
    )
    @given(strategy)
    def search(case) -> None:
        result.examples += 1
        if bar is not None:
            bar.update(1)
        try:
            verdict = check_case(case, pool=get_pool(case.world_size, timeout_s), timeout_s=timeout_s)
        except RankFailure as e:
            result.crashes += 1
            result.crash_detail = result.crash_detail or f"case {case.to_json()}: {e}"
            return
        if not verdict.ok:
            raise _Caught(verdict)

    try:
        search()
    except _Caught as caught:
        _fill(result, bug, caught.verdict)
    except HypothesisException as e:
        result.status, result.detail = "error", f"{type(e).__name__}: {e}"
    result.seconds = time.perf_counter() - t0
    return result


def _fill(result: BugResult, bug, verdict) -> None:
    first = verdict.first_divergence
    failing = [f.ratio for f in verdict.failures if f.kind == "deviation"]
    result.status = "caught"
    result.comparator, result.phase, result.step, result.name, result.kind = (
        first.comparator,
        first.phase,
        first.step,
        first.name,
        first.kind,
    )
    result.ratio = first.ratio
    result.min_failing_ratio = min(failing) if failing else None
    result.expected_catcher = first.phase in bug.catchers or first.comparator in bug.catchers
    result.case = verdict.case.to_dict()
    result.detail = verdict.summary()


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    return "inf" if math.isinf(r) else f"{r:.3g}"


def matrix(results: list[BugResult]) -> str:
    rows = [["bug", "caught", "by (comparator @ step/phase)", "examples", "seconds", "ratio", "min failing ratio"]]
    for r in results:
        if r.caught:
            by = f"{r.comparator} @ {r.step}/{r.phase}" + ("" if r.expected_catcher else " (unexpected)")
        else:
            by = r.detail.splitlines()[0][:60] if r.detail else "-"
        rows.append(
            [
                r.bug,
                {"caught": "yes", "uncaught": "NO", "missing": "MISSING", "error": "ERROR"}[r.status],
                by,
                str(r.examples),
                f"{r.seconds:.1f}",
                _fmt_ratio(r.ratio),
                _fmt_ratio(r.min_failing_ratio),
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_zoo(
    names: list[str] | None = None,
    max_examples: int = 20,
    world_sizes: tuple[int, ...] | None = None,
    timeout_s: float = 120.0,
    progress: bool = True,
) -> list[BugResult]:
    from tqdm import tqdm

    from fsdp_verify.zoo.catalog import BY_NAME, ZOO

    bugs = [BY_NAME[n] for n in names] if names else ZOO
    off = {bug.name: bug.off_here() for bug in bugs}  # a part this torch lacks: said, not hunted
    for name, why in off.items():
        if why:
            print(f"fsdp-verify: note: {name} left out: {why}", file=sys.stderr)
    bugs = [bug for bug in bugs if not off[bug.name]]
    results = []
    for bug in bugs:
        with tqdm(total=max_examples, desc=bug.name, file=sys.stderr, leave=False, disable=not progress) as bar:
            results.append(hunt(bug, max_examples, world_sizes, timeout_s, bar))
    return results


def run(args: argparse.Namespace) -> int:
    from fsdp_verify.zoo.catalog import BY_NAME

    unknown = [n for n in args.bugs or [] if n not in BY_NAME]
    if unknown:
        print(f"fsdp-verify: --bugs: no zoo bug {unknown[0]!r}; expected one of {sorted(BY_NAME)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.max_examples < 1:
        print(f"fsdp-verify: --max-examples: expected a positive integer, got {args.max_examples}", file=sys.stderr)
        return EXIT_BAD_INPUT
    world_sizes = tuple(args.world_sizes) if args.world_sizes else None
    from fsdp_verify.library_warnings import Tally, collecting

    warned = Tally()  # the mutants' ranks' library warnings: in the report, one line here
    with collecting(warned):
        results = run_zoo(args.bugs, args.max_examples, world_sizes, args.timeout, progress=sys.stderr.isatty())
    print(matrix(results))
    caught = [r for r in results if r.caught]
    finite = [r.ratio for r in caught if r.ratio is not None and not math.isinf(r.ratio)]
    print(
        f"\n{len(caught)}/{len(results)} bugs caught"
        + (f"; smallest ratio on a catching finding: {min(finite):.3g}" if finite else "")
        + (f"; caught within {max(r.examples for r in caught)} examples at most." if caught else ".")
    )
    for r in results:
        if not r.caught:
            print(f"{r.status.upper()}: {r.bug} ({r.engine}): {r.detail or 'not caught'}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([_jsonable(asdict(r)) for r in results], indent=2) + "\n")
    if args.out:
        from fsdp_verify.reports.report import finish, write, zoo_rows

        zoo = zoo_rows(_jsonable(asdict(r)) for r in results)
        failures = [
            {"case_hash": "-", "summary": f"{r.bug}: {r.status}: {r.detail or 'not caught'}", "first_divergence": None}
            for r in results
            if not r.caught
        ]
        report = finish(
            "selftest",
            [],
            seconds=sum(r.seconds for r in results),
            engine=None,
            zoo=zoo,
            ok=len(caught) == len(results),
            failures=failures,
            max_examples=args.max_examples,
            warnings=warned.entries(),
        )
        report["counts"] = {"cases": len(results), "passed": len(caught), "failed": len(results) - len(caught)}
        write(report, args.out)
    said = warned.line(str(args.out / "report.json") if args.out else None)
    if said:
        print(said)
    return EXIT_OK if len(caught) == len(results) else EXIT_DIVERGED


def _jsonable(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, float) and not math.isfinite(v) else v) for k, v in d.items()}
