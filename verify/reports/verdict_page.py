"""One verdict as a self-contained HTML page: where a person would rather look than read.

A heat map of steps x phases (how close each cell came to its tolerance, failures in red), a line
plot of the worst ratio per phase over the steps (log scale), the summary and the worst findings.
"""

from __future__ import annotations

import html
import math
from pathlib import Path

from fsdp_verify.compare.finding import Finding
from fsdp_verify.reports.zoom_page import zoom_section
from fsdp_verify.trace import PHASES, sort_key
from fsdp_verify.verdict import PHASE_TITLES, Verdict, cell_text

COLOURS = ("#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666", "#1f78b4")


def _cells(verdict: Verdict) -> dict[tuple[int, str], list[Finding]]:
    cells: dict[tuple[int, str], list[Finding]] = {}
    for f in verdict.findings:
        cells.setdefault((f.step, f.phase), []).append(f)
    return cells


def _cell_colour(findings: list[Finding]) -> tuple[str, str]:
    text = cell_text(findings)
    if any(not f.ok for f in findings):
        return "#e34a33", text
    if text in ("exact", "ok"):
        return "#c7e9c0", text
    if text in ("n/a", "-"):
        return "#eeeeee", text
    worst = max(f.ratio for f in findings if f.kind == "deviation")
    shade = min(1.0, max(0.0, (math.log10(worst) + 6) / 6))  # 1e-6 .. 1 -> light .. dark
    green = int(233 - 120 * shade)
    return f"rgb(255,{green},{int(192 - 150 * shade)})", f"{worst:.2g}"


def heat_map(verdict: Verdict) -> str:
    cells = _cells(verdict)
    phases = [p for p in PHASES if any(k[1] == p for k in cells)]
    head = "".join(f"<th>{html.escape(PHASE_TITLES[p])}</th>" for p in phases)
    rows = []
    for step in sorted({s for s, _ in cells}):
        tds = []
        for p in phases:
            fs = cells.get((step, p))
            if not fs:
                tds.append("<td></td>")
                continue
            colour, text = _cell_colour(fs)
            tds.append(f'<td style="background:{colour}">{text}</td>')
        rows.append(f"<tr><th>step {step}</th>{''.join(tds)}</tr>")
    return f"<table class=heat><tr><th></th>{head}</tr>{''.join(rows)}</table>"


def ratio_plot(verdict: Verdict, width: int = 760, height: int = 280) -> str:
    """log10 of the worst deviation/tolerance ratio per phase and step; the dashed line is 1."""
    cells = _cells(verdict)
    steps = sorted({s for s, _ in cells})
    if not steps:
        return ""
    ratios = [f.ratio for f in verdict.findings if f.kind == "deviation" and 0 < f.ratio < math.inf]
    lo, hi = -8.0, float(min(8, max(2, math.ceil(math.log10(max(ratios, default=1.0)))) // 2 * 2 + 2))
    x0, y0, w, h = 50, 10, width - 230, height - 40

    def xy(step: int, value: float) -> tuple[float, float]:
        x = x0 + (w * (step - steps[0]) / max(1, steps[-1] - steps[0]))
        v = min(hi, max(lo, value))
        return x, y0 + h * (hi - v) / (hi - lo)

    parts = [f'<svg width="{width}" height="{height}" xmlns="http://www.w3.org/2000/svg" font-size="11">']
    for v in range(int(lo), int(hi) + 1, 2):
        _, y = xy(steps[0], v)
        parts.append(
            f'<text x="4" y="{y + 4:.0f}">1e{v}</text><line x1="{x0}" x2="{x0 + w}" y1="{y:.0f}" y2="{y:.0f}" stroke="#eee"/>'
        )
    _, y1 = xy(steps[0], 0)
    parts.append(f'<line x1="{x0}" x2="{x0 + w}" y1="{y1:.0f}" y2="{y1:.0f}" stroke="#e34a33" stroke-dasharray="4"/>')
    numeric = [
        p for p in PHASES if any(k[1] == p and any(f.kind == "deviation" for f in fs) for k, fs in cells.items())
    ]
    for i, phase in enumerate(numeric):
        colour = COLOURS[i % len(COLOURS)]
        points = []
        for s in steps:
            fs = [f for f in cells.get((s, phase), []) if f.kind == "deviation"]
            if fs:
                worst = max(f.ratio for f in fs)
                points.append(xy(s, math.log10(worst) if worst > 0 else lo))
        path = " ".join(f"{x:.0f},{y:.0f}" for x, y in points)
        parts.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="2"/>')
        parts.append(
            f'<text x="{x0 + w + 10}" y="{y0 + 14 * i + 10}" fill="{colour}">{html.escape(PHASE_TITLES[phase])}</text>'
        )
    for s in steps:
        x, _ = xy(s, lo)
        parts.append(f'<text x="{x - 4:.0f}" y="{height - 8}">{s}</text>')
    parts.append("</svg>")
    return "".join(parts)


def render(verdict: Verdict, top: int = 20) -> str:
    worst = sorted(verdict.findings, key=lambda f: (f.ok, -f.ratio, sort_key(f.key)))[:top]
    rows = "".join(
        f"<tr class={'bad' if not f.ok else 'ok'}><td>{f.step}</td><td>{html.escape(f.phase)}</td>"
        f"<td>{html.escape(f.name)}</td><td>{f.kind}</td><td>{f.normwise:.3g}</td><td>{f.tolerance:.3g}</td>"
        f"<td>{f.ratio:.3g}</td><td>{html.escape(f.mode)}</td><td>{html.escape(f.message or f.why)}</td></tr>"
        for f in worst
    )
    status = "EQUIVALENT" if verdict.ok else "DIVERGED"
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>fsdp-verify {status} {verdict.case.hash}</title>
<style>body{{font-family:sans-serif;margin:2em;max-width:70em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #ccc;padding:3px 6px;font-size:13px}} .heat td{{text-align:center;min-width:5em}}
tr.bad td{{background:#fde0dd}} .summary{{padding:1em;background:{"#e5f5e0" if verdict.ok else "#fee0d2"}}}</style>
</head><body><h1>fsdp-verify: {status}</h1><p class=summary>{html.escape(verdict.summary())}</p>
<h2>Steps x phases</h2><p>Each cell: the worst ratio of deviation to tolerance among its records (below 1 passes).</p>
{heat_map(verdict)}<h2>How close each phase came to its tolerance</h2>{ratio_plot(verdict)}
{zoom_section(verdict.zoom.to_dict() if verdict.zoom is not None else None)}
<h2>Findings, failures and closest calls first</h2><table><tr><th>step</th><th>phase</th><th>name</th><th>kind</th>
<th>deviation</th><th>tolerance</th><th>ratio</th><th>mode</th><th>why / message</th></tr>{rows}</table>
<h2>Case</h2><pre>{html.escape(verdict.case.to_json())}</pre></body></html>"""


def save_html(verdict: Verdict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(verdict))
    return path
