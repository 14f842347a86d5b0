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


def build(c, seconds: float, summary: str, argv: list[str]) -> dict[str, Any]:
    key = hashlib.sha256(json.dumps([m["params"] for m in c.ref.meta[:1] + c.got.meta[:1]]).encode()).hexdigest()[:12]
    judged = [f for f in c.judged if f.kind in ("deviation", "data", "missing", "check")]
    worst = max(judged, key=lambda f: f.ratio, default=None)
    ratios: dict[str, dict[str, float]] = {}
    for f in judged:
        steps = ratios.setdefault(f.comparator, {})
        steps[str(f.step)] = max(steps.get(str(f.step), 0.0), f.ratio)
    first = c.first_divergence
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
            "steps": c.steps,
            "rules": c.rules_used(),
            "unjudged": sum(1 for f in c.findings if f.mode == "unjudged"),
            "notes": c.notes,
            "first_divergence": _record(first) if first else None,
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


def write(report: dict[str, Any], out: str | Path, table_text: str, rules_text: str) -> tuple[Path, Path]:
    from fsdp_verify.reports.page import render

    out = Path(out)
    json_path = dump(report, out / "report.json")
    c = report["compare"]
    e = html.escape
    notes = "".join(f"<p class=warn>{e(n)}</p>" for n in c["notes"])
    extra = (
        f"<h2>Runs</h2><p>reference <code>{e(c['reference'])}</code> (world size {c['world_sizes']['reference']}),"
        f" sharded <code>{e(c['sharded'])}</code> (world size {c['world_sizes']['sharded']}), calibration"
        f" <code>{e(str(c['calibration']))}</code></p>{notes}<h2>Steps x phases</h2><pre>{e(table_text)}</pre>"
        f"<h2>Rules</h2><pre>{e(rules_text)}</pre><h2>Records (failures, then the closest to their tolerance)</h2>"
        + _records_table(report)
    )
    html_path = out / "report.html"
    html_path.write_text(render(report, extra))
    return json_path, html_path
