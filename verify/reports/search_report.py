"""The report of a property search (`fuzz`): the one report format (report.py) with the search's
own fields beside it: the shrunk failure with the command that replays it, counts by precision,
world size and model, and the passing case that came closest to its tolerance."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_verify.properties.search import SearchResult
from fsdp_verify.reports.plots import histogram, svg_histogram  # noqa: F401  (re-exported: the fuzz tests use them)
from fsdp_verify.reports.report import case_row as report_row
from fsdp_verify.reports.report import finish, write
from fsdp_verify.repro.files import replay_command


def case_row(example) -> dict[str, Any]:
    """One generated case in the report's shape; a failing one carries its whole Case (a flaky
    failure may not shrink to itself, and the first one seen is often the clearest)."""
    error = None
    if example.verdict is None:
        error = example.failure.summary() if example.failure is not None else "rank failure"
    row = report_row(example.case, example.verdict, example.seconds, error=error)
    if not example.ok:
        row["ok"], row["status"] = False, "fail" if error is None else "error"
        row["summary"] = example.failure.summary() if example.failure is not None else row["summary"]
    row["case"] = example.case.to_dict() if not example.ok else None
    return row


def closest_pass(examples: Sequence[Any]) -> Any | None:
    """The passing example that came closest to its tolerance (highest worst ratio, above 0):
    the near miss a nightly run should keep in full, to replay and understand before it fails."""
    closest, closest_ratio = None, 0.0
    for e in examples:
        worst = e.verdict.worst() if e.ok and e.verdict is not None else None
        if worst is not None and worst.ratio > closest_ratio:
            closest, closest_ratio = e, worst.ratio
    return closest


def _counts(rows: Sequence[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[str(r[key])] = out.get(str(r[key]), 0) + 1
    return dict(sorted(out.items()))


def build_report(result: SearchResult, meta: dict[str, Any]) -> dict[str, Any]:
    rows = [case_row(e) for e in result.examples]
    near = closest_pass(result.examples)
    closest = None if near is None else {**case_row(near), "case": near.case.to_dict()}
    failure = None
    if result.failure is not None:
        f = result.failure
        failure = {
            "property": f.name,
            "case_hash": f.case.hash,
            "summary": f.summary(),
            "first_divergence": str(f.first_divergence),
            "repro_file": str(f.repro_path) if f.repro_path else None,
            "replay": replay_command(f.repro_path) if f.repro_path else None,
            "case": f.case.to_dict(),
        }
    first = None
    if result.first_failure is not None:
        f = result.first_failure
        first = {
            "case_hash": f.case.hash,
            "seconds": round(result.first_failure_seconds or 0.0, 3),
            "first_divergence": str(f.first_divergence),
            "file": f"first-failure-{f.case.hash}.json",
        }
    passing = [r["worst_ratio"] for r in rows if r["ok"] and isinstance(r["worst_ratio"], float)]
    return finish(
        "fuzz",
        rows,
        seconds=result.seconds,
        engine=meta.get("engine"),
        seed=meta.get("seed"),
        ok=result.ok,
        failures=[failure] if failure is not None else None,
        **{k: v for k, v in meta.items() if k not in ("engine", "seed")},
        examples=len(rows),
        passed=sum(r["ok"] for r in rows),
        failed=sum(not r["ok"] for r in rows),
        by_precision=_counts(rows, "precision"),
        by_world_size=_counts(rows, "world_size"),
        by_model=_counts(rows, "model"),
        worst_ratio=max(passing, default=None),
        failure=failure,
        first_failure=first,
        shrink_note=result.shrink_note,
        closest_pass=closest,
    )


def _closest_html(report: dict[str, Any]) -> str:
    import html
    import json

    closest = report.get("closest_pass")
    if closest is None:
        return "<h2>Closest pass</h2><p>Every passing case agreed bit for bit.</p>"
    e = html.escape
    return (
        f"<h2>Closest pass</h2><p>Case {e(closest['case_hash'])} came to {closest['worst_ratio']:.3g}x its tolerance"
        f" at {e(closest['worst_where'] or '')} (file <code>closest-pass-{e(closest['case_hash'])}.json</code>).</p>"
        f"<pre>{e(json.dumps(closest['case'], indent=2, sort_keys=True))}</pre>"
    )


def write_report(result: SearchResult, out_dir: str | Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write report.json and report.html into `out_dir`; return both paths."""
    from fsdp_verify.reports.page import render

    report = build_report(result, meta)
    json_path, html_path = write(report, out_dir)
    html_path.write_text(render(report, _closest_html(report)))
    return json_path, html_path
