"""report.html for any report.json: self-contained (inline CSS and SVG, no script, no network),
failures first, then the plots: deviation/tolerance per comparator and step, the histogram of
each case's worst ratio, the zoo's detection matrix, the slowest cases; then every case."""

from __future__ import annotations

import html
import json
import math
from typing import Any

from fsdp_verify.reports.causes import causes_of, html_section
from fsdp_verify.reports.plots import hbars, histogram, line_chart, svg_histogram, zoo_matrix
from fsdp_verify.reports.schema import as_float

STYLE = """body{font-family:sans-serif;margin:2em;max-width:80em}table{border-collapse:collapse}
td,th{border:1px solid #ccc;padding:2px 6px;font-size:12px}pre{background:#f4f4f4;padding:1em;overflow:auto}
.failures{background:#fde0dd;border:2px solid #c0392b;padding:0.5em 1em}.pass{color:#1e8449}.fail{color:#c0392b}
tr.bad td{background:#fde0dd}.cause{border-top:1px solid #c0392b;margin-top:0.5em}.cause h3{margin:0.4em 0}.warn{background:#fff3cd;padding:0.5em 1em}"""

MAX_ROWS = 2000


def _fmt(value: Any) -> str:
    v = as_float(value) if isinstance(value, (int, float, str)) or value is None else None
    if v is None:
        return ""
    return "inf" if math.isinf(v) else f"{v:.3g}"


def page(title: str, body: str) -> str:
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{body}</body></html>\n"
    )


def _failure_item(f: dict[str, Any]) -> str:
    """A failure no case row stands for (selftest's uncaught bugs): its own paragraph."""
    e = html.escape
    replay = f"<p>Replay: <code>{e(f['replay'])}</code></p>" if f.get("replay") else ""
    case = ""
    if f.get("case"):
        case = (
            f"<details><summary>Case</summary><pre>{e(json.dumps(f['case'], indent=2, sort_keys=True))}</pre></details>"
        )
    zoomed = f"<p>Zoom: <code>{e(f['zoom'])}</code></p>" if f.get("zoom") else ""
    return (
        f"<div class=failure><p><b>{e(f['case_hash'])}</b>: {e(f['summary'])}</p>"
        f"<p>First divergence: <code>{e(f['first_divergence'] or '-')}</code></p>{zoomed}{replay}{case}</div>"
    )


def failures_section(report: dict[str, Any]) -> str:
    """The failing cases grouped by cause (verify/reports/causes.py), each cause once."""
    e = html.escape
    causes = causes_of(report)
    covered = {h for c in causes for h in c["cases"]}
    items = [html_section(causes, report["cases"], report["failures"])] if causes else []
    items += [_failure_item(f) for f in report["failures"] if f["case_hash"] not in covered]
    missing = report.get("missing_shards") or []
    if missing:
        items.insert(
            0, f'<p id="missing-shards">Missing shards: <b>{e(", ".join(missing))}</b> (their cases are not here)</p>'
        )
    lost = [z["bug"] for z in report["zoo"] or [] if not z["caught"]]
    if lost:
        items.append(f"<p>Zoo bugs not caught: <b>{e(', '.join(lost))}</b></p>")
    if not items:
        return ""
    return f'<section id="failures" class="failures"><h2>Failures</h2>{"".join(items)}</section>'


def ratio_series(rows: list[dict[str, Any]]) -> tuple[dict[str, list[tuple[int, float | None]]], list[str]]:
    """Per comparator, the worst ratio over all cases at each step."""
    worst: dict[str, dict[int, float]] = {}
    for r in rows:
        for comp, steps in r["ratios"].items():
            for s, v in steps.items():
                cur = worst.setdefault(comp, {})
                cur[int(s)] = max(cur.get(int(s), 0.0), as_float(v) or 0.0)
    steps = sorted({s for d in worst.values() for s in d})
    series = {c: [(steps.index(s), d[s]) for s in sorted(d)] for c, d in sorted(worst.items())}
    return series, [f"step {s}" for s in steps]


def overview(report: dict[str, Any]) -> str:
    e = html.escape
    c = report["counts"]
    minutes = report["seconds"] / 60
    rate = f"{c['cases'] / minutes:.1f} cases/min" if minutes > 0 and c["cases"] else ""
    shard = report["shard"] or (", ".join(report.get("shards", [])) and f"merged {', '.join(report['shards'])}")
    seed = "" if report["seed"] is None else f", seed {report['seed']}"
    env = "".join(f"<tr><th>{e(k)}</th><td>{e(str(v))}</td></tr>" for k, v in report["environment"].items())
    if report["kind"] == "selftest":
        return (
            f"<p>{c['cases']} injected bugs hunted, {c['passed']} caught, {c['failed']} not, in"
            f" {report['seconds']:.1f} s. Written {e(report['created'])}.</p>"
            f"<details><summary>Environment</summary><table>{env}</table></details>"
        )
    return (
        f"<p>Engine <code>{e(str(report['engine']))}</code>"
        f"{seed}"
        f"{', shard ' + e(shard) if shard else ''}: {c['cases']} case{'' if c['cases'] == 1 else 's'}, {c['passed']} passed, "
        f"{c['failed']} failed, in {report['seconds']:.1f} s {e(rate)}. Written {e(report['created'])}.</p>"
        f"<details><summary>Environment</summary><table>{env}</table></details>"
    )


def comparators_table(report: dict[str, Any]) -> str:
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{_fmt(s['worst'])}</td><td>{_fmt(s['p99'])}</td>"
        f"<td>{s['cases']}</td><td>{s['failed']}</td></tr>"
        for name, s in report["comparators"].items()
    )
    return (
        "<table id=comparators><tr><th>comparator</th><th>worst ratio</th><th>p99</th><th>cases</th>"
        f"<th>failed</th></tr>{rows}</table>"
    )


def cases_table(rows: list[dict[str, Any]]) -> str:
    e = html.escape
    ordered = sorted(rows, key=lambda r: (r["ok"], r.get("index") if r.get("index") is not None else 0))
    body = "".join(
        f"<tr class={'ok' if r['ok'] else 'bad'}><td>{'' if r.get('index') is None else r['index']}</td>"
        f"<td>{e(r['case_hash'])}</td><td>{e(r['status'])}</td><td>{e(str(r.get('model', '')))}</td>"
        f"<td>{r.get('world_size', '')}</td><td>{e(str(r.get('precision', '')))}</td><td>{e(_knobs(r))}</td>"
        f"<td>{_fmt(r['worst_ratio'])}</td>"
        f"<td>{e(r['first_divergence'] or r.get('worst_where') or '')}</td><td>{r['seconds']:.2f}</td></tr>"
        for r in ordered[:MAX_ROWS]
    )
    more = f"<p>({len(rows) - MAX_ROWS} more in report.json)</p>" if len(rows) > MAX_ROWS else ""
    return (
        "<table id=cases><tr><th>#</th><th>case</th><th>result</th><th>model</th><th>world</th><th>precision</th><th>knobs</th>"
        f"<th>worst ratio</th><th>first divergence / worst at</th><th>seconds</th></tr>{body}</table>{more}"
    )


def _knobs(row: dict[str, Any]) -> str:
    """A row's knobs as `name=value` (reports written before rows had them: none)."""
    return " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in (row.get("knobs") or {}).items())


def interrupted_banner(report: dict[str, Any]) -> str:
    """A run stopped by Ctrl-C says so before anything else: its counts are of the cases that ran."""
    if not report.get("interrupted"):
        return ""
    seed = f" (seed {report['seed']})" if report.get("seed") is not None else ""
    return (
        f'<p id="interrupted" class="fail">Interrupted (Ctrl-C) after {len(report["cases"])} cases{seed}:'
        " this report holds only the cases that ran before it.</p>"
    )


def render(report: dict[str, Any], extra_html: str = "") -> str:
    status = "PASS" if report["ok"] else "FAIL"
    rows = report["cases"]
    parts = [
        f'<h1 id="status" class="{status.lower()}">fsdp-verify {html.escape(report["kind"])}: {status}</h1>',
        interrupted_banner(report),
        failures_section(report),
        overview(report),
    ]
    if rows:
        series, labels = ratio_series(rows)
        if series:
            parts.append("<h2>Deviation / tolerance per comparator and step</h2>")
            parts.append("<p>The worst ratio over all cases; the dashed line is the tolerance (ratio 1).</p>")
            parts.append(line_chart(series, labels, name="ratios"))
        worst = [as_float(r["worst_ratio"]) for r in rows if r["worst_ratio"] is not None]
        parts.append("<h2>Worst ratio per case</h2><p>How close each case came to failing (exact = bit for bit).</p>")
        parts.append(svg_histogram(histogram(worst)))
        parts.append("<h2>Comparators</h2>" + comparators_table(report))
    if report["zoo"]:
        caught = sum(z["caught"] for z in report["zoo"])
        parts.append(f"<h2>Bug zoo: {caught}/{len(report['zoo'])} caught</h2>" + zoo_matrix(report["zoo"]))
    if rows:
        slow = sorted(rows, key=lambda r: -r["seconds"])[:10]
        parts.append("<h2>Slowest cases</h2>" + hbars([(r["case_hash"], r["seconds"]) for r in slow], name="slowest"))
    parts.append(extra_html)
    if rows:
        parts.append("<h2>Cases</h2>" + cases_table(rows))
    return page(f"fsdp-verify {report['kind']}: {status}", "".join(parts))
