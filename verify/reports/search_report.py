"""The equivalence report of a property search (the nightly job's output): report.json for
machines and a self-contained report.html for people: counts, time, a histogram of how close each
case came to its tolerance, and every failure with the command that replays it."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fsdp_verify.properties.search import SearchResult
from fsdp_verify.repro.files import replay_command

# Histogram bins of log10(worst deviation / tolerance); exact agreement (ratio 0) gets its own.
BIN_EDGES = (-6, -5, -4, -3, -2, -1, 0, 1, 2)


def case_row(example) -> dict[str, Any]:
    """One generated case: what it was, whether it passed, how close it came (worst ratio)."""
    c = example.case
    worst = example.verdict.worst() if example.verdict is not None else None
    return {
        "case_hash": c.hash,
        "ok": example.ok,
        "seconds": round(example.seconds, 3),
        "model": c.model.kind,
        "world_size": c.world_size,
        "precision": c.precision.param_dtype or "fp32",
        "steps": c.steps,
        "worst_ratio": worst.ratio if worst is not None else None,
        "worst_where": f"step {worst.step} {worst.phase} {worst.name}" if worst is not None else None,
        # Every failing case in full, not only the shrunk one: a flaky failure may not shrink to
        # itself, and the first one seen is often the clearest.
        "case": c.to_dict() if not example.ok else None,
        "summary": example.failure.summary() if example.failure is not None else None,
    }


def closest_pass(examples: Sequence[Any]) -> Any | None:
    """The passing example that came closest to its tolerance (highest worst ratio, above 0):
    the near miss a nightly run should keep in full, to replay and understand before it fails."""
    closest, closest_ratio = None, 0.0
    for e in examples:
        worst = e.verdict.worst() if e.ok and e.verdict is not None else None
        if worst is not None and worst.ratio > closest_ratio:
            closest, closest_ratio = e, worst.ratio
    return closest


def build_report(result: SearchResult, meta: dict[str, Any]) -> dict[str, Any]:
    rows = [case_row(e) for e in result.examples]
    near = closest_pass(result.examples)
    closest = None
    if near is not None:
        closest = {**case_row(near), "case": near.case.to_dict()}
    failure = None
    if result.failure is not None:
        f = result.failure
        failure = {
            "property": f.name,
            "case_hash": f.case.hash,
            "summary": f.summary(),
            "first_divergence": f.first_divergence,
            "repro_file": str(f.repro_path) if f.repro_path else None,
            "replay": replay_command(f.repro_path) if f.repro_path else None,
            "case": f.case.to_dict(),
        }
    return {
        **meta,
        "ok": result.ok,
        "examples": len(rows),
        "passed": sum(r["ok"] for r in rows),
        "failed": sum(not r["ok"] for r in rows),
        "seconds": round(result.seconds, 2),
        "by_precision": _counts(rows, "precision"),
        "by_world_size": _counts(rows, "world_size"),
        "by_model": _counts(rows, "model"),
        "worst_ratio": max((r["worst_ratio"] for r in rows if r["ok"] and r["worst_ratio"] is not None), default=None),
        "failure": failure,
        "closest_pass": closest,
        "cases": rows,
    }


def _counts(rows: Sequence[dict[str, Any]], key: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in rows:
        out[str(r[key])] = out.get(str(r[key]), 0) + 1
    return dict(sorted(out.items()))


def histogram(ratios: Sequence[float]) -> list[tuple[str, int]]:
    """(label, count) per bin of log10(ratio); ratio 0 is 'exact', >= 1 means over tolerance."""
    labels = ["exact", f"<1e{BIN_EDGES[0]}"]
    labels += [f"1e{a}..1e{b}" for a, b in zip(BIN_EDGES, BIN_EDGES[1:])]
    labels.append(f">=1e{BIN_EDGES[-1]}")
    counts = [0] * len(labels)
    for r in ratios:
        if r == 0:
            counts[0] += 1
            continue
        e = math.log10(r)
        i = sum(1 for edge in BIN_EDGES if e >= edge)
        counts[1 + i] += 1
    return list(zip(labels, counts))


def svg_histogram(bins: Sequence[tuple[str, int]], width: int = 640, height: int = 220) -> str:
    """An inline SVG bar chart; bars at or over tolerance (ratio >= 1) in red."""
    top = max((c for _, c in bins), default=0) or 1
    bar_w = width / len(bins)
    plot_h = height - 50
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" role="img">']
    for i, (label, count) in enumerate(bins):
        h = plot_h * count / top
        x, y = i * bar_w + 4, 20 + plot_h - h
        over = label.startswith(">=") or label.startswith("1e0..")
        colour = "#c0392b" if over else "#2e86c1"
        parts.append(f'<rect x="{x:.1f}" y="{y:.1f}" width="{bar_w - 8:.1f}" height="{h:.1f}" fill="{colour}"/>')
        parts.append(
            f'<text x="{x + (bar_w - 8) / 2:.1f}" y="{y - 4:.1f}" font-size="11" text-anchor="middle">{count}</text>'
        )
        parts.append(
            f'<text x="{x + (bar_w - 8) / 2:.1f}" y="{height - 14}" font-size="10" text-anchor="middle">'
            f"{html.escape(label)}</text>"
        )
    parts.append("</svg>")
    return "".join(parts)


def _ratio(value: float | None) -> str:
    return "" if value is None else f"{value:.3g}"


def render_html(report: dict[str, Any]) -> str:
    e = html.escape
    ratios = [r["worst_ratio"] for r in report["cases"] if r["worst_ratio"] is not None]
    status = "PASS" if report["ok"] else "FAIL"
    rows = "".join(
        f"<tr><td>{e(r['case_hash'])}</td><td>{'ok' if r['ok'] else 'FAIL'}</td><td>{e(r['model'])}</td>"
        f"<td>{r['world_size']}</td><td>{e(r['precision'])}</td><td>{r['steps']}</td>"
        f"<td>{_ratio(r['worst_ratio'])}</td>"
        f"<td>{e(r['worst_where'] or '')}</td><td>{r['seconds']:.2f}</td></tr>"
        for r in report["cases"]
    )
    failure = report["failure"]
    failure_html = "<p>No failures.</p>"
    if failure is not None:
        failure_html = (
            f"<p><b>{e(failure['summary'])}</b></p><p>First divergence: {e(failure['first_divergence'])}</p>"
            f"<p>Replay: <code>{e(failure['replay'] or '')}</code></p>"
            f"<pre>{e(json.dumps(failure['case'], indent=2, sort_keys=True))}</pre>"
        )
    closest = report.get("closest_pass")
    closest_html = "<p>Every passing case agreed bit for bit.</p>"
    if closest is not None:
        closest_html = (
            f"<p>Case {e(closest['case_hash'])} came to {_ratio(closest['worst_ratio'])}x its tolerance at "
            f"{e(closest['worst_where'] or '')} (file <code>closest-pass-{e(closest['case_hash'])}.json</code>).</p>"
            f"<pre>{e(json.dumps(closest['case'], indent=2, sort_keys=True))}</pre>"
        )
    counts = ", ".join(f"{k}: {v}" for k, v in report["by_precision"].items())
    worlds = ", ".join(f"{k}: {v}" for k, v in report["by_world_size"].items())
    return f"""<!DOCTYPE html>
<html><head><meta charset="utf-8"><title>fsdp-verify equivalence report: {status}</title>
<style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:2px 6px;font-size:12px}}pre{{background:#f4f4f4;padding:1em}}</style>
</head><body>
<h1>fsdp-verify equivalence report: {status}</h1>
<p>Engine <code>{e(str(report.get("engine")))}</code>, property <code>{e(str(report.get("property")))}</code>:
{report["examples"]} cases run ({report["passed"]} passed, {report["failed"]} failed) in {report["seconds"]:.1f} s.
By precision: {e(counts)}. By world size: {e(worlds)}.</p>
<h2>Worst deviation / tolerance per case</h2>
<p>How close each case came to failing (below 1 passes; "exact" = bit for bit).</p>
{svg_histogram(histogram(ratios))}
<h2>Failures</h2>
{failure_html}
<h2>Closest pass</h2>
{closest_html}
<h2>Cases</h2>
<table><tr><th>case</th><th>result</th><th>model</th><th>world</th><th>precision</th><th>steps</th>
<th>worst ratio</th><th>where</th><th>seconds</th></tr>{rows}</table>
</body></html>
"""


def write_report(result: SearchResult, out_dir: str | Path, meta: dict[str, Any]) -> tuple[Path, Path]:
    """Write report.json and report.html into `out_dir`; return both paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = build_report(result, meta)
    json_path = out / "report.json"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    html_path = out / "report.html"
    html_path.write_text(render_html(report))
    return json_path, html_path
