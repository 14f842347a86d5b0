"""Nightly-sized sweep: N generated cases on the correct FSDP2 engine (fp32 and bf16 policies,
world sizes 1-4, MLP and Transformer) must give zero false alarms. Reports the count, the time,
every false alarm (its case JSON and verdict written to --out), and the distribution of the worst
ratio of deviation to tolerance per case (`Verdict.worst()`): how close a correct engine comes
to its tolerances. With `--zoo PATH` (a `fsdp-verify selftest --json` file) it prints the
smallest ratio on a caught bug next to it.

    python bench/sweep.py --cases 1000 --out sweep-out [--seed 0] [--zoo zoo.json]

Exit 0 if no false alarm, 1 otherwise (a rank failure counts as an alarm too). The passing case
that came closest to its tolerance is kept as OUT/closest_pass.case.json. Each case's row is
appended to OUT/rows.jsonl as soon as it finishes, so a sweep cut short (a nightly job's time
limit) keeps what it measured; `--report-from OUT/rows.jsonl` prints the report of such a run.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed

from fsdp_verify.properties.strategies import cases
from fsdp_verify.runner import check_case
from fsdp_verify.sharded.pool import RankFailure, get_pool


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", type=int, default=100, help="generated cases (default 100; nightly: 1000+)")
    p.add_argument("--seed", type=int, default=0, help="Hypothesis seed: the same seed draws the same cases")
    p.add_argument("--engine", default="fsdp2", help="engine under test (default: the correct FSDP2)")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 3, 4])
    p.add_argument("--precisions", nargs="+", default=["fp32", "bf16"])
    p.add_argument("--out", type=Path, default=Path("sweep-out"), help="directory for the report and false alarms")
    p.add_argument("--zoo", type=Path, help="a `fsdp-verify selftest --json` file to compare ratios with")
    p.add_argument("--timeout", type=float, default=120.0)
    p.add_argument("--report-from", type=Path, help="report on the rows.jsonl of an earlier (maybe cut-short) sweep")
    p.add_argument("--model", help="a user's model factory pkg.module:NAME instead of the built-in MLP and Transformer")
    p.add_argument("--model-kwargs", default="{}", help="its keyword arguments, a JSON object")
    return p.parse_args(argv)


def sweep(args: argparse.Namespace) -> dict:
    rows: list[dict] = []
    alarms_dir = args.out / "false_alarms"
    stream = (args.out / "rows.jsonl").open("w")
    closest_ratio = 0.0  # the highest worst ratio of a passing case so far
    t0 = time.perf_counter()
    custom = None
    if args.model:
        from fsdp_verify.models import ModelSpec

        custom = ModelSpec(kind="custom", factory=args.model, kwargs=json.loads(args.model_kwargs))

    @hypothesis_seed(args.seed)
    @settings(
        max_examples=args.cases,
        database=None,
        deadline=None,
        phases=(Phase.generate,),
        suppress_health_check=list(HealthCheck),
    )
    @given(
        cases(
            engine=args.engine,
            world_sizes=tuple(args.world_sizes),
            precisions=tuple(args.precisions),
            custom_model=custom,
        )
    )
    def one(case) -> None:
        nonlocal closest_ratio
        row = {
            "case": case.hash,
            "world_size": case.world_size,
            "model": case.model.factory or case.model.kind,
            "precision": case.precision.param_dtype or "fp32",
        }
        start = time.perf_counter()
        try:
            verdict = check_case(case, pool=get_pool(case.world_size, args.timeout), timeout_s=args.timeout)
        except RankFailure as e:
            row.update(ok=False, alarm="rank failure", detail=str(e).splitlines()[0])
            _save(alarms_dir, case, {"rank_failure": str(e)})
        else:
            worst = verdict.worst()
            row.update(
                ok=verdict.ok,
                calibrated=verdict.calibrated,
                worst_ratio=worst.ratio if worst else 0.0,
                worst_at=list(worst.key) if worst else None,
                worst_mode=worst.mode if worst else "",
                # How many records were held to each tolerance mode, and how many matched bit for bit.
                modes=dict(Counter(f.mode for f in verdict.findings if f.kind == "deviation")),
                bit_exact=sum(1 for f in verdict.findings if f.kind == "deviation" and f.normwise == 0),
            )
            if not verdict.ok:
                row.update(alarm="divergence", detail=verdict.summary())
                _save(alarms_dir, case, verdict.to_dict())
            elif row["worst_ratio"] > closest_ratio:  # the near miss, kept to replay
                closest_ratio = row["worst_ratio"]
                case.save(args.out / "closest_pass.case.json")
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        stream.write(json.dumps(row) + "\n")
        stream.flush()
        print(_progress(len(rows), args.cases, row), file=sys.stderr, flush=True)

    with stream:
        one()
    return {"seconds": time.perf_counter() - t0, "rows": rows}


def load_rows(path: Path) -> dict:
    """The result of a sweep from its rows.jsonl; the time is the sum of the cases' times."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return {"seconds": sum(r["seconds"] for r in rows), "rows": rows}


def _save(directory: Path, case, verdict: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    case.save(directory / f"{case.hash}.case.json")
    (directory / f"{case.hash}.verdict.json").write_text(json.dumps(verdict, indent=2, default=str) + "\n")


def _progress(i: int, n: int, row: dict) -> str:
    what = "ok" if row["ok"] else f"ALARM ({row['alarm']})"
    ratio = row.get("worst_ratio")
    return f"[{i}/{n}] {row['case']} ws={row['world_size']} {row['model']} {row['precision']}: {what}" + (
        f", worst ratio {ratio:.3g}" if ratio is not None else ""
    )


def report(result: dict, zoo: Path | None) -> str:
    rows = result["rows"]
    alarms = [r for r in rows if not r["ok"]]
    ratios = sorted(r["worst_ratio"] for r in rows if "worst_ratio" in r and r["ok"])
    lines = [
        f"{len(rows)} cases in {result['seconds']:.0f} s ({result['seconds'] / max(len(rows), 1):.2f} s/case)",
        "by world size: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["world_size"] for r in rows).items())),
        "by precision: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["precision"] for r in rows).items())),
        "by model: " + ", ".join(f"{k}: {v}" for k, v in sorted(Counter(r["model"] for r in rows).items())),
        f"calibrated: {sum(1 for r in rows if r.get('calibrated'))} cases",
        f"false alarms: {len(alarms)}"
        + "".join(f"\n  {r['case']} ({r['alarm']}): {r.get('detail', '')[:300]}" for r in alarms),
    ]
    if ratios:
        q = statistics.quantiles(ratios, n=100, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 99
        worst = max((r for r in rows if r["ok"] and "worst_ratio" in r), key=lambda r: r["worst_ratio"])
        lines += [
            "worst deviation/tolerance per passing case: "
            f"median {q[49]:.3g}, p90 {q[89]:.3g}, p99 {q[98]:.3g}, max {ratios[-1]:.3g}",
            f"  the max at case {worst['case']} (ws {worst['world_size']}, {worst['precision']}, {worst['model']}),"
            f" {worst['worst_at']}, {worst['worst_mode']} tolerance",
            "  worst held to: "
            + ", ".join(f"{k}: {v}" for k, v in Counter(r["worst_mode"] for r in rows if r["ok"]).items()),
        ]
    if zoo is not None and zoo.exists():
        caught = [r for r in json.loads(zoo.read_text()) if r["status"] == "caught"]
        finite = [
            (float(r["ratio"]), r["bug"]) for r in caught if r["ratio"] is not None and math.isfinite(float(r["ratio"]))
        ]
        if finite:
            smallest, bug = min(finite)
            lines.append(
                f"side by side: worst ratio on the correct engine {ratios[-1] if ratios else 0:.3g}"
                f" vs smallest ratio on a caught bug {smallest:.3g} ({bug})"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_from is not None:
        result = load_rows(args.report_from)
        print(report(result, args.zoo))
        return 0 if all(r["ok"] for r in result["rows"]) else 1
    args.out.mkdir(parents=True, exist_ok=True)
    result = sweep(args)
    text = report(result, args.zoo)
    (args.out / "sweep.json").write_text(json.dumps(result, indent=2, default=str) + "\n")
    (args.out / "sweep.txt").write_text(text + "\n")
    print(text)
    return 0 if all(r["ok"] for r in result["rows"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
