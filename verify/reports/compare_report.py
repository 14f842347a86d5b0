"""`fsdp-verify compare`'s report in the one report format: the pair of runs is the report's one
case (so merge, diff and trend read it like any other), and a `compare` block holds what only a
comparison of recorded runs has: the runs, the rule each record was held to, the records."""

from __future__ import annotations

import hashlib
import html
import json
import math
from pathlib import Path
from typing import Any

from fsdp_verify.reports.report import finish
from fsdp_verify.reports.schema import dump, ratio


def _record(f) -> dict[str, Any]:
    numeric = f.kind == "deviation"
    return {
        "step": f.step,
        "phase": f.phase,
        "name": f.name,
        "ok": f.ok,
        "rule": f.mode if numeric else "check",
        "deviation": ratio(f.normwise) if numeric else None,
        "tolerance": ratio(f.tolerance) if numeric else None,
        "ratio": ratio(f.ratio) if f.mode != "unjudged" else None,
        "why": f.why,
        "message": f.message,
    }


def _run(run, role: str) -> dict[str, Any]:
    """What the page's Runs table says of one run: where, how many ranks and steps, in what."""
    meta = run.meta[0]
    return {
        "role": role,
        "path": str(run.path),
        "world_size": run.world_size,
        "steps": meta.get("steps"),
        "optimizer_steps": meta.get("optimizer_steps"),
        "optimizer": meta.get("optimizer"),
        "dtypes": sorted({d for m in run.meta for d in m.get("dtypes_seen", {}).get("params", [])}),
        "torch": meta.get("torch"),
    }


def build(c, seconds: float, summary: str, argv: list[str]) -> dict[str, Any]:
    key = hashlib.sha256(json.dumps([m["params"] for m in c.ref.meta[:1] + c.got.meta[:1]]).encode()).hexdigest()[:12]
    judged = [f for f in c.judged if f.kind in ("deviation", "data", "missing", "check")]
    worst = max(judged, key=lambda f: f.ratio, default=None)
    ratios: dict[str, dict[str, float]] = {}
    for f in judged:
        steps = ratios.setdefault(f.comparator, {})
        steps[str(f.step)] = max(steps.get(str(f.step), 0.0), f.ratio)
    first = (c.not_sharded or [c.first_divergence])[0]
    first_text = None if first is None else f"{first.comparator} @ {first.step}/{first.phase} {first.name}"
    row = {
        "index": None,
        "case_hash": key,
        "key": key,
        "ok": c.ok,
        "status": "pass" if c.ok else "fail",
        "seconds": round(seconds, 3),
        "model": "recorded runs",
        "world_size": c.got.world_size,
        "mesh_shape": None,
        "precision": ",".join(sorted({d for m in c.got.meta for d in m.get("dtypes_seen", {}).get("params", [])})),
        "steps": c.steps,
        "worst_ratio": ratio(worst.ratio) if worst else None,
        "worst_where": f"step {worst.step} {worst.phase} {worst.name}" if worst else None,
        "first_divergence": first_text,
        "summary": None if c.ok else summary,
        "ratios": {k: {s: ratio(v) for s, v in steps.items()} for k, steps in ratios.items()},
    }
    failures = (
        None
        if c.ok
        else [{"case_hash": key, "summary": summary, "first_divergence": first_text, "replay": " ".join(argv)}]
    )
    return finish(
        "compare",
        [row],
        seconds=seconds,
        engine=None,
        failures=failures,
        compare={
            "reference": str(c.ref.path),
            "sharded": str(c.got.path),
            "calibration": str(c.calibration.path) if c.calibration else None,
            "world_sizes": {"reference": c.ref.world_size, "sharded": c.got.world_size},
            "runs": [_run(c.ref, "reference"), _run(c.got, "sharded")]
            + ([_run(c.calibration, "calibration")] if c.calibration else []),
            "summary": summary,
            "verdict": "not_sharded" if c.not_sharded else ("equivalent" if c.ok else "diverged"),
            "replay": " ".join(argv),
            "steps": c.steps,
            "rules": c.rules_used(),
            "unjudged": sum(1 for f in c.findings if f.mode == "unjudged"),
            "notes": c.notes,
            "first_divergence": _record(c.first_divergence) if c.first_divergence else None,
            "not_sharded": [_record(f) for f in c.not_sharded],
            "records": [_record(f) for f in c.findings],
        },
    )


def _records_table(report: dict[str, Any]) -> str:
    e = html.escape
    records = sorted(report["compare"]["records"], key=lambda r: (r["ok"], -(_num(r["ratio"]) or 0)))[:200]
    body = "".join(
        f"<tr class={'ok' if r['ok'] else 'bad'}><td>{r['step']}</td><td>{e(r['phase'])}</td><td>{e(r['name'])}</td>"
        f"<td>{e(r['rule'])}</td><td>{_fmt(r['deviation'])}</td><td>{_fmt(r['tolerance'])}</td><td>{_fmt(r['ratio'])}</td>"
        f"<td>{e(r['message'])}</td></tr>"
        for r in records
    )
    return (
        "<table id=records><tr><th>step</th><th>phase</th><th>name</th><th>rule</th><th>deviation</th><th>tolerance</th>"
        f"<th>ratio</th><th>values / message</th></tr>{body}</table>"
    )


def _num(v):
    return math.inf if v == "inf" else v


def _fmt(v) -> str:
    return "" if v is None else ("inf" if v == "inf" else f"{v:.3g}")


def _runs_table(c: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><th>{e(r['role'])}</th><td><code>{e(r['path'])}</code></td><td>{r['world_size']}</td>"
        f"<td>{r['steps']}</td><td>{r['optimizer_steps']}</td><td>{e(str(r['optimizer']))}</td>"
        f"<td>{e(', '.join(r['dtypes']))}</td><td>{e(str(r['torch']))}</td></tr>"
        for r in c["runs"]
    )
    return (
        "<table id=runs><tr><th></th><th>run</th><th>world size</th><th>steps recorded</th>"
        f"<th>optimizer steps</th><th>optimizer</th><th>parameter dtypes</th><th>torch</th></tr>{rows}</table>"
    )


def render(report: dict[str, Any], table_text: str, rules_text: str) -> str:
    """compare's own page: one pair of runs, so none of the sweep page's per-case widgets (engine,
    cases a minute, the histogram of cases' worst ratios, the slowest cases). The verdict, the runs,
    the rules used and the steps x phases table first; then the ratios per step and the records."""
    from fsdp_verify.reports.page import page, ratio_series
    from fsdp_verify.reports.plots import line_chart

    c, e = report["compare"], html.escape
    status = "PASS" if report["ok"] else ("NOT SHARDED" if c.get("verdict") == "not_sharded" else "FAIL")
    parts = [f'<h1 id="status" class="{"pass" if report["ok"] else "fail"}">fsdp-verify compare: {status}</h1>']
    if report["ok"]:
        parts.append(f"<p id=verdict>{e(c['summary'])}</p>")
    else:
        parts.append(
            f'<section id="failures" class="failures"><h2>{"Not sharded" if c.get("not_sharded") else "First divergence"}</h2><p>{e(c["summary"])}</p>'
            f"<p>Replay: <code>{e(c['replay'])}</code></p></section>"
        )
    parts.append(f"<h2>Runs</h2>{_runs_table(c)}<p>Compared: {c['steps']} steps.</p>")
    parts.append("".join(f"<p class=warn>{e(n)}</p>" for n in c["notes"]))
    parts.append(f"<h2>Rules</h2><pre id=rules>{e(rules_text)}</pre>")
    parts.append(f"<h2>Steps x phases</h2><pre id=steps>{e(table_text)}</pre>")
    series, labels = ratio_series(report["cases"])
    if series:
        parts.append("<h2>Deviation / tolerance per comparator and step</h2>")
        parts.append("<p>The judged records' worst ratio; the dashed line is the tolerance (ratio 1).</p>")
        parts.append(line_chart(series, labels, name="ratios"))
    parts.append("<h2>Records (failures, then the closest to their tolerance)</h2>" + _records_table(report))
    env = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in report["environment"].items())
    parts.append(
        f"<p>Compared in {report['seconds']:.1f} s. Written {e(report['created'])}.</p>"
        f"<details><summary>Environment</summary><table>{env}</table></details>"
    )
    return page(f"fsdp-verify compare: {status}", "".join(parts))


def write(report: dict[str, Any], out: str | Path, table_text: str, rules_text: str) -> tuple[Path, Path]:
    out = Path(out)
    json_path = dump(report, out / "report.json")
    html_path = out / "report.html"
    html_path.write_text(render(report, table_text, rules_text))
    return json_path, html_path
